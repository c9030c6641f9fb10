"""Tune on miss: a call at an untuned key starts a tune of that key in a background process.

Opt-in: ``get_module(..., tune_on_miss=True)`` (or a ``TuneOnMiss`` budget), or
``AUTOFUSE_TUNE_ON_MISS=1`` for deployed code. The call that misses only queues a request (no
process start, no file I/O) and is served meanwhile by what the table has (an entry at a
stricter precision or the nearest batch, else the reference). One watcher thread per process,
waking every ``poll_s`` seconds, starts queued tunes (``python -m autofuse.serve.tune_on_miss SPEC``:
``autofuse.tune`` of that key, the same gate, writing the same table under its lock), reaps
them, and when the table file changes (inode, mtime, size) or a tune ends, re-resolves the
waiting keys and swaps the new callable into the module's dict: the call path never waits.

Bounds: one tune per key at a time across processes (the tuning process holds a lock file per
key under ``$AUTOFUSE_HOME/tune-on-miss``; a second one exits at once and its parent watches
for the first one's result); ``trials`` and ``timeout_s`` per tune (``--trials``, ``--timeout``),
and its process group is killed past ``3 * timeout_s + 120`` s (waiting for a slot, searching,
then re-timing the best few); at most ``concurrent`` tunes at once, per process (live children)
and per ``$AUTOFUSE_HOME`` (slot lock files the tuning processes take before importing torch).
A key is tuned at most once per process. Each tune logs to ``tune-on-miss/<problem>-<key>.log``.
The tunes time their candidates on the device the application is using, under its load.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING

import filelock

from autofuse.errors import InputError

if TYPE_CHECKING:
    from autofuse.serve.dispatch import CallKey

log = logging.getLogger("autofuse")

ENV_ON, ENV_TRIALS, ENV_TIMEOUT, ENV_CONCURRENT, ENV_POLL = (
    "AUTOFUSE_TUNE_ON_MISS", "AUTOFUSE_TUNE_TRIALS", "AUTOFUSE_TUNE_TIMEOUT", "AUTOFUSE_TUNE_CONCURRENT", "AUTOFUSE_TUNE_POLL")
EXIT_BUSY, EXIT_NO_SLOT = 3, 4
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class TuneOnMiss:
    """The budget of background tunes: trials and seconds of search per tune, tunes at once,
    and how often (seconds) the watcher looks for finished tunes and a changed table."""

    trials: int = 20
    timeout_s: float = 300.0
    concurrent: int = 1
    poll_s: float = 2.0

    def __post_init__(self):
        for name in ("trials", "timeout_s", "concurrent", "poll_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InputError(f"TuneOnMiss.{name} must be a number > 0, got {name}={value!r}")
        if not isinstance(self.trials, int) or not isinstance(self.concurrent, int):
            raise InputError(f"TuneOnMiss.trials and .concurrent must be ints, got {self.trials!r} and {self.concurrent!r}")

    @classmethod
    def from_env(cls, environ=os.environ) -> TuneOnMiss:
        """The defaults, overridden by AUTOFUSE_TUNE_TRIALS, _TIMEOUT, _CONCURRENT and _POLL."""
        fields = {}
        for name, var, kind in (("trials", ENV_TRIALS, int), ("timeout_s", ENV_TIMEOUT, float),
                                ("concurrent", ENV_CONCURRENT, int), ("poll_s", ENV_POLL, float)):
            if environ.get(var):
                try:
                    fields[name] = kind(environ[var])
                except ValueError:
                    raise InputError(f"{var} must be {'an integer' if kind is int else 'a number'} > 0, "
                                     f"got {environ[var]!r}") from None
        return cls(**fields)


def budget(tune_on_miss, environ=os.environ) -> TuneOnMiss | None:
    """What ``get_module(tune_on_miss=...)`` means: None reads AUTOFUSE_TUNE_ON_MISS."""
    if tune_on_miss is None:
        flag = environ.get(ENV_ON, "").strip().lower()
        if flag not in _TRUE + _FALSE:
            raise InputError(f"{ENV_ON} must be one of {_TRUE} or {_FALSE[1:]}, got {environ[ENV_ON]!r}")
        tune_on_miss = flag in _TRUE
    if tune_on_miss is True:
        return TuneOnMiss.from_env(environ)
    if tune_on_miss is False or isinstance(tune_on_miss, TuneOnMiss):
        return tune_on_miss or None
    raise InputError(f"tune_on_miss must be True, False, None or a TuneOnMiss, got {tune_on_miss!r}")


def tune_command(spec: dict) -> list[str]:
    """The argv of one background tune (tests substitute a fake)."""
    return [sys.executable, "-m", "autofuse.serve.tune_on_miss", json.dumps(spec)]


# -- the application's side ------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class Tune:
    """One background tune: queued, running, then ended with a status said once."""

    spec: dict
    log_path: pathlib.Path
    status: str = "queued"
    proc: subprocess.Popen | None = None
    started: float = 0.0
    ended: float | None = None  # monotonic time it ended
    watch_until: float = 0.0  # keep re-reading the table until then (another process tunes it)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(self.log_path, "ab") as out:
                self.proc = subprocess.Popen(tune_command(self.spec), stdin=subprocess.DEVNULL, stdout=out,
                                             stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            self._end(f"failed to start ({exc})")
            return
        self.started = time.monotonic()
        self.status = f"running (pid {self.proc.pid}, log {self.log_path})"

    def check(self) -> bool:
        """Reap or kill the process; True if it ended now."""
        code = self.proc.poll()
        if code is None and time.monotonic() - self.started > 3 * self.spec["timeout"] + 120:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the worker subprocess too
            except ProcessLookupError:
                pass  # it ended just now
            code = self.proc.wait()
            self._end(f"killed after {3 * self.spec['timeout'] + 120:g} s (log {self.log_path})")
            return True
        if code is None:
            return False
        if code == EXIT_BUSY:
            self.watch_until = time.monotonic() + 3 * self.spec["timeout"] + 120
            self._end("another process is tuning this key; its result is used once written", logging.INFO)
        elif code == EXIT_NO_SLOT:
            self._end(f"no tune slot freed within {self.spec['timeout']:g} s: {self.spec['concurrent']} tunes "
                      f"ran under {self.spec['dir']} all along (log {self.log_path})")
        elif code == 0:
            self._end(f"done (log {self.log_path})", logging.INFO)
        else:
            self._end(f"failed with exit code {code} (log {self.log_path})")
        return True

    def _end(self, status: str, level: int = logging.WARNING) -> None:
        self.status, self.ended = status, time.monotonic()
        log.log(level, "autofuse: background tune of %s %s %s: %s", self.spec["problem"], self.spec["shape"],
                self.spec["precision"], status)


@dataclasses.dataclass(frozen=True, eq=False)
class Waiting:
    """A dispatcher's call key served by a fallback until its background tune's result is in."""

    dispatcher: weakref.ref
    key: CallKey
    tune: Tune
    epoch: int
    shape: dict
    dkey: object
    device: object


class Watcher:
    """The process's one watcher thread and what it watches (see the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._tunes: dict[str, Tune] = {}
        self._waiting: list[Waiting] = []
        self._signatures: dict[pathlib.Path, tuple | None] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._poll_s = 2.0
        self._pid = os.getpid()

    def request(self, dispatcher, key, shape: dict, dkey, device) -> Tune:
        """Queue a tune of this key (once per process) and watch it for ``dispatcher``: no I/O."""
        if self._pid != os.getpid():  # a forked child: the parent's thread and processes are not its own
            self.__init__()
        spec = _spec(dispatcher, shape, dkey, device)
        with self._lock:
            tune = self._tunes.get(spec["name"])
            if tune is None:
                tune = self._tunes[spec["name"]] = Tune(spec, pathlib.Path(spec["dir"]) / f"{spec['problem_name']}-{spec['name']}.log")
            self._waiting.append(Waiting(weakref.ref(dispatcher), key, tune, dispatcher.epoch, shape, dkey, device))
            self._poll_s = min(self._poll_s, dispatcher.budget.poll_s)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="autofuse-tune-on-miss", daemon=True)
                self._thread.start()
        self._wake.set()
        return tune

    def _run(self) -> None:
        while True:
            try:
                self._tick()
            except Exception as exc:  # noqa: BLE001 - the watcher must outlive one bad tick
                log.warning("autofuse: the tune-on-miss watcher: %s: %s", type(exc).__name__, exc)
            self._wake.wait(self._poll_s)
            self._wake.clear()

    def _tick(self) -> None:
        with self._lock:
            tunes, waiting = list(self._tunes.values()), list(self._waiting)
        ended = {id(t) for t in tunes if t.proc is not None and t.ended is None and t.check()}
        running = sum(1 for t in tunes if t.proc is not None and t.ended is None)
        for tune in tunes:
            if tune.proc is None and tune.ended is None and running < tune.spec["concurrent"]:
                tune.start()
                if tune.ended is None:
                    running += 1
        changed = {path for path in {pathlib.Path(w.dispatcher().table.path) for w in waiting if w.dispatcher()}
                   if self._changed(path)}
        by_dispatcher: dict[int, tuple] = {}
        for item in waiting:
            dispatcher = item.dispatcher()
            if dispatcher is not None and (dispatcher.table.path in changed or id(item.tune) in ended):
                by_dispatcher.setdefault(id(dispatcher), (dispatcher, []))[1].append(item)
        for dispatcher, items in by_dispatcher.values():
            dispatcher.refresh(items)
        with self._lock:
            self._waiting = [w for w in self._waiting if _still_waiting(w)]

    def _changed(self, path: pathlib.Path) -> bool:
        try:
            stat = path.stat()
            signature = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        except OSError:
            signature = None
        first = path not in self._signatures
        changed, self._signatures[path] = self._signatures.get(path) != signature, signature
        return changed and not first


