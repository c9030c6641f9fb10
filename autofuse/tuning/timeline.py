"""What a tune's seconds went to: with ``$AUTOFUSE_TIMELINE`` naming a file, the tuning process
appends a line for each phase of a key (its setup, search, choice and autograd entry, batch
classes), each call into the worker (what it ran, on which candidate and batch, and the outcome)
and each wait on the compile pool (``autofuse.tuning.prewarm``); the worker adds what each call
spent where (the build, the first calls that compile and the timing, each gate case's
preparation and check), and each pool process its compiles:

    <start s> <seconds> <pid> <what>

with every start counted from the first span of the first process (its children inherit that
origin through ``$AUTOFUSE_TIMELINE_ORIGIN``; the clock is the system's monotonic one, the
same in every process), and the pid telling the processes apart. A tune's wall time is the
worker's calls plus the pool waits plus what the tuning process does itself, so the lines show
where a slow tune stands waiting: kb2-99's on an H200 host showed the autograd entry's training
step compiling for 18 s in the worker, and its batch classes waiting 17 s on the pool before
their first race (``benchmarks/gpu/tuning_time.sh`` writes one per tune). Unset, nothing is
written and nothing is timed. ``python -m autofuse.tuning.timeline FILE`` reads one back, phase by
phase (``summarize``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

ORIGIN = "AUTOFUSE_TIMELINE_ORIGIN"  # the first span's start (time.monotonic()), for the processes started after it


def enabled() -> bool:
    return bool(os.environ.get("AUTOFUSE_TIMELINE"))


@contextlib.contextmanager
def span(what: str | Callable[[], str]):
    """Time the block and write its line (``what``, or what it returns: a description worth
    building only when the timeline is on); the block may add its outcome to the list it is given."""
    if not enabled():
        yield []
        return
    what = what() if callable(what) else what
    start, after = time.monotonic(), []
    os.environ.setdefault(ORIGIN, repr(start))
    try:
        yield after
    finally:
        _write(start, time.monotonic() - start, " ".join([what, *after]).rstrip())


def mark_origin() -> None:
    """Count the spans from now on, where no span has set the origin yet: before starting a child
    process that may write spans before this one does (the worker, spawned as the tune starts)."""
    if enabled():
        os.environ.setdefault(ORIGIN, repr(time.monotonic()))


def describe_call(op: str, payload: tuple) -> str:
    """A worker call in a few words: the op, the batch, the candidate (with gradients or not)."""
    job = payload[0] if payload else None
    words = [op]
    if getattr(job, "shape", None):
        words.append(at(job.shape))
    candidate = payload[1] if len(payload) > 1 else None
    if hasattr(candidate, "label"):
        words.append(candidate.label())
    elif isinstance(candidate, list):
        words.append(f"{len(candidate)} candidates")
    if op == "evaluate" and len(payload) > 3 and not payload[3]:
        words.append("(timed only)")
    return " ".join(words)


def at(shape: dict) -> str:
    return "at " + ",".join(f"{k}={v}" for k, v in shape.items())


def _write(start: float, seconds: float, what: str) -> None:
    try:
        with open(os.environ["AUTOFUSE_TIMELINE"], "a") as f:
            f.write(f"{start - float(os.environ[ORIGIN]):9.3f} {seconds:8.3f} {os.getpid()} {what}\n")
    except (OSError, KeyError, ValueError):
        pass  # a diagnostic: an unwritable path never fails the tune


# -- reading one: python -m autofuse.tuning.timeline FILE ----------------------------------------
PHASES = ("setup", "search", "choice and autograd entry", "batch classes")


def summarize(lines: list[str]) -> list[dict]:
    """Each phase of each key the tuning process wrote (the process of the first ``setup`` line),
    with where its seconds went: waiting on the compile pool, the worker starting, the worker's
    first calls (compiling, then timing) and its gate cases, and the rest (the tuner's own work:
    nvcc builds, the study, the table)."""
    spans = []
    for line in lines:
        start, seconds, pid, what = line.split(None, 3)
        spans.append((float(start), float(seconds), pid, what.rstrip("\n")))
    tuner = next((pid for _, _, pid, what in spans if what.startswith("setup ")), None)
    phases = []
    for start, seconds, pid, what in spans:
        phase = next((p for p in PHASES if what.startswith(p + " ")), None)
        if pid != tuner or phase is None:
            continue

        def inside(test, mine: bool) -> float:
            return sum(d for s, d, p, w in spans if (p == tuner) == mine and test(w)
                       and start <= s and s + d <= start + seconds + 0.02)
        pool = inside(lambda w: w.startswith("compile pool: wait"), True)
        started = inside(lambda w: w.startswith("worker start"), True)
        calls = inside(lambda w: w.startswith("worker ") and not w.startswith("worker start"), True)
        phases.append({"phase": phase, "key": what[len(phase) + 1:].split(" (")[0], "start": start, "seconds": seconds,
                       "pool waits": pool, "worker start": started,
                       "worker compiling+timing": inside(lambda w: w.lstrip().startswith("first calls"), False),
                       "worker gate": inside(lambda w: w.lstrip().startswith("gate:"), False),
                       "tuner's own": max(0.0, seconds - pool - started - calls)})
    return sorted(phases, key=lambda p: p["start"])


def main(argv: list[str]) -> None:
    from tabulate import tabulate

    if len(argv) != 1:
        raise SystemExit("usage: python -m autofuse.tuning.timeline FILE (a tune's $AUTOFUSE_TIMELINE)")
    with open(argv[0]) as f:
        phases = summarize(f.readlines())
    columns = ["seconds", "pool waits", "worker start", "worker compiling+timing", "worker gate", "tuner's own"]
    print(tabulate([[p["key"], p["phase"], *(p[c] for c in columns)] for p in phases],
                   headers=["key", "phase", *columns], floatfmt=".1f"))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
