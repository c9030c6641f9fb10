// Elementwise functions and numerically stable reductions shared by the epilogue kernels.
// Accurate fp32 (erff, expf, log1pf, tanhf; no fast-math intrinsics), matching PyTorch's
// definitions: exact erf GELU, softplus with PyTorch's threshold of 20.
#pragma once
#include "autofuse.cuh"

#include <math.h>

// torch.clamp(v, lo, hi): a NaN stays NaN, a NaN bound makes the result NaN (clamp_out fills
// it with NaN); lo > hi gives hi, as min(max(v, lo), hi) does. fmaxf alone would drop a NaN.
__device__ __forceinline__ float af_clamp(float v, float lo, float hi) {
    return (isnan(v) || isnan(lo) || isnan(hi)) ? NAN : fminf(fmaxf(v, lo), hi);
}

// Merge (om, os) into the running (max, Σ exp(v − max)) pair (m, s): the numerically stable way
// to combine softmax or logsumexp partials; the empty pair is (−inf, 0). A NaN or +inf max is
// final (the row's result is that value, as in torch.logsumexp), so its sum is zeroed; fmaxf
// alone would drop a NaN. Otherwise s stays a finite sum of terms ≤ 1.
__device__ __forceinline__ void af_lse_merge(float& m, float& s, float om, float os) {
    const float hi = (isnan(m) || isnan(om)) ? NAN : fmaxf(m, om);
    if (!isfinite(hi)) {  // NaN or +inf: the row's result; −inf: both pairs empty
        m = hi;
        s = 0.f;
        return;
    }
    s = s * expf(m - hi) + os * expf(om - hi);
    m = hi;
}

// Add one value; the usual case (no new max, finite max) costs one expf.
__device__ __forceinline__ void af_lse_push(float& m, float& s, float v) {
    if (isfinite(m) && v <= m) s += expf(v - m);  // false for a NaN v: the merge handles it
    else af_lse_merge(m, s, v, 1.f);
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

// Chan et al.'s parallel update of (count, mean, M2) variance partials: merge (nb, mean_b, m2_b)
// into (n, mean, m2). Stable where Σv² − (Σv)²/n cancels catastrophically. An empty partial
// (nb == 0) changes nothing; merging into an empty one copies it.
__device__ __forceinline__ void af_chan_merge(float& n, float& mean, float& m2, float nb, float mean_b, float m2_b) {
    if (nb == 0.f) return;
    const float total = n + nb;
    const float delta = mean_b - mean;
    const float fb = nb / total;
    mean = fmaf(delta, fb, mean);
    m2 = m2 + m2_b + delta * delta * n * fb;  // δ²·n·nb/(n + nb)
    n = total;
}
