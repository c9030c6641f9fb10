"""CUDA variants side by side on the GPU: each against cuBLAS GEMM alone, eager and the memory floor.

    python3 tests/device/bench_cuda.py matmul_gelu_softmax [--precision fp32] [--sweep 12] [--out DIR]

Prints one table (median ms, p20-p80, ratio to cuBLAS GEMM alone, speedup over eager, TFLOP/s
of the GEMM) and writes it as JSON. Every candidate's output is first compared with eager.
"""

import argparse
import json
import random
import sys
import time

import torch

from autofuse.core import registry
from autofuse.core.precision import linear, math_mode
from autofuse.core.variant import EagerVariant
from autofuse.kernels import build as builder
from autofuse.tuning.gate import CheckCase, build_case
from autofuse.tuning.timing import time_interleaved


def cold_compile_seconds(variant_cls, params, tmp):
    import os
    os.environ["AUTOFUSE_HOME"], old = tmp, os.environ.get("AUTOFUSE_HOME")
    try:
        start = time.perf_counter()
        builder.build(variant_cls("fp32", **params).kernel_build("cuda"))
        return time.perf_counter() - start
    finally:
        os.environ["AUTOFUSE_HOME"] = old or ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("problem")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--sweep", type=int, default=0, help="extra random cuda_templated configurations")
    ap.add_argument("--mode", default="train")
    ap.add_argument("--shape-index", type=int, default=-1, help="which default shape (default: the last)")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    prob = registry.get_problem(args.problem)
    shape = dict(prob.default_shapes[args.shape_index])
    model, x = build_case(prob, CheckCase(shape, "rand", 0, False), "cuda", torch.float32, args.mode)
    lin = prob.linear_of(model)
    calls, meta = {}, {}

    def gemm_alone():
        with math_mode(args.precision):
            return linear(x, lin.weight, None, args.precision)

    calls["cublas_gemm_alone"] = gemm_alone
    calls["eager"] = lambda: EagerVariant(args.precision)(model, x)
    copy_bytes = x.numel() * 4 * 2
    calls["copy_x"] = lambda: x.clone()
    with torch.no_grad():
        reference = EagerVariant(args.precision)(__import__("copy").deepcopy(model), x).double()
    for name, cls in registry.variants(prob.name).items():
        if cls.admits("cuda", torch.float32, args.precision, False) is not None or name in ("eager",):
            continue
        configs = cls.configs(shape, "cuda")
        chosen = configs[:1] + (random.Random(0).sample(configs[1:], min(args.sweep, len(configs) - 1)) if args.sweep and len(configs) > 1 else [])
        for i, params in enumerate(chosen):
            label = name if i == 0 else f"{name}[{','.join(f'{k}={v}' for k, v in params.items())}]"
            variant = cls(args.precision, **params)
            try:
                variant.build("cuda")
                with torch.no_grad():
                    out = variant(__import__("copy").deepcopy(model), x)
                torch.cuda.synchronize()
                err = ((out.double() - reference).norm() / reference.norm()).item()
            except Exception as exc:  # noqa: BLE001
                print(f"{label}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                continue
            meta[label] = {"params": params, "rel_err_vs_eager": err}
            calls[label] = (lambda v: (lambda: v(model, x)))(variant)
    with torch.no_grad():
        timings = time_interleaved(calls, "cuda", rounds=20)
    gemm = timings["cublas_gemm_alone"].median_ms
    eager = timings["eager"].median_ms
    flops = 2 * x.shape[0] * lin.in_features * lin.out_features
    floor_ms = timings["copy_x"].median_ms  # read x + write x: the 51 memory floor
    rows = []
    print(f"\n{torch.cuda.get_device_name()} torch {torch.__version__} {prob.name} {prob.shape_str(shape)} {args.precision} {args.mode}")
    print(f"{'candidate':58s} {'median ms':>10s} {'p20-p80':>17s} {'/gemm':>7s} {'xeager':>7s} {'/copy':>7s} {'TFLOP/s':>8s} {'err':>9s}")
    for label, t in sorted(timings.items(), key=lambda kv: kv[1].median_ms):
        row = {"candidate": label, "median_ms": t.median_ms, "p20_ms": t.p20_ms, "p80_ms": t.p80_ms,
               "vs_gemm": t.median_ms / gemm, "speedup_vs_eager": eager / t.median_ms,
               "vs_copy_floor": t.median_ms / floor_ms, "gemm_tflops": flops / t.median_ms / 1e9, **meta.get(label, {})}
        rows.append(row)
        print(f"{label[:58]:58s} {t.median_ms:10.4f} {t.p20_ms:8.4f}-{t.p80_ms:<8.4f} {row['vs_gemm']:7.3f} {row['speedup_vs_eager']:7.2f} "
              f"{row['vs_copy_floor']:7.2f} {row['gemm_tflops']:8.1f} {meta.get(label, {}).get('rel_err_vs_eager', float('nan')):9.2e}")
    print(f"copy bandwidth {copy_bytes / (floor_ms / 1e3) / 1e12:.2f} TB/s (read + write)")
    compile_s = None
    for name, cls in registry.variants(prob.name).items():
        if name == "cuda_templated" or (name == "single_pass"):
            import tempfile
            compile_s = cold_compile_seconds(cls, cls.configs(shape, "cuda")[0], tempfile.mkdtemp())
            print(f"cold compile of one {name} configuration: {compile_s:.2f} s")
    with open(f"{args.out}/bench_{prob.name}_{args.shape_index}_{args.precision}_{args.mode}.json", "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": shape,
                   "precision": args.precision, "mode": args.mode, "rows": rows, "cold_compile_s": compile_s}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
