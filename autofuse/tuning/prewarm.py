"""Compiling a batch's Triton kernels in parallel processes before the worker measures them.

A Triton configuration compiles at its first call, in the worker, one at a time: 2-5 s each on
an H100's host, and the gate's odd-sized case compiles another specialization, so on 99 at fp32
about half of a search's seconds went to compiling one kernel after another. Before the worker
measures a batch of trials (``autofuse.tuning.search``), ``warm`` (for the batch classes' rungs,
``submit``, waited for a rung at a time while the worker races the rungs before it) has a pool
of processes run each Triton candidate once at the shapes it will run at, under
``launch.compiling_only``: Triton compiles exactly what the launch would run into its on-disk
cache, and nothing is launched, so the GPU the worker times is left alone. The worker's first
call then loads the kernel instead of compiling it, from the one cache both use
(``worker.share_tritons_cache``: Inductor would move the worker's).

Nothing depends on it: a candidate that fails here, a pool that breaks or a Triton whose launch
internals autofuse does not know (``launch.unsupported``) leaves the compile to the worker, which
records any failure as it always did. Off on the CPU (the interpreter compiles nothing) and with
``AUTOFUSE_PREWARM=0``.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import multiprocessing
import os
import signal
import traceback
from typing import NamedTuple

import torch

from autofuse.core import registry
from autofuse.tuning import timeline
from autofuse.tuning.outcome import Candidate
from autofuse.tuning.worker import redirect_output, share_tritons_cache

# Seconds the caller waits for a batch's compiles before it goes on (and the worker compiles).
WAIT_S = 300.0
_pool: concurrent.futures.ProcessPoolExecutor | None = None
_submitted: dict[tuple, concurrent.futures.Future] = {}  # what this pool was asked to compile, by candidate


def jobs() -> int:
    """Processes compiling at once: the host's cores less two (the tuner and its worker), at most 8."""
    return max(1, min(8, (os.cpu_count() or 1) - 2))


def enabled(device: str) -> bool:
    return torch.device(device).type == "cuda" and os.environ.get("AUTOFUSE_PREWARM", "1") != "0"


def start(device: str, log: str | None = None) -> None:
    """Start the pool's processes without waiting for them (each imports torch and Triton and
    opens a CUDA context: seconds), so they are ready when the search's second batch comes.
    What they print goes to ``log`` (the key's, as the worker's does), and Ctrl-C is the
    tuner's to answer (``worker``'s reasons)."""
    global _pool
    if _pool is not None or not enabled(device) or _unsupported():
        return
    share_tritons_cache()  # the worker's, where it started first
    try:
        _pool = concurrent.futures.ProcessPoolExecutor(jobs(), mp_context=multiprocessing.get_context("spawn"),
                                                       initializer=_quiet)
        # Shut down before the interpreter's teardown: collected during it, the executor's
        # callback printed "AttributeError: 'NoneType' object has no attribute 'util'".
        atexit.register(_shutdown, True)
        for _ in range(jobs()):
            _pool.submit(_ready, device, log)
    except (RuntimeError, OSError):
        _shutdown()


class Compile(NamedTuple):
    """A candidate to compile: its variant and configuration, the shape it will run at, and
    whether it runs with gradients (its backward's kernels too)."""

    variant: str
    params: dict
    shape: dict
    autograd: bool = False


def begin(problem: str, device: str, dtype: str, mode: str, precision: str,
          candidates: list[Compile | tuple[str, dict, dict]], log: str | None = None) -> Pending:
    """Start compiling the Triton kernels of ``candidates`` (``Compile``s, or (variant,
    configuration, shape) for a forward without gradients; one process per candidate) where two or
    more are Triton's (``submit``): one alone is left to the worker, since compiling it here first
    would gain nothing. ``Pending.wait`` returns when all are done, or after ``WAIT_S``."""
    if sum(is_triton(registry.variants(problem).get(c[0])) for c in candidates) < 2:
        return Pending([])
    return submit(problem, device, dtype, mode, precision, candidates, log)


class Pending:
    """Compiles ``submit`` started; ``wait`` returns when they are done, or after ``WAIT_S``."""

    def __init__(self, futures: list):
        self.futures = futures

    def wait(self) -> None:
        if not self.futures:
            return
        try:
            with timeline.span(f"compile pool: wait for {len(self.futures)} compiles"):
                concurrent.futures.wait(self.futures, timeout=WAIT_S)
        except (concurrent.futures.process.BrokenProcessPool, RuntimeError, OSError):
            _shutdown()


