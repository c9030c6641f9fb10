"""The tuned shape families of a dispatch table that hold no batch classes or leave batches unserved, and the tunes that mend them.

    python3 benchmarks/gpu/batch_class_gaps.py [--table benchmarks/table.json] [--gpu H100] [--run] [--budget quick]

A tune at batch B also gates and times entries for the family's other batch classes, 1 (2 for a
training BatchNorm) to 2B (``autofuse.tuning.batch_classes``): each batch then gets an entry that
passed the gate in its class. A family tuned before batch classes existed, or with
``--no-batch-classes``, holds B alone, and another batch gets B's entry by the nearest-batch
fallback, ungated there, or the reference (``autofuse.serve.dispatch``). This prints, per such
forward key, the ``autofuse tune --batch-classes-only`` command that adds its batch classes (and
its autograd entry's, where the table holds one) without searching the key again: the same shape,
dtype, precision and mode, among the variants its entry's tune raced. A family with batch classes
is listed too where a batch from 1 (2) to 2B would not be served by an entry of its tune at its
precision (``autofuse.serve.dispatch.serving``, as on the table's GPU): batches between two rungs
whose configurations passed the gate only where gated, before ``batch_classes.bridge``; the same
command adds the missing gates. ``--run`` runs them one after another into ``--table``, in this
process, on the GPU the table was tuned on, and says of each how long it took or why it failed
(exit status 1 if any did). A table tuned on several GPUs lists every one's keys; ``--gpu NAME``
keeps the sections whose device (``cuda|NVIDIA H100 80GB HBM3|sm_90|...``) contains NAME, the
ones a run on that GPU can mend.

``--missing-rungs`` lists instead the families whose ladder has grown since their tune (the
forward rungs at 32, and at 128 and 256 under bf16 and tf32: ``batch_classes.MEMORY_BOUND_RUNGS``) and the ``--rungs`` tune that races only
the missing ones: such a batch is served meanwhile by its nearest rung, correct but slower.

``--timed-before DATE`` lists instead the families whose training-step rungs were timed before
DATE (default HOST_PACED_UNTIL), and the ``--rungs`` tune that races those again, each against the
entry it holds: until then the timer held the stream 0.5 ms a call, less than a host takes to issue
a step whose backward runs Python, so a step timed at the host's pace and a fused one lost its rung
(99 under bf16 at 8 rows kept simplified, 0.488 ms, where cuBLAS + epilogue takes 0.182). Then it
lists the tuned keys' own training-step entries timed before DATE, which only a full tune of the
key times again.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys

from autofuse.core import registry
from autofuse.errors import AutofuseError
from autofuse.serve.dispatch import serving
from autofuse.serve.table import DispatchKey, parse_shape_key, shape_key
from autofuse.tuning.batch_classes import rung_batches, smallest_batch


# When the timer began holding the stream for as long as the host takes to enqueue the calls
# (b06b4f4, autofuse/tuning/timing.py): a step timed before may have been timed at the host's pace.
HOST_PACED_UNTIL = "2026-12-05T12:12:48+00:00"


def _tuned_forward(doc: dict):
    """(problem, its shapes, shape key, that shape's entries, dispatch key, DispatchKey, entry, the
    (tuned shape, dispatch key) pairs that hold rungs) of each tuned forward entry of the table,
    in sorted order: what both listings walk."""
    for device in doc["devices"].values():
        for problem, shapes in device["problems"].items():
            rungs = {(e["rung_of"], dkey) for keys in shapes.values() for dkey, e in keys.items() if "rung_of" in e}
            for shape, keys in sorted(shapes.items()):
                for dkey, entry in sorted(keys.items()):
                    key = DispatchKey.from_str(dkey)
                    if "rung_of" not in entry and not key.autograd:
                        yield problem, shapes, shape, keys, dkey, key, entry, rungs


def _raced(*entries) -> list[str]:
    """The variants ``entries`` (None skipped) raced: each one's own and its recorded candidates."""
    return sorted({name for e in entries if e for name in (e["variant"], *(e.get("candidates") or {}))})