def tuned_here(info: dict) -> bool:
    """Whether a call key's ``dispatch_info`` is an entry tuned on this GPU at its key: not a
    fallback, the reference or another GPU's entry (``tuned_on``), any of which a tune here replaces."""
    return info.get("source") == "tuned" and not info.get("tuned_on")


def _still_waiting(item: Waiting) -> bool:
    dispatcher = item.dispatcher()
    if dispatcher is None or item.epoch != dispatcher.epoch:
        return False
    if tuned_here(dispatcher.info.get(item.key, {})):
        return False
    return item.tune.ended is None or time.monotonic() < item.tune.watch_until


def _spec(dispatcher, shape: dict, dkey, device) -> dict:
    """What the background process tunes; its ``name`` identifies the key across processes."""
    home = pathlib.Path(os.environ.get("AUTOFUSE_HOME") or "~/.cache/autofuse").expanduser()
    budget, problem = dispatcher.budget, dispatcher.problem
    key = {"problem": problem.command_name, "shape": dict(shape), "device": str(device), "dtype": dkey.dtype,
           "precision": dkey.precision, "mode": dkey.mode, "table": str(pathlib.Path(dispatcher.table.path).resolve())}
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return {**key, "name": name, "problem_name": problem.name, "dir": str(home / "tune-on-miss"),
            "trials": budget.trials, "timeout": budget.timeout_s, "concurrent": budget.concurrent}


