"""Is the row finish inside the GEMM's launch worth its place? The small-tile seeds with and without it.

    python3 benchmarks/gpu/finish_inside.py [--problems matmul_clamp_lse_mish,matmul_gelu_softmax]
        [--batches 1,8,32] [--models fp32,bf16,bf16-bfloat16] [--features 8192] [--rounds 30]

For 22 and 99 (the triton variants that can finish inside) at batch × features², under fp32 and
bf16 (float32 models) and bf16 for a bfloat16 model: each of the first two small tiles the batch
classes seed (``TritonVariant.small_batch_seeds``), with the row finish in a launch of its own and inside
the GEMM's (``finish_inside``: the last program to arrive merges the rows), each replayed as a CUDA
graph as the runtime serves a small batch (``timed_call.replayed_call``), timed interleaved with the
L2 flushed (``timing.time_interleaved``) beside cuBLAS's GEMM alone on the precision's operands and
a copy of 256 MB (the weight's read at the copy bandwidth: 2 bytes an element under bf16, 4 else).
Prints the device, then one JSON line per (problem, precision, model, batch): each call's median ms with
p20 and p80, and its median over the weight read. The question it answers: whether the one-launch
call meets the small-batch target (GPU time at most 1.25x the weight read) where the two-launch one
misses, and up to which batch the seeds should put it first (``FINISH_INSIDE_BATCH``).
"""

import argparse
import json

import torch

from autofuse.core import registry
from autofuse.core.precision import math_mode
from autofuse.tuning import timing
from autofuse.tuning.gate import CheckCase, build_case
from autofuse.tuning.timed_call import replayed_call

MODELS = {"fp32": ("fp32", torch.float32), "bf16": ("bf16", torch.float32), "bf16-bfloat16": ("bf16", torch.bfloat16)}
COPY_BYTES = 256 * 2 ** 20


def calls(problem: str, precision: str, dtype: torch.dtype, batch: int, features: int) -> tuple[dict, int]:
    """({label: call}, W's bytes at the precision) at one key: the seeds, the floor, the copy."""
    prob = registry.get_problem(problem)
    cls = registry.get_variant(problem, "triton")
    shape = dict(zip(prob.dims, (batch, features, features)))
    model, x = build_case(prob, CheckCase(shape, "randn", 0, False), "cuda", dtype, "train")
    seeds = cls.small_batch_seeds(shape, "cuda", precision, {})
    tiles = list(dict.fromkeys((c["block_m"], c["block_n"]) for c in seeds))[:2]
    fns = {}
    for params in (c for c in seeds if (c["block_m"], c["block_n"]) in tiles):
        label = (f"{params['block_m']}x{params['block_n']}x{params['block_k']} stages={params['stages']} "
                 + ("inside" if params.get("finish_inside") else "apart"))
        fns[label] = replayed_call(cls(precision, **params), model, x)
    weight = getattr(model, prob.linear_attr).weight.detach()
    xs, ws = (x.bfloat16(), weight.bfloat16()) if precision == "bf16" else (x, weight)

    def floor():
        with math_mode(precision):
            return torch.mm(xs, ws.t())
    fns["cuBLAS GEMM alone"] = floor
    buffer = torch.empty(COPY_BYTES // 8, device="cuda")  # a copy reads half and writes half
    fns["copy"] = buffer.clone
    return fns, weight.numel() * (2 if precision == "bf16" else 4)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", default="matmul_clamp_lse_mish,matmul_gelu_softmax")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--models", default=",".join(MODELS), help="precision, -bfloat16 for a bfloat16 model")
    ap.add_argument("--features", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    keys = [(p, MODELS[m], int(b)) for p in args.problems.split(",") for m in args.models.split(",")
            for b in args.batches.split(",")]
    for problem, (precision, dtype), batch in keys:
        fns, weight_bytes = calls(problem, precision, dtype, batch, args.features)
        times = timing.time_interleaved(fns, "cuda", rounds=args.rounds)
        read_ms = times.pop("copy").median_ms * weight_bytes / COPY_BYTES  # bytes moved: read + write
        print(json.dumps({"problem": problem, "precision": precision, "model": str(dtype), "batch": batch,
                          "weight read ms": round(read_ms, 4),
                          "ms": {k: [round(t.median_ms, 4), round(t.p20_ms, 4), round(t.p80_ms, 4)]
                                 for k, t in times.items()},
                          "over the read": {k: round(t.median_ms / read_ms, 3) for k, t in times.items()}}),
              flush=True)


if __name__ == "__main__":
    main()