def gaps(doc: dict) -> list[tuple[str, str, str, list[str], bool]]:
    """(problem, shape key, dispatch key, variants raced, whether an autograd entry is beside it)
    of each tuned forward entry without rungs, or whose autograd entry has none, then of each
    with rungs that leaves a batch unserved (``unserved``)."""
    found, holed = [], []
    for problem, shapes, shape, keys, dkey, key, entry, rungs in _tuned_forward(doc):
        grad_key = dataclasses.replace(key, autograd=True)
        grad = keys.get(grad_key.to_str())
        listed = (problem, shape, dkey, _raced(entry, grad), grad is not None)
        if (shape, dkey) not in rungs or (grad and (shape, grad_key.to_str()) not in rungs):
            found.append(listed)
        elif any(unserved(shapes, problem, shape, k) for k in (key, grad_key if grad else None) if k):
            holed.append(listed)
    return found + holed


def missing_rungs(doc: dict) -> list[tuple[str, str, str, list[str], list[int]]]:
    """(problem, shape key, dispatch key, variants raced, batches) of each tuned forward entry with
    batch classes whose ladder (``rung_batches``) has batches that hold no entry at its key."""
    found = []
    for problem, shapes, shape, _, dkey, key, entry, rungs in _tuned_forward(doc):
        if (shape, dkey) not in rungs:
            continue
        prob, tuned = registry.get_problem(problem), parse_shape_key(shape)
        missing = [b for b in rung_batches(prob, tuned, key.mode, key.precision)
                   if dkey not in shapes.get(shape_key({**tuned, prob.batch_dim: b}), {})]
        if missing:
            found.append((problem, shape, dkey, _raced(entry), missing))
    return found


def timed_before(doc: dict, date: str) -> list[tuple[str, str, str, list[str], list[int]]]:
    """(problem, shape key, dispatch key, variants raced, batches) of each tuned forward entry whose
    autograd entry's rungs at those batches were timed before ``date`` (ISO 8601, UTC; an entry
    without a date counts as before)."""
    found = []
    for problem, shapes, shape, keys, dkey, key, entry, _ in _tuned_forward(doc):
        grad_key = dataclasses.replace(key, autograd=True).to_str()
        if grad_key not in keys:
            continue
        batch_dim = registry.get_problem(problem).batch_dim
        stale = sorted(parse_shape_key(at)[batch_dim] for at, held in shapes.items()
                       if (rung := held.get(grad_key)) and rung.get("rung_of") == shape and rung.get("date", "") < date)
        if stale:
            found.append((problem, shape, dkey, _raced(entry, keys[grad_key]), stale))
    return found


def tuned_steps_timed_before(doc: dict, date: str) -> list[tuple[str, str, str, str, str | None]]:
    """(problem, shape key, autograd dispatch key, variant, date) of each tuned key's own autograd
    entry (not a rung) timed before ``date``: a ``--rungs`` tune leaves it as it is, a full tune of
    the key times it again."""
    found = []
    for problem, shapes, shape, keys, dkey, key, entry, _ in _tuned_forward(doc):
        grad_key = dataclasses.replace(key, autograd=True).to_str()
        held = keys.get(grad_key)
        if held and "rung_of" not in held and held.get("date", "") < date:
            found.append((problem, shape, grad_key, held["variant"], held.get("date")))
    return found


def unserved(shapes: dict, problem: str, shape: str, key: DispatchKey) -> list[int]:
    """The batches of ``checked_batches`` that no entry of this tune (at the tuned shape, or
    ``rung_of`` it) would serve at ``key``'s own precision."""
    prob, tuned = registry.get_problem(problem), parse_shape_key(shape)
    if prob.batch_dim is None:
        return []
    missing = []
    for batch in checked_batches(smallest_batch(prob, key.mode), tuned[prob.batch_dim]):
        served, _ = serving(shapes, prob, {**tuned, prob.batch_dim: batch}, key, "cuda", lacking_ok=True)
        if served is None or served.precision != key.precision or shape not in (served.shape,
                                                                                  served.entry.get("rung_of")):
            missing.append(batch)
    return missing


def checked_batches(smallest: int, tuned: int) -> list[int]:
    """Every batch from ``smallest`` to 64, then one every 3% up to twice ``tuned``, and ``tuned`` ± 1:
    a serving decision takes ~15 ms on a CPU (the triton kind's configuration check), too long for
    each of gemm_bn's 32768, and a hole between two rungs spans far more than 3%."""
    batches, batch = set(range(smallest, 65)), 64.0
    while batch < 2 * tuned:
        batches.add(round(batch))
        batch *= 1.03
    return sorted(b for b in batches | {tuned - 1, tuned + 1, 2 * tuned} if smallest <= b <= 2 * tuned)


