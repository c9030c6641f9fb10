"""The kernels ncu should compare: a ``triton`` variant's GEMM beside cuBLAS's GEMM alone.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \
        python3 benchmarks/gpu/ncu_gemm.py matmul_clamp_lse_mish --precision bf16 [--mode train]
        [--params block_m=128,block_n=256,...] [--batch 37,48]

At the problem's default shape (KernelBench's inputs; ``--batch``: at other batches, one after
another), the variant is built and called until Triton has compiled everything, then one call of the
variant and one of cuBLAS at the precision (bf16 on operands already cast) run between
``cudaProfilerStart`` and ``cudaProfilerStop``, so ncu sees those kernels only: the variant's
operand pass (x rounded or cast), its GEMM with the epilogue inside, its finishing pass, and
cuBLAS's GEMM. Without ``--params`` the variant runs the triton configuration the shipped table
(benchmarks/table.json) recorded for the key (the best of its tune, whichever kind won), else its
default.
Run it with ``--page details --csv`` to a file; ``ncu_gemm.py --summarize FILE...`` then prints one
line per kernel: duration, SM and DRAM throughput, registers, shared memory, threads, cluster,
occupancy, issue-slot use.
"""

import argparse
import collections
import csv
import json
import pathlib
import sys

import torch

from autofuse.core import registry
from autofuse.core.precision import math_mode
from autofuse.tuning.gate import CheckCase, build_case

TABLE = pathlib.Path(__file__).parents[2] / "benchmarks" / "table.json"


def tabled_params(problem: str, shape: dict, precision: str, mode: str) -> dict | None:
    """The table's triton candidate params for this forward key on this GPU (None if it has none).
    A problem without modes keys its entries "mode=any", whatever ``mode`` says."""
    table = json.loads(TABLE.read_text())
    name = torch.cuda.get_device_name()
    for device_key, device in table["devices"].items():
        if name not in device_key:
            continue
        shapes = device["problems"].get(problem, {})
        entry_shape = ",".join(f"{k}={v}" for k, v in shape.items())
        for key, entry in shapes.get(entry_shape, {}).items():
            moded = f"mode={mode}" in key or "mode=any" in key
            if f"precision={precision}," in key and key.endswith("autograd=false") and moded:
                candidate = entry.get("candidates", {}).get("triton", {})
                if candidate.get("outcome") == "ok":
                    return candidate["params"]
    return None


SUMMARY = {"Duration": "ns", "Compute (SM) Throughput": "SM%", "DRAM Throughput": "DRAM%",
           "Registers Per Thread": "regs", "Dynamic Shared Memory Per Block": "smem", "Block Size": "threads",
           "Cluster Size": "cluster", "Achieved Occupancy": "occupancy%", "Issue Slots Busy": "issue%",
           "Grid Size": "grid", "L2 Hit Rate": "L2hit%", "Warp Cycles Per Issued Instruction": "cycles/issue"}


def summarize(paths: list[str]) -> None:
    """One line per profiled kernel of ncu's ``--page details --csv`` output."""
    for path in paths:
        lines = pathlib.Path(path).read_text().splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
        print(f"== {path}: {next((line for line in lines[:start] if ': triton ' in line), '')[:150]}")
        rows = list(csv.reader(lines[start:]))
        head = rows[0]
        kernel, name, value = head.index("Kernel Name"), head.index("Metric Name"), head.index("Metric Value")
        metrics = collections.OrderedDict()
        for row in rows[1:]:
            if len(row) > value and row[name] in SUMMARY:
                metrics.setdefault((row[0], row[kernel][:40]), {})[SUMMARY[row[name]]] = row[value]
        for (_, kernel_name), m in metrics.items():
            print(f"  {kernel_name:40} " + " ".join(f"{k}={v}" for k, v in m.items()))


def main() -> None:
    if sys.argv[1:2] == ["--summarize"]:
        return summarize(sys.argv[2:])
    ap = argparse.ArgumentParser()
    ap.add_argument("problem")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--mode", default="train")
    ap.add_argument("--shape", type=int, default=0, help="index into the problem's default shapes")
    ap.add_argument("--params", default="", help="k=v,... (ints and True/False)")
    ap.add_argument("--batch", default="", help="batches to profile one after another, e.g. 37,48 (default: the "
                    "shape's); the table's params stay the shape's")
    args = ap.parse_args()
    prob = registry.get_problem(args.problem)
    tabled_shape = dict(prob.default_shapes[args.shape])
    cls = registry.get_variant(args.problem, "triton")
    mode_key = args.mode if prob.mode_sensitive else "any"
    params = ({k: (v == "True") if v in ("True", "False") else (int(v) if v.isdigit() else v)
               for k, v in (p.split("=") for p in args.params.split(",") if p)}
              or tabled_params(args.problem, tabled_shape, args.precision, mode_key)
              or cls.configs_for(tabled_shape, "cuda", args.precision)[0])
    variant = cls(args.precision, **params)
    variant.build("cuda")
    for batch in [int(b) for b in args.batch.split(",") if b] or [tabled_shape[prob.batch_dim]]:
        shape = {**tabled_shape, prob.batch_dim: batch}
        print(f"{args.problem} {shape} {args.precision} {args.mode}: triton {params}", flush=True)
        profile(prob, variant, shape, args.precision, args.mode)


def profile(prob, variant, shape: dict, precision: str, mode: str) -> None:
    """One call of ``variant`` and one of cuBLAS's GEMM at ``shape``, in the profiled range."""
    model, x = build_case(prob, CheckCase(shape, "rand", 0, False), "cuda", torch.float32, mode)
    weight = prob.linear_of(model).weight.detach()
    if precision == "bf16":
        xb, wb = x.bfloat16(), weight.bfloat16()

        def floor():
            return xb @ wb.t()
    else:
        def floor():
            with math_mode(precision):
                return x @ weight.t()
    with torch.no_grad():
        for _ in range(3):
            variant(model, x)
            floor()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        variant(model, x)
        floor()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