_WATCHER = Watcher()


def request(dispatcher, key, shape: dict, dkey, device) -> Tune:
    return _WATCHER.request(dispatcher, key, shape, dkey, device)


# -- the background process ----------------------------------------------------------------
def _take_slot(directory: pathlib.Path, slots: int, wait_s: float) -> filelock.FileLock | None:
    """One of ``slots`` slot locks under ``directory``, waiting up to ``wait_s``; None if none freed."""
    deadline = time.monotonic() + wait_s
    while True:
        for index in range(slots):
            lock = filelock.FileLock(str(directory / f"slot-{index}.lock"))
            try:
                lock.acquire(timeout=0)
                return lock
            except filelock.Timeout:
                pass
        if time.monotonic() > deadline:
            return None
        time.sleep(1.0)


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    directory = pathlib.Path(spec["dir"])
    directory.mkdir(parents=True, exist_ok=True)
    key_lock = filelock.FileLock(str(directory / f"{spec['name']}.lock"))
    try:
        key_lock.acquire(timeout=0)
    except filelock.Timeout:
        print(f"autofuse: another process holds {key_lock.lock_file}: it is tuning this key", flush=True)
        return EXIT_BUSY
    try:
        slot = _take_slot(directory, spec["concurrent"], spec["timeout"])
        if slot is None:
            print(f"autofuse: no tune slot of {spec['concurrent']} freed within {spec['timeout']:g} s", flush=True)
            return EXIT_NO_SLOT
        with slot:
            return _tune(spec)
    finally:
        key_lock.release()


def _tune(spec: dict) -> int:
    from autofuse.tuning.tuner import tune  # only now: a process waiting for a slot has not imported torch

    print(f"autofuse: tuning on miss: {json.dumps(spec)}", flush=True)
    [result] = tune(spec["problem"], spec["shape"], device=spec["device"], dtype=spec["dtype"],
                    precision=spec["precision"], mode=spec["mode"], n_trials=spec["trials"],
                    timeout=spec["timeout"], trial_timeout=min(600.0, spec["timeout"]), table=spec["table"],
                    progress=False)
    for label, entry in (("winner", result.winner), ("autograd winner", result.grad_winner)):
        print(f"autofuse: {label}: " + (f"{entry['variant']} {entry['params']} {entry['median_ms']:.4g} ms" if entry else "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
