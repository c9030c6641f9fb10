"""Where a replayed small-batch call's GPU time goes: each kernel of the graph, per call.

    python3 benchmarks/gpu/profile_replay.py matmul_gelu_softmax --precision bf16 [--dtype bfloat16]
        [--mode eval] [--batch 32] [--features 8192] [--table benchmarks/table.json]

Builds the module through ``autofuse.get_module`` at batch×features² on the table's entry, calls it
until its key is replayed as a CUDA graph (``autofuse.serve.graphs``), then prints the variant,
whether the graph is re-pointed (``autofuse.serve.repoint``: reading x where it is, or with x
copied in), each kernel's average device time per call under torch.profiler with the L2 flushed
before each call as the timer flushes it (the flush's own kernels left out), their sum, and the
interval CUDA events give around the call (``timing.time_interleaved``). The gap between the sum
and the interval is time between kernels; a "Memcpy DtoD" row is a copy the graph could not
re-point. For the question "GPU time over the weight read: which kernels, which gaps?"
(benchmarks/analysis.md, "Small batches").
"""

import argparse
import sys

import torch

import autofuse
from autofuse.core import registry
from autofuse.tuning import timing

CALLS = 30


def kernels(fn, device, skip: set[str]) -> list[tuple[str, float]]:
    """(kernel, µs per call) of ``fn`` with the L2 flushed before each call, ``skip`` left out."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            timing._flush_l2(device)
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / CALLS) for e in prof.key_averages()]
    return sorted([(k, us) for k, us in rows if us > 0 and k not in skip], key=lambda r: -r[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("problem")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--mode", default="eval", choices=["eval", "train"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--features", type=int, default=8192)
    ap.add_argument("--table", default="benchmarks/table.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    device, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    prob = registry.get_problem(args.problem)
    init, init_kwargs = prob.init_args(dict(zip(prob.dims, (args.batch, args.features, args.features))))
    module = autofuse.get_module(args.problem, *init, **init_kwargs, precision=args.precision, table=args.table)
    module = module.to(device, dtype).train(args.mode == "train")
    x = torch.randn(args.batch, args.features, device=device, dtype=dtype)
    with torch.no_grad():
        for _ in range(4):
            module(x)
        call = module._autofuse.ready[module._autofuse.call_key(module, x)]
        flush = {k for k, _ in kernels(lambda: None, device, set())}
        rows = kernels(lambda: module(x), device, flush)
        interval = timing.time_interleaved({"call": lambda: module(x)}, device, rounds=10)["call"]
    repointer = getattr(call, "_repoint", None)
    how = ("not replayed" if getattr(call, "graph", None) is None else
           "copies x in and clones the output" if repointer is None else
           "re-pointed, reads x where it is" if call._reads_x else "re-pointed output, x copied in")
    print(f"{args.problem} {args.precision} {args.dtype} {args.mode} batch {args.batch}, "
          f"{args.features}²: {getattr(call, 'name', call)} ({how})")
    for name, us in rows:
        print(f"  {us:7.1f} µs  {name[:110]}")
    print(f"  sum {sum(us for _, us in rows):.1f} µs; events around the call: median {interval.median_ms * 1e3:.1f} µs "
          f"(p20-p80 {interval.p20_ms * 1e3:.1f}-{interval.p80_ms * 1e3:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
