"""Probe: can cuBLAS do the bf16 GEMM straight from float32 operands, at bf16 speed?

    python3 tests/device/probe_fast_bf16.py

Under bf16 every variant casts x to bf16 first (0.022 ms at 1024×8192, 13% of the GEMM).
cublasGemmEx takes float32 A, B and C with CUBLAS_COMPUTE_32F_FAST_16BF ("allows
down-converting inputs to bfloat16"): if its kernels convert on load, the cast disappears.
Prints each path's median time (L2 flushed, interleaved) and its error against float64 on
bf16-rounded operands, so a path that quietly ran at TF32 shows as an error well under bf16's.
"""
import torch
from torch.utils.cpp_extension import load_inline

from autofuse.tuning import timing

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cublas_v2.h>

// y = x @ w.T in row-major terms at the given cuBLAS compute type; x and w are float32 or bf16
// (their dtypes pick cuBLAS's operand types), y is float32.
torch::Tensor gemm(torch::Tensor x, torch::Tensor w, int64_t compute) {
    const int M = x.size(0), K = x.size(1), N = w.size(0);
    auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
    const float alpha = 1.f, beta = 0.f;
    auto handle = at::cuda::getCurrentCUDABlasHandle();
    cudaDataType wt = w.scalar_type() == torch::kBFloat16 ? CUDA_R_16BF : CUDA_R_32F;
    cudaDataType xt = x.scalar_type() == torch::kBFloat16 ? CUDA_R_16BF : CUDA_R_32F;
    auto status = cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha,
                               w.data_ptr(), wt, K, x.data_ptr(), xt, K, &beta,
                               y.data_ptr(), CUDA_R_32F, N, (cublasComputeType_t)compute,
                               CUBLAS_GEMM_DEFAULT);
    TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "cublasGemmEx: ", cublasGetStatusString(status));
    return y;
}
"""

ext = load_inline("probe_fast_bf16", cpp_sources=SOURCE, functions=["gemm"], with_cuda=True,
                  extra_ldflags=["-lcublas"], verbose=False)
dev = torch.device("cuda")
print(torch.cuda.get_device_name(), torch.__version__, torch.version.cuda)
M, K, N = 1024, 8192, 8192
x = torch.rand(M, K, device=dev)
w = (torch.rand(N, K, device=dev) * 2 - 1) / 90.5
xb, wb = x.bfloat16(), w.bfloat16()
ref_bf16 = xb.double() @ wb.double().t()        # what bf16 precision promises
ref_exact = x.double() @ w.double().t()

paths = {
    "bf16 mm, bf16 operands (floor)": lambda: xb @ wb.t(),
    "cast x + bf16 mm": lambda: x.bfloat16() @ wb.t(),
    "GemmEx fp32 in, FAST_16BF": lambda: ext.gemm(x, w, 75),
    "GemmEx fp32 in, FAST_TF32": lambda: ext.gemm(x, w, 77),
    "GemmEx fp32 x, bf16 w, 32F": lambda: ext.gemm(x, wb, 68),
    "GemmEx bf16 in, 32F (fp32 out)": lambda: ext.gemm(xb, wb, 68),
}
ok = {}
for name, fn in paths.items():
    try:
        y = fn().double()
        errs = [((y - r).norm() / r.norm()).item() for r in (ref_bf16, ref_exact)]
        print(f"{name:34s} relerr vs bf16-rounded {errs[0]:.2e}, vs exact {errs[1]:.2e}")
        ok[name] = fn
    except Exception as exc:
        print(f"{name:34s} FAILED {type(exc).__name__}: {str(exc)[:160]}")
stats = timing.time_interleaved(ok, dev, rounds=40)
for name, s in stats.items():
    print(f"{name:34s} {s}")
