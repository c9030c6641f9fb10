"""Timing: CUDA events around each call, L2 flushed between repetitions; a monotonic clock on CPU.

Every measurement reports the median and the 20th/80th percentiles: machines are noisy,
and a difference smaller than the spread is noise. ``time_interleaved`` times several
candidates round-robin in one run, so drifting clocks or a neighbour's load hit them all alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import time
from collections.abc import Callable, Mapping

import torch

_flush_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # (what is read, its sum)
_cycles_per_ms: dict[int, float] = {}
# How long the stream is held per call about to be enqueued: HOST_MARGIN times the host's measured
# time to enqueue one call, at least PRIME_MS_PER_CALL (what a 50 ms hold gave each of 200 calls
# before the host was measured), so the device never waits on the host; a hold past PRIME_MAX_MS
# is split, a sleep every so many calls.
PRIME_MS_PER_CALL = 0.25
HOST_MARGIN = 1.5
PRIME_BASE_MS = 0.2
PRIME_MAX_MS = 50.0


@dataclasses.dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    reps: int

    @property
    def spread(self) -> float:
        """(p80 − p20) / median: the relative noise of this measurement."""
        return (self.p80_ms - self.p20_ms) / self.median_ms if self.median_ms > 0 else 0.0

    @classmethod
    def from_samples(cls, samples_ms: list[float]) -> "Timing":
        ordered = sorted(samples_ms)
        pick = lambda q: ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]  # noqa: E731
        return cls(statistics.median(ordered), pick(0.2), pick(0.8), len(ordered))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _flush_l2(device: torch.device) -> None:
    """Evict the L2 cache so the next call reads its inputs from memory: read a buffer of twice
    its size (a sum into a scalar).

    A read, not a write. Zeroing the buffer, as this flush once did, left the L2 full of dirty
    lines, whose write-back the next call paid as it evicted them: ~10 µs a call on an H100, a
    fifth of a small-batch GEMM. cuBLAS at 1×8192×8192 took 59.4 µs (bf16) and 123.6 (fp32)
    after a zeroing flush, 49.7 and 113.6 after this one, 49.9 and 113.0 with none (W, 134 and
    268 MB, outgrows the 50 MB L2, so it comes from memory all the same). That it evicts: at
    4096×4096 (W fits in the L2) the bf16 GEMM took 13.1 µs with no flush and 18.9 after this
    one (benchmarks/gpu/flush_cost.py)."""
    index = _device_index(device)
    buffers = _flush_buffers.get(index)
    if buffers is None:
        l2_bytes = getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 64 << 20) or (64 << 20)
        buffers = _flush_buffers[index] = (torch.zeros(2 * l2_bytes // 4, dtype=torch.float32, device=device),
                                           torch.empty((), dtype=torch.float32, device=device))
    buffer, total = buffers
    torch.sum(buffer, 0, out=total)


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _prime(device: torch.device, hold_ms: float) -> None:
    """Hold the stream with a sleep kernel for ``hold_ms`` while the host enqueues calls.

    Right after a synchronize the device is idle, and a call launched from Python in several
    steps (51's simplified variant: ~0.1 ms of device work) kept it waiting between launches:
    its p20-p80 read 0.114-0.262 ms in an interleaved run on an H100, single_pass 0.051-0.114.
    Primed, each interval between the events holds the device's work, not the host's latency.
    """
    index = _device_index(device)
    if index not in _cycles_per_ms:
        _cycles_per_ms[index] = _sleep_rate(_measure_sleep_ms)
    torch.cuda._sleep(int(_cycles_per_ms[index] * hold_ms))


def _holds(reps: int, host_ms: float) -> list[tuple[int, float]]:
    """(calls, hold in ms) for each run of ``reps`` calls enqueued behind one sleep: a hold covers
    its calls at the larger of PRIME_MS_PER_CALL and HOST_MARGIN × ``host_ms`` (the host's time to
    enqueue one call), and none passes PRIME_MAX_MS.

    A flat 0.5 ms a call, capped at 50 ms for all of a timing's up to 200 calls, did not cover a
    training step whose backward runs Python (a custom autograd Function's, torch.compile's): the
    device's host takes longer than the step's 0.43 ms of GPU work, so once the hold ran out the
    device waited on the host and the samples read the host's time. kb2-99's bfloat16-model step
    on an H100: cublas_epilogue 0.4286-0.8556 ms p20-p80 (medians of tuner timings up to 1.1 ms),
    torch.compile 0.4403-0.9676, eager (autograd in C++) 0.4699-0.4738.
    """
    per_call = max(PRIME_MS_PER_CALL, HOST_MARGIN * host_ms)
    chunk = max(1, int((PRIME_MAX_MS - PRIME_BASE_MS) // per_call))
    return [(n, min(PRIME_MAX_MS, PRIME_BASE_MS + per_call * n))
            for n in (min(chunk, reps - first) for first in range(0, reps, chunk))]


SLEEP_CALIBRATION_CYCLES = 1_000_000


def _measure_sleep_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(SLEEP_CALIBRATION_CYCLES)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _sleep_rate(measure_ms: Callable[[], float], readings: int = 5) -> float:
    """Cycles per millisecond of the sleep kernel: the fastest of ``readings`` timed sleeps.

    The first sleep of a process may run while the device is still at its idle clock: on an
    H100 one read 3.1 ms for 10⁶ cycles (323 MHz) where the clocked-up device takes 0.5 ms, and
    that process then held the stream for a sixth of what it meant to, so host stalls reached
    the timings again. The clock only rises while the sleeps run, so the fastest reading is
    the working clock; a hold computed from it can only err on the long side, which is harmless.
    """
    fastest_ms = min(measure_ms() for _ in range(readings))
    return SLEEP_CALIBRATION_CYCLES / max(fastest_ms, 1e-3)


def _time_reps(fn: Callable[[], object], device: torch.device, flush: bool, reps: int,
               host_ms: float = 0.0) -> tuple[list[float], float]:
    """Milliseconds of ``reps`` calls, and the host's milliseconds to enqueue one. On CUDA all are
    enqueued behind sleep kernels that hold the stream while the host enqueues (``_holds``, from
    ``host_ms``: the last measurement's host time) before one synchronize, so the device runs them
    back to back and the events time the device's work, as in a caller's loop that keeps the GPU busy."""
    if device.type != "cuda":
        samples = []
        for _ in range(reps):
            start = time.perf_counter_ns()
            fn()
            samples.append((time.perf_counter_ns() - start) / 1e6)
        return samples, statistics.median(samples)
    events = []
    enqueue_start = time.perf_counter()
    for calls, hold_ms in _holds(reps, host_ms):
        _prime(device, hold_ms)
        for _ in range(calls):
            if flush:
                _flush_l2(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
    host = (time.perf_counter() - enqueue_start) * 1e3 / reps
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events], host


@contextlib.contextmanager
def _no_gc():
    """No garbage collection while timing, as timeit does: a collection stalls the host, and a
    kernel of tens of µs then waits on its launch. (H200, 51's single_pass at (2048, 8192): the
    tuning worker measured 0.073 ms before this and 0.041 after, one run each.) It was not
    enough: host stalls still reached the device timeline until ``_prime`` kept the queue ahead
    (with a hold calibrated at the working clock, see ``_sleep_rate``)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _warm_up(fn: Callable[[], object], calls: int) -> float:
    """Call ``fn`` ``calls`` times; the host's milliseconds for the last (its launches are
    asynchronous: the host's part of a call), 0 for none."""
    host_ms = 0.0
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        host_ms = (time.perf_counter() - start) * 1e3
    return host_ms


def _rep_count(estimate_ms: float, budget_ms: float, min_reps: int, max_reps: int) -> int:
    return int(max(min_reps, min(max_reps, budget_ms / max(estimate_ms, 1e-3))))


def time_callable(fn: Callable[[], object], device, *, warmup: int = 3, budget_ms: float = 400.0,
                  min_reps: int = 5, max_reps: int = 200, flush: bool = True) -> Timing:
    """Median/p20/p80 of ``fn()`` over enough repetitions to fill ``budget_ms``, after ``warmup`` calls."""
    device = torch.device(device)
    host_ms = _warm_up(fn, warmup)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with _no_gc():
        estimate, host_ms = _time_reps(fn, device, flush, 3, host_ms)
        reps = _rep_count(statistics.median(estimate), budget_ms, min_reps, max_reps)
        return Timing.from_samples(_time_reps(fn, device, flush, reps, host_ms)[0])


def time_interleaved(fns: Mapping[str, Callable[[], object]], device, *, rounds: int = 30, warmup: int = 2,
                     per_round: int = 3, flush: bool = True) -> dict[str, Timing]:
    """Time the callables round-robin, ``per_round`` calls each per round after one untimed call.

    The untimed call lets each candidate reach its steady state after the previous one (a
    heavy GEMM before a small memory-bound kernel left it ~40% slow on an H200), so what is
    compared is what repeated calls cost, while the rounds spread drift over all candidates.
    """
    device = torch.device(device)
    host_ms = {name: _warm_up(fn, warmup) for name, fn in fns.items()}  # then measured as each round enqueues
    samples: dict[str, list[float]] = {name: [] for name in fns}
    with _no_gc():
        for _ in range(rounds):
            for name, fn in fns.items():
                fn()
                timed, host_ms[name] = _time_reps(fn, device, flush, per_round, host_ms[name])
                samples[name].extend(timed)
    return {name: Timing.from_samples(values) for name, values in samples.items()}
