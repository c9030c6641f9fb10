#!/usr/bin/env bash
# The CUDA issue's targets on the GPU, side by side per problem (tests/device/bench_cuda.py), into $OUT.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
b() { timeout 120 python3 tests/device/bench_cuda.py "$@" --out "$OUT" 2>&1 | grep -E "^(NVIDIA|copy_x|cublas|eager|simplified|cuda_templated |single_pass |cold|copy band)" ; }
b gemm_bn --shape-index 0 --mode train
b gemm_bn --shape-index 0 --mode eval
b gemm_bn --shape-index 1 --mode train
b gemm_bn --shape-index 1 --mode eval
b matmul_gelu_softmax
b matmul_clamp_lse_mish
b gemm_avgpool_gelu_residual
