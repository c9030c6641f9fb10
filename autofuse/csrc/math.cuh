// Elementwise functions and numerically stable reductions shared by the epilogue kernels.
// Accurate fp32 (erff, expf, log1pf, tanhf; no fast-math intrinsics), matching PyTorch's
// definitions: exact erf GELU, softplus with PyTorch's threshold of 20.
#pragma once
#include "autofuse.cuh"

#include <math.h>

// Combine two (max, sum of exp(v - max)) pairs: the numerically stable way to merge softmax
// or logsumexp partials. An empty partial is (-inf, 0).
__device__ __forceinline__ void af_lse_merge(float& m, float& s, float om, float os) {
    if (om == -INFINITY) return;
    if (m == -INFINITY) { m = om; s = os; return; }
    const float hi = fmaxf(m, om);
    s = s * expf(m - hi) + os * expf(om - hi);
    m = hi;
}

// Reduce a (max, sum) pair across the TX consecutive lanes that share a row.
template <int TX>
__device__ __forceinline__ void af_lse_reduce_row(float& m, float& s) {
#pragma unroll
    for (int offset = TX / 2; offset > 0; offset /= 2) {
        const float om = __shfl_xor_sync(0xffffffffu, m, offset, TX);
        const float os = __shfl_xor_sync(0xffffffffu, s, offset, TX);
        af_lse_merge(m, s, om, os);
    }
}

__device__ __forceinline__ float af_gelu(float v) { return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f)); }

// softplus as torch.nn.functional.softplus (beta 1, threshold 20), then mish(v) = v·tanh(softplus(v)).
__device__ __forceinline__ float af_mish(float v) {
    const float sp = v > 20.f ? v : log1pf(expf(v));
    return v * tanhf(sp);
}

// Merge a (max, sum) pair over a whole block of THREADS (a multiple of 32); every thread gets the result.
template <int THREADS>
__device__ __forceinline__ void af_lse_reduce_block(float& m, float& s) {
    __shared__ float red_m[THREADS / 32], red_s[THREADS / 32];
    af_lse_reduce_row<32>(m, s);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) { red_m[warp] = m; red_s[warp] = s; }
    __syncthreads();
    m = lane < THREADS / 32 ? red_m[lane] : -INFINITY;
    s = lane < THREADS / 32 ? red_s[lane] : 0.f;
    af_lse_reduce_row<32>(m, s);
    __syncthreads();  // the shared slots may be reused by the caller's next reduction
}
