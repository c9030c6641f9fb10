// matmul_gelu_softmax, cuBLAS + fused epilogue: y = x·Wᵀ (+ b) comes from cuBLAS (through
// torch); this one kernel does everything after it, one block of BLOCK threads per row:
// pass 1 reads y once, adds the bias if cuBLAS did not (bias != nullptr: the bf16 GEMM with a
// float32 result has no free bias epilogue), writes gelu(y) and keeps the running (max, Σ exp) pair; pass 2
// rescales the row in place, reading it back from L2 (a row is at most a few tens of KB).
#include "math.cuh"

#ifndef AF_BLOCK
#define AF_BLOCK 256
#endif
constexpr int BLOCK = AF_BLOCK;

__global__ void __launch_bounds__(BLOCK) gelu_softmax_rows(const float* y, const float* bias, float* out, int N) {  // may be in place
    const size_t base = (size_t)blockIdx.x * N;
    float m = -INFINITY, s = 0.f;
    for (int c = threadIdx.x; c < N; c += BLOCK) {
        const float g = af_gelu(bias ? y[base + c] + bias[c] : y[base + c]);
        out[base + c] = g;
        af_lse_push(m, s, g);
    }
    af_lse_reduce_block<BLOCK>(m, s);
    const float inv = 1.f / s;
    for (int c = threadIdx.x; c < N; c += BLOCK) out[base + c] = expf(out[base + c] - m) * inv;
}

AF_EXPORT int af_gelu_softmax_rows(const float* y, const float* bias, float* out, int M, int N, cudaStream_t stream) {
    if (M == 0) return 0;  // an empty batch: nothing to launch (a 0-block grid is a launch error)
    gelu_softmax_rows<<<M, BLOCK, 0, stream>>>(y, bias, out, N);
    AF_CHECK_LAUNCH();
}
