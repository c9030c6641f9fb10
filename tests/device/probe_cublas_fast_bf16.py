"""Does cuBLAS multiply float32 operands on bfloat16 tensor cores without a cast pass?

    python3 tests/device/probe_cublas_fast_bf16.py [--json PATH]

``cublasGemmEx`` on float32 A, B and C with ``CUBLAS_COMPUTE_32F_FAST_16BF`` lets cuBLAS convert the
operands to bfloat16 itself. If it converts them as it loads them, x's cast (9-17% of the bf16 GEMM,
the margin the bf16 cells of issue 11 miss by) costs nothing. Timed interleaved (L2 flushed,
``autofuse.tuning.timing``; log 2026-11-24d-2 gives median, min and max of per-round medians) beside the
bf16 GEMM on pre-cast operands (the floor), x's cast plus that GEMM, and FAST_TF32; with the
relative L2 error of each against float64, the kernels each one launches (torch.profiler), at
1024×8192×8192 and 16384×4096×4096.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.utils.cpp_extension import load_inline

from autofuse.tuning.timing import time_interleaved

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cublas_v2.h>

// a (M×K) · b (N×K)ᵀ, all float32 row-major, at cuBLAS compute type `mode`
// (0: 32F_FAST_16BF, 1: 32F_FAST_TF32, 2: 32F_FAST_16F).
torch::Tensor mm_fast(torch::Tensor a, torch::Tensor b, int64_t mode) {
  const int M = a.size(0), K = a.size(1), N = b.size(0);
  auto out = torch::empty({M, N}, a.options());
  cublasHandle_t h = at::cuda::getCurrentCUDABlasHandle();
  TORCH_CHECK(cublasSetStream(h, at::cuda::getCurrentCUDAStream()) == CUBLAS_STATUS_SUCCESS);
  const float alpha = 1.f, beta = 0.f;
  cublasComputeType_t ct = mode == 0 ? CUBLAS_COMPUTE_32F_FAST_16BF
                         : mode == 1 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F_FAST_16F;
  auto status = cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha,
                             b.data_ptr<float>(), CUDA_R_32F, K, a.data_ptr<float>(), CUDA_R_32F, K,
                             &beta, out.data_ptr<float>(), CUDA_R_32F, N, ct, CUBLAS_GEMM_DEFAULT);
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "cublasGemmEx: ", (int)status);
  return out;
}
"""


def timed(fns: dict, rounds: int) -> dict:
    """``autofuse.tuning.timing.time_interleaved`` (L2 flushed, round-robin), as [median, p20, p80] ms."""
    return {name: [round(t.median_ms, 4), round(t.p20_ms, 4), round(t.p80_ms, 4)]
            for name, t in time_interleaved(fns, "cuda", rounds=rounds).items()}


def kernels_of(fn) -> list[str]:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [f"{e.key[:90]} {e.device_time_total / e.count:.1f}us" for e in prof.key_averages()]


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    ext = load_inline("probe_fast_bf16", cpp_sources="torch::Tensor mm_fast(torch::Tensor a, torch::Tensor b, int64_t mode);", cuda_sources=SOURCE, functions=["mm_fast"],
                      extra_ldflags=["-lcublas"], verbose=False)
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    results = []
    for m, k, n in ((1024, 8192, 8192), (16384, 4096, 4096)):
        torch.manual_seed(0)
        x = torch.randn(m, k, device="cuda")
        w = torch.randn(n, k, device="cuda") / k ** 0.5
        xb, wb = x.bfloat16(), w.bfloat16()
        fns = {
            "bf16 mm, pre-cast (floor)": lambda: torch.mm(xb, wb.t(), out_dtype=torch.float32),
            "x cast + bf16 mm": lambda: torch.mm(x.bfloat16(), wb.t(), out_dtype=torch.float32),
            "cublas FAST_16BF on float32": lambda: ext.mm_fast(x, w, 0),
            "cublas FAST_TF32 on float32": lambda: ext.mm_fast(x, w, 1),
            "cublas FAST_16F on float32": lambda: ext.mm_fast(x, w, 2),
        }
        ref = x.double() @ w.double().t()
        ref_bf16 = xb.double() @ wb.double().t()
        errors = {}
        for name, fn in fns.items():
            out = fn()
            errors[name] = {"vs float64": rel(out, ref), "vs bf16-rounded operands": rel(out, ref_bf16)}
        row = {"shape": [m, k, n], "ms [median, p20, p80]": timed(fns, args.rounds), "errors": errors,
               "kernels": {name: kernels_of(fn) for name, fn in fns.items()}}
        print(json.dumps(row, indent=1), flush=True)
        results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
