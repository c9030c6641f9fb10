"""Candidates run in a worker subprocess, so a crash, a hang or a CUDA error is an outcome.

The parent (``Worker``) sends a job and a candidate over a pipe and waits with a timeout.
The child writes whatever it and the candidates print (file descriptors 1 and 2, so compilers'
and Inductor's output too) to the job's log (``Job.log``), not to the tuner's terminal.
A worker that dies (segfault, abort) or overruns is killed and replaced; one whose CUDA
context may be broken (illegal address) reports ``poisoned`` and is replaced too. The child
keeps its prepared check cases and timing inputs between candidates of one job, so the
float64 references are computed once per tune, not once per trial.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

if __name__ == "__main__":
    # Ctrl-C reaches the terminal's whole process group, this child too, but the parent alone
    # answers it: it closes the connection, and this child ends at EOF (or is killed 2 s later).
    # Interrupted as well, the child printed a ConnectionResetError or BrokenPipeError traceback
    # after the parent's clean message (test_bad_input). Set before the imports below (torch),
    # and as a handler, not SIG_IGN, which the compilers this child starts would inherit. The
    # child stays in the parent's process group: tune-on-miss kills a background tune by its group.
    signal.signal(signal.SIGINT, lambda signum, frame: None)

from autofuse.tuning import timeline  # noqa: E402

# Candidate and Job are defined in outcome, below evaluate (which the child runs); callers still import them from here.
from autofuse.tuning.outcome import Candidate, Job, Outcome, TrialResult  # noqa: E402, F401

STARTUP_TIMEOUT_S = 300.0
# The op that starts the imports of torch.compile's stack on a thread of the worker (``_serve``).
IMPORT_COMPILE_STACK = "import_compile_stack"


def share_tritons_cache() -> None:
    """Name Triton's on-disk cache in this process's environment, where nothing names it, so that
    the worker and the compile pool (``autofuse.tuning.prewarm``), which inherit it, keep using
    one cache. Unnamed, it moved under a worker that had run ``torch.compile`` (the ``compiled``
    variant's trials): Inductor points ``TRITON_CACHE_DIR`` at its own cache where it is unset, so
    the worker compiled every later Triton kernel again instead of loading the pool's (H100,
    kb2-99's bfloat16-model tune: first calls of 2.3-4.2 s for configurations the pool had
    compiled in 2.0-3.5 s, at the search's shape and at the batch classes' rungs)."""
    if "TRITON_CACHE_DIR" in os.environ:
        return
    try:
        from triton import knobs
    except ImportError:  # no Triton: nothing to share
        return
    os.environ["TRITON_CACHE_DIR"] = knobs.cache.dir


# -- the parent's side -----------------------------------------------------------
class Worker:
    """One worker subprocess at a time, restarted whenever a candidate breaks it.

    The child is a fresh ``python -m autofuse.tuning.worker`` (not multiprocessing's spawn, which
    would re-run the caller's ``__main__`` script), talking over its own socket so that
    whatever a variant prints cannot corrupt the protocol.
    """

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._ready = False

    def spawn(self) -> None:
        """Start the child now without waiting for it, so that its start (imports and a CUDA
        context: 3.6-5.1 s on an H200's host) overlaps the tuner's own setup (its CUDA context,
        spaces and study: 5-6 s alone, 6-8.5 beside the child's start, which then cost the first
        call nothing); the first call waits for what is left. A tune that measures nothing (a
        rerun of a tuned shape) closes it unused."""
        if self._proc is None or self._proc.poll() is not None:
            self.close()  # a child that died idle
            share_tritons_cache()
            timeline.mark_origin()  # the child's spans count from the tuner's origin
            ours, theirs = socket.socketpair()
            self._proc = subprocess.Popen([sys.executable, "-m", "autofuse.tuning.worker", str(theirs.fileno())],
                                          pass_fds=(theirs.fileno(),))
            theirs.close()
            self._conn, self._ready = Connection(ours.detach()), False

    def _start(self) -> None:
        self.spawn()
        try:
            ready = self._conn.poll(STARTUP_TIMEOUT_S) and self._conn.recv() == "ready"
        except (EOFError, ConnectionError):
            ready = False
        self._ready = ready
        if not ready:
            self.close()
            raise RuntimeError("the autofuse worker subprocess did not start (run `python -m autofuse.tuning.worker` to see why)")

    def call(self, op: str, payload: tuple, timeout: float) -> Any:
        """Run ``op`` in the worker; a death or overrun becomes a TrialResult instead of an exception."""
        with timeline.span(lambda: f"worker {timeline.describe_call(op, payload)}") as outcome:
            result = self._call(op, payload, timeout)
            outcome.append(result.outcome.value if isinstance(result, TrialResult) else "")
            return result

    def _call(self, op: str, payload: tuple, timeout: float) -> Any:
        if self._proc is None or self._proc.poll() is not None or not self._ready:
            with timeline.span("worker start (imports, CUDA context; the part not overlapped)"):
                self._start()
        self._conn.send((op, payload))
        if self._conn.poll(timeout):
            try:
                result = self._conn.recv()
            except (EOFError, ConnectionError):
                return self._died()
            if isinstance(result, TrialResult) and result.poisoned:
                self.close()
            return result
        self.close()
        return TrialResult(Outcome.TIMED_OUT, f"no result within {timeout:g} s; the worker was killed")

    def _died(self) -> TrialResult:
        try:
            code = self._proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        self.close()
        if code is not None and code < 0:
            try:
                how = f"signal {signal.Signals(-code).name}"
            except ValueError:
                how = f"signal {-code}"
        else:
            how = f"exit code {code}"
        return TrialResult(Outcome.RUNTIME_FAILED, f"the worker process died ({how})")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()  # an idle child reads EOF and exits
        if self._proc is not None:
            try:
                if not self._ready:  # still starting (spawned, never used): nothing of its to finish
                    self._proc.kill()
                self._proc.wait(2)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = self._conn = None
        self._ready = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# -- the child's side -------------------------------------------------------------
def _serve(conn) -> None:
    from autofuse.tuning import evaluate  # imported here: the parent need not import torch's CUDA state

    conn.send("ready")
    state: dict = {}
    log = None
    warming: threading.Thread | None = None
    while True:
        try:
            op, payload = conn.recv()
        except EOFError:
            return
        if op == IMPORT_COMPILE_STACK:  # answered at once; the imports run while the tuner waits elsewhere
            if warming is None:
                warming = threading.Thread(target=_import_compile_stack, name="autofuse-imports", daemon=True)
                warming.start()
            conn.send(None)
            continue
        if warming is not None and warming.is_alive():
            with timeline.span("  wait for torch.compile's imports (asked for after the first result)"):
                warming.join()  # every op runs alone: no import races it, no measurement shares the GIL with it
        wanted = getattr(payload[0], "log", None) if payload else None
        if wanted is not None and wanted != log:
            redirect_output(wanted)
            log = wanted
        try:
            result = getattr(evaluate, op)(state, *payload)
        except BaseException as exc:  # noqa: BLE001 - any failure is the candidate's outcome
            result = TrialResult(Outcome.RUNTIME_FAILED, _describe(exc), poisoned=_is_cuda_error(exc))
        conn.send(result)


def _import_compile_stack() -> None:
    """Import what ``torch.compile`` imports (dynamo, inductor), on a thread the tuner starts
    (op ``IMPORT_COMPILE_STACK``) once the search's first candidate is measured, where ``compiled``
    is in the space, while it asks its next trials and the pool compiles them. Done
    in the ``compiled`` variant's first build, they took 7.2-10 s of the worker's time in each cold
    bfloat16-model tune on an H100 host (kb2-22, kb2-99, gemm_bn; 10.9 s alone there, 2.1 s on a
    workstation's CPU), with the tuner waiting. The next op waits for it to finish (``_serve``):
    a candidate's imports never race it, and no timing shares the interpreter with it."""
    try:
        with timeline.span("  torch.compile's imports, while the worker waits"):
            import torch._dynamo  # noqa: F401
            import torch._inductor.compile_fx  # noqa: F401
    except Exception:  # noqa: BLE001 - whatever fails here fails again, and is recorded, in the candidate's own build
        pass


def main(argv: list[str]) -> None:
    try:
        _serve(Connection(int(argv[0])))
    except (ConnectionError, EOFError):
        pass  # the parent closed the connection (interrupted, or replacing this worker): nothing to say


def redirect_output(path: str) -> None:
    """Point this process's stdout and stderr (the descriptors, which child processes and C
    libraries write to as well) at ``path``, appended."""
    import os
    import pathlib

    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _describe(exc: BaseException) -> str:
    lines = traceback.format_exception_only(type(exc), exc)
    return "".join(lines).strip()[:2000]


def _is_cuda_error(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}"
    return any(marker in text for marker in ("CUDA error", "AcceleratorError", "cudaError", "CUBLAS_STATUS", "device-side assert"))


if __name__ == "__main__":
    main(sys.argv[1:])
