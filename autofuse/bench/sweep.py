"""``autofuse bench PROBLEM --batches 1,8,37,...``: one shape family measured at many batch sizes.

A tuned shape family must serve every batch from 1 to twice the tuned one with a gated fused
kernel (issue 34), and small batches pay the host as much as the GPU. So per batch the sweep
times, interleaved in one run as every bench row is (CUDA events, L2 flushed): the dispatch,
saying which entry served it (its ``dispatch_info`` source: tuned, nearest batch, reference),
eager, torch.compile default (compiled for that batch: ``dynamic=False``), and the floor
(``autofuse.bench.floors``). With ``wall=True`` it also times what a caller waits for: host
plus GPU per call with a ``torch.cuda.synchronize()`` after each (``time_wall``) for the
dispatch, eager, torch.compile default and reduce-overhead (CUDA graphs) and the floor's GEMM
called from Python; and the weight-read floor, W's bytes at the copy bandwidth measured there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch

from autofuse.bench.floors import COPY, copy_row, floor_row, weight_read_row
from autofuse.bench.report import DISPATCH, BenchRow, now_utc
from autofuse.bench.run import check_rounds, compiled_row, dispatch_row
from autofuse.bench.setup import Setup, check_step, make_setup, resolve_dtype
from autofuse.bench.sweep_report import REDUCE_OVERHEAD, WALL_PREFIX, SweepPoint, SweepReport
from autofuse.bench.targets import FLOOR, FORWARD
from autofuse.core import registry
from autofuse.core.variant import EagerVariant
from autofuse.errors import InputError
from autofuse.serve.table import DispatchTable, current_fingerprint
from autofuse.tuning import placement
from autofuse.tuning.batch_classes import smallest_batch
from autofuse.tuning.timing import Timing, time_interleaved

DEFAULT_BATCHES = (1, 8, 37, 100, 512, 1023, 1025, 2048)
# Wall calls per round per row: a batch-1 call takes tens of µs, so rounds × this gives a few
# hundred samples for each row's median and p20-p80 at little cost.
WALL_PER_ROUND = 10


def bench_sweep(problem: str, shape=None, batches=DEFAULT_BATCHES, *, device: str | None = None,
                precision: str | None = None, dtype: str = "float32", mode: str | None = None, table=None,
                rounds: int = 20, use_compile: bool = True, step: str = FORWARD, wall: bool = False) -> list[SweepReport]:
    """One sweep per shape family (``shape``, else the problem's default shapes), at each of
    ``batches`` in place of the family's batch. ``use_compile=False`` leaves the compiled rows out."""
    prob = registry.get_problem(problem)
    asked, device = device, placement.resolve_device(device)
    dtype, precision = resolve_dtype(dtype, precision)
    check_step(step)
    check_rounds(rounds)
    batches = check_batches(prob, batches)
    mode = (mode or "train") if prob.mode_sensitive else "any"
    table = table if isinstance(table, DispatchTable) else DispatchTable(table)
    families = placement.shapes_to_run(prob, shape, device, asked)
    settings = {"device": device, "dtype": dtype, "precision": precision, "mode": mode, "step": step}
    return [SweepReport(prob.name, family, prob.batch_dim, dtype, precision, mode, step, current_fingerprint(device),
                        [_point(prob, family, batch, settings, table, rounds, use_compile, wall) for batch in batches],
                        now_utc())
            for family in families]


def check_batches(prob, batches) -> list[int]:
    """``batches`` as a list of positive ints, for a problem that has a batch dim."""
    if prob.batch_dim is None:
        raise InputError(f"problem {prob.name!r} has no batch dimension to sweep")
    batches = list(batches)
    bad = [b for b in batches if isinstance(b, bool) or not isinstance(b, int) or b < 1]
    if not batches or bad:
        raise InputError(f"batches (--batches) must be ints >= 1, e.g. 1,8,37,100; got {batches!r}")
    return batches


def _point(prob, family: dict, batch: int, settings: dict, table, rounds: int, use_compile: bool, wall: bool) -> SweepPoint:
    smallest = smallest_batch(prob, settings["mode"])
    if batch < smallest:
        return SweepPoint(batch, [], note=f"not measured: training mode needs batch >= {smallest}")
    setup = make_setup(prob, {**family, prob.batch_dim: batch}, **settings)
    if use_compile:
        torch._dynamo.reset()  # a compile per batch: past dynamo's recompile limit it would run eager
    timed = [(BenchRow("eager", "baseline", {}), setup.timed(EagerVariant(setup.precision)))]
    if use_compile:
        timed.append(compiled_row(setup, "default", dynamic=False))
    timed += [dispatch_row(setup, table), floor_row(setup)]
    weight_read = wall and prob.floor == "gemm" and setup.step == FORWARD
    if weight_read:
        timed.append(copy_row(setup))
    calls = {row.candidate: call for row, call in timed if call is not None}
    timings = time_interleaved(calls, setup.device, rounds=rounds)
    rows = [row for row, _ in timed]
    for row in rows:
        row.timing = timings.get(row.candidate)
    if weight_read:
        rows.append(weight_read_row(setup, next(row for row in rows if row.candidate == COPY)))
    if wall:
        rows += _wall_rows(setup, calls, rounds, use_compile)
    return SweepPoint(batch, [row for row in rows if row is not None])


def _wall_rows(setup: Setup, calls: dict, rounds: int, use_compile: bool) -> list[BenchRow]:
    """Wall time per call of the dispatch, eager, the compiled model (default and, for a forward,
    reduce-overhead: CUDA graphs replaying a training step's are out of scope) and the floor,
    each measured with a synchronize after every call."""
    names = [DISPATCH, "eager"] + (["torch.compile"] if use_compile else []) + [FLOOR]
    walled = {name: calls[name] for name in names if name in calls}
    rows = []
    if use_compile and setup.step == FORWARD:
        row, call = compiled_row(setup, "reduce-overhead", name=REDUCE_OVERHEAD, dynamic=False)
        if call is None:
            rows.append(BenchRow(WALL_PREFIX + row.candidate, "wall", row.params, note=row.note))
        else:
            walled[row.candidate] = call
    timings = time_wall(walled, setup.device, rounds=rounds)
    note = "host + GPU per call, synchronized after each"
    return [BenchRow(WALL_PREFIX + name, "wall", {}, timings[name], note) for name in walled] + rows


def time_wall(fns: Mapping[str, Callable[[], object]], device, *, rounds: int = 20, warmup: int = 2,
              per_round: int = WALL_PER_ROUND) -> dict[str, Timing]:
    """Wall time per call, host and device: a monotonic clock around each call and the
    ``torch.cuda.synchronize()`` after it, as a caller that waits for each result sees it.
    Round-robin as ``time_interleaved`` is, so drift hits every row alike; no L2 flush (a caller's
    repeated calls find what fits in L2 there too)."""
    device = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(per_round):
                start = time.perf_counter_ns()
                fn()
                sync()
                samples[name].append((time.perf_counter_ns() - start) / 1e6)
    return {name: Timing.from_samples(values) for name, values in samples.items()}
