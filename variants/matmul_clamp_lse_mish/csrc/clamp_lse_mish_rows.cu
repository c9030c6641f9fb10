// matmul_clamp_lse_mish, cuBLAS + fused epilogue: y = x·Wᵀ (+ b) comes from cuBLAS (through
// torch), float32 or, under bf16, bfloat16 (the GEMM's own output type: half the bytes to
// read); this one kernel does everything after it, one block of BLOCK threads per row, in
// one read of y (16-byte loads where the row length and pointers allow): the bias if cuBLAS
// did not add it (bias != nullptr: the bf16 GEMM has no free bias epilogue),
// v = clamp(t·y, lo, hi) with t = 2·scale_factor, the running (max, Σ exp) pair (max
// subtracted: no overflow at any clamp bound), then z·mish(z) into out[row].
//
// NaN and ±inf follow PyTorch (torch.clamp keeps a NaN, torch.logsumexp gives NaN for a row
// holding one, +inf for a row whose max is +inf, −inf for a row of −inf): see math.cuh.
#include "math.cuh"
#include "rows.cuh"

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

// One row, V consecutive elements a load (V > 1 only when N % V == 0 and the pointers are
// 16-byte aligned, so a vector is wholly in the row). HAS_BIAS is a template argument so the
// fp32 path's inner loop carries no bias test.
template <typename T, int V, bool HAS_BIAS>
__device__ __forceinline__ void clamp_lse_mish_row(const T* __restrict__ y, const float* __restrict__ bias,
                                                   float* __restrict__ out, int N, float t, float lo, float hi) {
    constexpr int STEP = BLOCK * V;
    const T* r = y + (size_t)blockIdx.x * N;
    float m = -INFINITY, s = 0.f;
    int c = threadIdx.x * V;
    for (; c + (UNROLL - 1) * STEP < N; c += UNROLL * STEP) {
        float v[UNROLL * V];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) af_load_floats<V>(r + c + u * STEP, &v[u * V]);
        if constexpr (HAS_BIAS) {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                float b[V];
                af_load_floats<V>(bias + c + u * STEP, b);
#pragma unroll
                for (int i = 0; i < V; ++i) v[u * V + i] += b[i];
            }
        }
#pragma unroll
        for (int i = 0; i < UNROLL * V; ++i) af_lse_push(m, s, af_clamp(v[i] * t, lo, hi));
    }
    for (; c < N; c += STEP) {
        float v[V], b[V];
        af_load_floats<V>(r + c, v);
        if constexpr (HAS_BIAS) af_load_floats<V>(bias + c, b);
#pragma unroll
        for (int i = 0; i < V; ++i) af_lse_push(m, s, af_clamp((HAS_BIAS ? v[i] + b[i] : v[i]) * t, lo, hi));
    }
    af_lse_reduce_block<BLOCK>(m, s);
    if (threadIdx.x == 0) out[blockIdx.x] = lse_mish(m, s);
}

template <typename T, int V>
__global__ void __launch_bounds__(BLOCK)
clamp_lse_mish_rows(const T* __restrict__ y, const float* __restrict__ bias, float* __restrict__ out, int N,
                    float t, float lo, float hi) {
    if (bias) {
        clamp_lse_mish_row<T, V, true>(y, bias, out, N, t, lo, hi);
    } else {
        clamp_lse_mish_row<T, V, false>(y, bias, out, N, t, lo, hi);
    }
}

template <typename T>
int launch_rows(const T* y, const float* bias, float* out, float t, float lo, float hi, int M, int N,
                cudaStream_t stream) {
    constexpr int W = af_vec_width<T>;
    if (N % W == 0 && af_aligned16(y, bias)) {
        clamp_lse_mish_rows<T, W><<<M, BLOCK, 0, stream>>>(y, bias, out, N, t, lo, hi);
    } else {
        clamp_lse_mish_rows<T, 1><<<M, BLOCK, 0, stream>>>(y, bias, out, N, t, lo, hi);
    }
    AF_CHECK_LAUNCH();
}

// y: M×N float32 (y_bf16 == 0) or bfloat16; out: M float32.
AF_EXPORT int af_clamp_lse_mish_rows(const void* y, int y_bf16, const float* bias, float* out, float t, float lo,
                                     float hi, int M, int N, cudaStream_t stream) {
    if (M == 0) return 0;  // an empty batch: nothing to launch (a 0-block grid is a launch error)
    if (y_bf16) return launch_rows(static_cast<const __nv_bfloat16*>(y), bias, out, t, lo, hi, M, N, stream);
    return launch_rows(static_cast<const float*>(y), bias, out, t, lo, hi, M, N, stream);
}
