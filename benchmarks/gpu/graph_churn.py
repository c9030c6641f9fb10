"""A caller whose batch changes every call: what the graphs' memory budget does to its time and memory.

    python3 benchmarks/gpu/graph_churn.py matmul_clamp_lse_mish --precision bf16 --calls 4000 \
        [--max-batch 256] [--budgets off,256,2048] [--table benchmarks/table.json] [--seed 0]

One module from ``get_module`` per budget (``AUTOFUSE_CUDA_GRAPH_MEMORY`` MiB; "off":
``AUTOFUSE_CUDA_GRAPHS=0``), fed the same ``--calls`` batches drawn uniformly from 1 to
``--max-batch`` (every batch size a distinct key: one graph each), each call synchronized and
timed on the host. Per budget it prints the median and p90 wall µs of the calls after the first
tenth (and the median of those replayed and of those run plain), the graphs held and dropped
(``GraphedCall._drops``), the most the ledger held, and ``torch.cuda.memory_reserved`` before
and after (a dropped graph's pool stays reserved by PyTorch's caching allocator until
``torch.cuda.empty_cache()`` or an allocation that would fail).
Every 50th call is checked against the plain call bit for bit. Between budgets the module is
collected and the allocator's cache emptied, so each budget's ledger starts empty; run each in a
fresh process (``--budgets`` one at a time) to read its reserved memory alone.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time

import torch

from autofuse.bench.setup import FORWARD, dispatch_module, make_setup
from autofuse.core import registry
from autofuse.serve import graph_memory, graphs

sys.path.insert(0, os.path.dirname(__file__))
from exact_batch import shape_at  # noqa: E402


def run(prob, args, budget: str, batches: list[int]) -> str:
    os.environ["AUTOFUSE_CUDA_GRAPHS"] = "0" if budget == "off" else "1"
    if budget != "off":
        os.environ["AUTOFUSE_CUDA_GRAPH_MEMORY"] = budget
    mode = "eval" if prob.mode_sensitive else "any"
    setup = make_setup(prob, shape_at(prob, max(batches), None), "cuda", args.dtype, args.precision, mode, FORWARD)
    module = dispatch_module(setup, args.table)
    xs = {b: torch.rand(b, setup.x.shape[1], device="cuda", dtype=setup.x.dtype) for b in sorted(set(batches))}
    device = setup.x.device
    reserved_before, held_most, walls, wrong = torch.cuda.memory_reserved(), 0, [], 0
    by_kind = {"replayed": [], "plain": []}
    with torch.no_grad():
        for i, b in enumerate(batches):
            key = module._autofuse.call_key(module, xs[b])
            before = module._autofuse.ready.get(key)
            replayed = getattr(before, "graph", None) is not None
            start = time.perf_counter_ns()
            out = module(xs[b])
            torch.cuda.synchronize()
            walls.append((time.perf_counter_ns() - start) / 1e3)
            if i >= len(batches) // 10:
                by_kind["replayed" if replayed else "plain"].append(walls[-1])
            held_most = max(held_most, graph_memory.LEDGER.held(device))
            if i % 50 == 0:
                call = module._autofuse.ready[key]
                plain = getattr(call, "call", call)
                wrong += not torch.equal(out, plain(module, xs[b]))
    calls = [c for c in module._autofuse.ready.values() if isinstance(c, graphs.GraphedCall)]
    steady = sorted(walls[len(walls) // 10:])
    return (f"budget {budget:>5} MiB: wall median {statistics.median(steady):7.1f} µs, p90 "
            f"{steady[int(0.9 * (len(steady) - 1))]:7.1f}; graphs held {sum(c.graph is not None for c in calls)} of "
            f"{len(calls)} keys, drops {sum(c._drops for c in calls)}, failed {sum(c.failed is not None for c in calls)}; "
            f"ledger at most {held_most / 2**20:.0f} MiB; reserved {reserved_before / 2**20:.0f} → "
            f"{torch.cuda.memory_reserved() / 2**20:.0f} MiB; wrong outputs {wrong}; "
            + "; ".join(f"{kind} calls {len(ts)}, median {statistics.median(ts):.1f} µs" for kind, ts in by_kind.items() if ts))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("problem")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--calls", type=int, default=4000)
    ap.add_argument("--max-batch", type=int, default=graphs.MAX_BATCH)
    ap.add_argument("--budgets", default="off,256,2048", type=lambda s: s.split(","))
    ap.add_argument("--table", default="benchmarks/table.json")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    prob = registry.get_problem(args.problem)
    rng = random.Random(args.seed)
    batches = [rng.randint(1, args.max_batch) for _ in range(args.calls)]
    print(f"{torch.cuda.get_device_name()}: {prob.name} under {args.precision}, {args.calls} calls at batches "
          f"1-{args.max_batch}", flush=True)
    for budget in args.budgets:
        print(run(prob, args, budget, batches), flush=True)
        gc.collect()  # the module and its graphs (a cycle): the next budget's ledger starts empty
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