def submit(problem: str, device: str, dtype: str, mode: str, precision: str,
           candidates: list[Compile | tuple[str, dict, dict]], log: str | None = None) -> Pending:
    """Start compiling the Triton kernels of ``candidates`` (as ``warm``) and return at once, so
    the caller's worker may measure something else meanwhile (a lone candidate too: it gains by
    the overlap); ``Pending.wait`` before the worker runs them. A candidate submitted before (in
    flight or done) is not compiled again: its compile is waited for, not started over in another
    process, which would finish later (Triton's cache has no lock across processes)."""
    variants = registry.variants(problem)
    todo = [Compile(*c) for c in candidates if is_triton(variants.get(c[0]))]
    if not todo or not enabled(device) or _unsupported():
        return Pending([])
    start(device, log)
    futures = []
    try:
        for c in todo:
            key = (problem, device, dtype, mode, precision, c.variant, repr(sorted(c.params.items())),
                   repr(sorted(c.shape.items())), c.autograd)
            if key not in _submitted:
                _submitted[key] = _pool.submit(compile_candidate, problem, device, dtype, mode, precision, c.variant,
                                               c.params, c.shape, log, c.autograd)
            futures.append(_submitted[key])
        return Pending(futures)
    except (concurrent.futures.process.BrokenProcessPool, RuntimeError, OSError, AttributeError):
        _shutdown()  # a pool process died (or could not start): the worker compiles; a new pool next time
        return Pending([])


def _quiet() -> None:
    """A pool process's initializer: Ctrl-C reaches the terminal's whole process group, and the
    tuner alone answers it (a handler, not SIG_IGN, which the compilers would inherit)."""
    signal.signal(signal.SIGINT, lambda signum, frame: None)


_log: list[str | None] = [None]  # where this pool process's output goes now


def _output_to(log: str | None) -> None:
    if log is not None and log != _log[0]:
        redirect_output(log)
        _log[0] = log


def _ready(device: str, log: str | None) -> None:
    """A pool process's start: what every candidate needs, imported and opened once."""
    _output_to(log)
    with timeline.span("  pool: process start (imports, CUDA context)"):
        import autofuse.kernels.triton.launch  # noqa: F401

        torch.empty(1, device=device)


def compile_candidate(problem: str, device: str, dtype: str, mode: str, precision: str, variant: str,
                      params: dict, shape: dict, log: str | None = None, autograd: bool = False) -> bool:
    """In a pool process: run the candidate once at ``shape`` with nothing launched, with
    ``autograd`` its forward with gradients and its backward too (their values are never read: a
    backward's torch operations run on what the unlaunched kernels left). Whether it compiled
    (False: it raised, which the worker will meet and record itself)."""
    _output_to(log)
    with timeline.span(lambda: f"  pool: compile {Candidate(variant, params, autograd).label()} {timeline.at(shape)}"):
        return _compile(problem, device, dtype, mode, precision, variant, params, shape, autograd)


def _compile(problem, device, dtype, mode, precision, variant, params, shape, autograd) -> bool:
    from autofuse.core.precision import parse_dtype
    from autofuse.kernels.triton.launch import compiling_only

    try:
        prob = registry.get_problem(problem)
        model, x = _case(prob, shape, device, parse_dtype(dtype), mode)
        candidate = registry.get_variant(problem, variant)(precision, **params)
        candidate.build(device)
        if not autograd:
            with compiling_only(), torch.no_grad():
                candidate(model, x)
            return True
        try:
            with compiling_only():
                out = candidate(model, x.detach().requires_grad_())
                out.backward(torch.ones_like(out))
        finally:
            model.zero_grad(set_to_none=True)  # the process's next candidate starts from none
        return True
    except Exception:  # noqa: BLE001 - any failure is the worker's to record; the log says what it was
        traceback.print_exc()
        return False


_CASES: dict = {}


def _case(prob, shape: dict, device: str, dtype, mode: str):
    """A model and input at ``shape`` made on the device (their values do not matter: nothing
    runs), kept for the process's next candidates."""
    key = (prob.name, tuple(shape.items()), device, dtype, mode)
    if key not in _CASES:
        _CASES.clear()  # one shape's at a time: a model of 8192² is 256 MB of the GPU's memory
        with torch.device(device):
            args, kwargs = prob.init_args(shape)
            model = prob.model(*args, **kwargs).to(dtype)
            model.train(mode != "eval")
            x = prob.make_input(shape, "rand", torch.Generator(device).manual_seed(0), device=device, dtype=dtype)
        _CASES[key] = (model, x)
    return _CASES[key]


def is_triton(cls) -> bool:
    """Whether ``cls`` is a ``TritonVariant`` (imported here: not every install has Triton's kinds)."""
    from autofuse.kernels.triton.variant import TritonVariant

    return cls is not None and issubclass(cls, TritonVariant)


def _unsupported() -> str | None:
    from autofuse.kernels.triton.variant import triton_missing

    reason = triton_missing()
    if reason is not None:
        return reason
    from autofuse.kernels.triton.launch import unsupported

    return unsupported()


def _shutdown(wait: bool = False) -> None:
    global _pool
    if _pool is not None:
        _pool.shutdown(wait=wait, cancel_futures=True)
        _pool = None
    _submitted.clear()