def command(problem: str, shape: str, dkey: str, variants: list[str], grad: bool, table: str,
            budget: str | None = None, rungs: list[int] | None = None) -> list[str]:
    key = DispatchKey.from_str(dkey)
    mode = [] if key.mode == "any" else ["--mode", key.mode]
    return ["autofuse", "tune", problem, "--shape", shape, "--dtype", key.dtype, "--precision", key.precision, *mode,
            "--variants", ",".join(variants), "--batch-classes-only", *([] if grad else ["--no-autograd-entry"]),
            *(["--rungs", ",".join(map(str, rungs))] if rungs else []),
            "--table", table, "--no-progress", *(["--budget", budget] if budget else [])]


def run(problem: str, shape: str, dkey: str, variants: list[str], grad: bool, table: str,
        budget: str | None = None, rungs: list[int] | None = None) -> str:
    """``command``'s tune, in this process: one Python, torch and autofuse start-up for all keys,
    not one each, on a GPU whose time is short."""
    import autofuse

    key = DispatchKey.from_str(dkey)
    [result] = autofuse.tune(problem, parse_shape_key(shape), dtype=key.dtype, precision=key.precision,
                             mode=None if key.mode == "any" else key.mode, variants=variants, classes_only=True,
                             autograd_entry=grad, table=table, progress=False, rungs=rungs,
                             **({"budget": budget} if budget else {}))
    return f"batch classes added in {result.seconds:.0f} s"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", default="benchmarks/table.json")
    ap.add_argument("--run", action="store_true", help="run the tunes, one after another, in this process")
    ap.add_argument("--budget", choices=["quick", "full"], default=None, help="the tunes' budget (default: autofuse's)")
    ap.add_argument("--missing-rungs", action="store_true",
                    help="list the families whose ladder lacks rungs, and the tunes that race only those")
    ap.add_argument("--timed-before", nargs="?", const=HOST_PACED_UNTIL, default=None, metavar="DATE",
                    help="list the families whose training-step rungs were timed before DATE (default: when the "
                         "timer stopped timing steps at the host's pace), and the tunes that race those again")
    ap.add_argument("--gpu", metavar="NAME", help="only the table's sections whose device contains NAME, e.g. H100")
    args = ap.parse_args(argv)
    with open(args.table) as f:
        doc = json.load(f)
    if args.gpu:
        doc = {**doc, "devices": {name: section for name, section in doc["devices"].items() if args.gpu in name}}
        if not doc["devices"]:
            ap.error(f"no device of {args.table} contains {args.gpu!r}")
    if args.timed_before:
        found = [(problem, shape, dkey, variants, True, rungs)
                 for problem, shape, dkey, variants, rungs in timed_before(doc, args.timed_before)]
        print(f"{len(found)} tuned forward keys whose training-step rungs were timed before {args.timed_before} "
              f"in {args.table}")
    elif args.missing_rungs:
        found = [(problem, shape, dkey, variants, False, rungs) for problem, shape, dkey, variants, rungs in missing_rungs(doc)]
        print(f"{len(found)} tuned forward keys whose batch classes lack rungs in {args.table}")
    else:
        found = [(*listed, None) for listed in gaps(doc)]
        print(f"{len(found)} tuned forward keys without batch classes or with unserved batches in {args.table}")
    failed = 0
    for problem, shape, dkey, variants, grad, rungs in found:
        batch = parse_shape_key(shape)[registry.get_problem(problem).batch_dim]
        argv_ = command(problem, shape, dkey, variants, grad, args.table, args.budget, rungs)
        print(f"{problem} at batch {batch}, {dkey}:\n  {shlex.join(argv_)}", flush=True)
        if args.run:
            try:
                print(f"  -> {run(problem, shape, dkey, variants, grad, args.table, args.budget, rungs)}", flush=True)
            except AutofuseError as exc:  # a stale entry, a key this GPU lacks: the next key still runs
                failed += 1
                print(f"  -> failed: {exc}", flush=True)
    if args.timed_before:
        steps = tuned_steps_timed_before(doc, args.timed_before)
        print(f"{len(steps)} tuned keys' own training-step entries timed before {args.timed_before} (a full tune "
              "of the key times them again):")
        for problem, shape, grad_key, variant, date in steps:
            print(f"  {problem} {shape} {grad_key}: {variant}, {date or 'undated'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
