"""What the L2 flush between timed calls adds to them: the timer's flush against the alternatives.

    python3 benchmarks/gpu/flush_cost.py [--sizes 8192,4096] [--calls 40]

A timer flushes the L2 before each call so the call reads its inputs from memory. How it flushes
matters at small batches: zeroing a buffer twice the L2's size (as ``autofuse.tuning.timing``
once did) leaves the L2 full of dirty lines, and the timed call pays their write-back as it
evicts them. Per flush (``zero``: that write; ``read``: the timer's ``_flush_l2``, a read of the
buffer; ``none``), with the calls enqueued behind a sleep kernel as the timer does: a copy of
256 MB and of 1 GiB (the bandwidth the weight-read floor uses), and cuBLAS's GEMM at batches 1
and 32 on an N×N weight, bf16 and fp32, median and p20-p80 µs. Where W outgrows the L2 the read
flush should match ``none``; where W fits, ``none`` reads it from the L2 and a flush must not.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from autofuse.tuning import timing


def times_us(fn, flush, calls: int) -> tuple[float, float, float]:
    """(median, p20, p80) µs of ``calls`` calls of ``fn``, each after ``flush``, back to back."""
    torch.cuda._sleep(50_000_000)  # the host enqueues everything before the device starts
    events = []
    for _ in range(calls):
        flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    samples = sorted(1e3 * start.elapsed_time(end) for start, end in events)
    return statistics.median(samples), samples[len(samples) // 5], samples[4 * len(samples) // 5]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8192,4096", help="N = K of the GEMMs' weights")
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    scratch = torch.zeros(2 * l2_bytes // 4, device=device)
    flushes = {"zero": scratch.zero_, "read": lambda: timing._flush_l2(device), "none": lambda: None}
    print(f"{torch.cuda.get_device_name(device)}, L2 {l2_bytes >> 20} MB; µs, median [p20-p80]")
    fmt = lambda t: f"{t[0]:8.1f} [{t[1]:.1f}-{t[2]:.1f}]"  # noqa: E731
    for name, flush in flushes.items():
        print(f"flush: {name}")
        for megabytes in (256, 1024):
            src = torch.empty(megabytes << 19, dtype=torch.uint8, device=device)
            t = times_us(src.clone, flush, args.calls)
            print(f"  copy {megabytes} MB (read + write) {fmt(t)}  {(megabytes << 20) / t[0] / 1e6:.3f} TB/s")
        for n in map(int, args.sizes.split(",")):
            w = torch.randn(n, n, device=device)
            wb = w.bfloat16()
            for batch in (1, 32):
                x = torch.randn(batch, n, device=device)
                xb = x.bfloat16()
                bf16 = times_us(lambda: xb @ wb.t(), flush, args.calls)
                fp32 = times_us(lambda: x @ w.t(), flush, args.calls)
                print(f"  {batch}×{n}×{n}: cuBLAS bf16 {fmt(bf16)}  fp32 {fmt(fp32)}")
        print(f"  the flush itself {fmt(times_us(flush, flushes['none'], args.calls))}")


if __name__ == "__main__":
    main()
