// matmul_clamp_lse_mish, cuBLAS + fused epilogue: y = x·Wᵀ (+ b) comes from cuBLAS (through
// torch); this one kernel does everything after it, one block of BLOCK threads per row, in
// one read of y: the bias if cuBLAS did not add it (bias != nullptr: the bf16 GEMM with a
// float32 result has no free bias epilogue), v = clamp(t·y, lo, hi) with t = 2·scale_factor, the running (max, Σ exp)
// pair (max subtracted: no overflow at any clamp bound), then z·mish(z) into out[row].
//
// NaN and ±inf follow PyTorch (torch.clamp keeps a NaN, torch.logsumexp gives NaN for a row
// holding one, +inf for a row whose max is +inf, −inf for a row of −inf): see math.cuh.
#include "math.cuh"

#ifndef AF_BLOCK
#define AF_BLOCK 256
#endif
constexpr int BLOCK = AF_BLOCK;
static_assert(BLOCK % 32 == 0 && BLOCK >= 32 && BLOCK <= 1024, "AF_BLOCK must be a multiple of 32 in [32, 1024]");
constexpr int UNROLL = 4;  // loads in flight per thread before their values are reduced

// z = logsumexp from the merged pair (m + log s, as torch's log(Σ) + max), then z·mish(z).
__device__ __forceinline__ float lse_mish(float m, float s) {
    const float z = isfinite(m) ? m + logf(s) : m;
    return z * af_mish(z);
}

// One row: HAS_BIAS is a template argument so the fp32 path's inner loop is what it was.
template <bool HAS_BIAS>
__device__ __forceinline__ void clamp_lse_mish_row(const float* __restrict__ y, const float* __restrict__ bias,
                                                   float* __restrict__ out, int N, float t, float lo, float hi) {
    const float* r = y + (size_t)blockIdx.x * N;
    float m = -INFINITY, s = 0.f;
    int c = threadIdx.x;
    for (; c + (UNROLL - 1) * BLOCK < N; c += UNROLL * BLOCK) {
        float v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) v[u] = HAS_BIAS ? r[c + u * BLOCK] + bias[c + u * BLOCK] : r[c + u * BLOCK];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) af_lse_push(m, s, af_clamp(v[u] * t, lo, hi));
    }
    for (; c < N; c += BLOCK) af_lse_push(m, s, af_clamp((HAS_BIAS ? r[c] + bias[c] : r[c]) * t, lo, hi));
    af_lse_reduce_block<BLOCK>(m, s);
    if (threadIdx.x == 0) out[blockIdx.x] = lse_mish(m, s);
}

__global__ void __launch_bounds__(BLOCK)
clamp_lse_mish_rows(const float* __restrict__ y, const float* __restrict__ bias, float* __restrict__ out, int N,
                    float t, float lo, float hi) {
    if (bias) {
        clamp_lse_mish_row<true>(y, bias, out, N, t, lo, hi);
    } else {
        clamp_lse_mish_row<false>(y, bias, out, N, t, lo, hi);
    }
}

AF_EXPORT int af_clamp_lse_mish_rows(const float* y, const float* bias, float* out, float t, float lo, float hi,
                                     int M, int N, cudaStream_t stream) {
    if (M == 0) return 0;  // an empty batch: nothing to launch (a 0-block grid is a launch error)
    clamp_lse_mish_rows<<<M, BLOCK, 0, stream>>>(y, bias, out, N, t, lo, hi);
    AF_CHECK_LAUNCH();
}
