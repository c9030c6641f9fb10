"""What a tune's seconds went to: with ``$AUTOFUSE_TIMELINE`` naming a file, the tuning process
appends a line for each phase of a key (its setup, search, choice and autograd entry, batch
classes), each call into the worker (what it ran, on which candidate and batch, and the outcome)
and each wait on the compile pool (``autofuse.tuning.prewarm``):

    <start s> <seconds> <pid> <what>

with the start counted from the process's first span (``--workers`` processes append their
searches' lines to the same file, each from its own start: the pid tells them apart). A tune's
wall time is the worker's calls (measuring, gating, and compiling where the pool did not) plus
the pool waits plus what the tuning process does itself, so the lines show where a slow tune
stands waiting: kb2-99's on an H200 host showed the autograd entry's training step compiling for
18 s in the worker, and its batch classes waiting 17 s on the pool before their first race
(``benchmarks/gpu/tuning_time.sh`` writes one per tune). Unset, nothing is written and nothing
is timed.
"""

from __future__ import annotations

import contextlib
import os
import time

_started: list[float] = []  # when this process opened its first span


def enabled() -> bool:
    return bool(os.environ.get("AUTOFUSE_TIMELINE"))


@contextlib.contextmanager
def span(what: str):
    """Time the block and write its line; the block may add its outcome to the list it is given."""
    if not enabled():
        yield []
        return
    start, after = time.monotonic(), []
    if not _started:
        _started.append(start)
    try:
        yield after
    finally:
        _write(start, time.monotonic() - start, " ".join([what, *after]).rstrip())


def describe_call(op: str, payload: tuple) -> str:
    """A worker call in a few words: the op, the batch, the candidate (with gradients or not)."""
    job = payload[0] if payload else None
    words = [op]
    if getattr(job, "shape", None):
        words.append("at " + ",".join(f"{k}={v}" for k, v in job.shape.items()))
    candidate = payload[1] if len(payload) > 1 else None
    if hasattr(candidate, "label"):
        words.append(candidate.label())
    elif isinstance(candidate, list):
        words.append(f"{len(candidate)} candidates")
    if op == "evaluate" and len(payload) > 3 and not payload[3]:
        words.append("(timed only)")
    return " ".join(words)


def _write(start: float, seconds: float, what: str) -> None:
    try:
        with open(os.environ["AUTOFUSE_TIMELINE"], "a") as f:
            f.write(f"{start - _started[0]:8.2f} {seconds:7.2f} {os.getpid()} {what}\n")
    except (OSError, KeyError):
        pass  # a diagnostic: an unwritable path never fails the tune
