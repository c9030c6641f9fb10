// matmul_clamp_lse_mish on autofuse's fp32 GEMM main loops (naive, tiled or register-blocked,
// chosen at build time; see gemm.cuh): z = logsumexp(clamp(t·(x·Wᵀ + b), lo, hi), dim=1),
// out = z·mish(z), with t = 2·scale_factor (the reference's (y·s) + (y·s): doubling is exact,
// so y·(2s) rounds to the same float).
//
// The GEMM epilogue adds the bias, scales, clamps and, per row and block of columns, leaves the
// pair (max, Σ exp(v − max)); y itself is never stored. A second kernel, one warp per row,
// merges a row's pairs (max subtracted: no overflow at any clamp bound) and writes z·mish(z).
//
// NaN and ±inf follow PyTorch (torch.clamp keeps a NaN, torch.logsumexp gives NaN for a row
// holding one, +inf for a row whose max is +inf, −inf for a row of −inf): see math.cuh.
#include "gemm.cuh"

// z = logsumexp from the merged pair (m + log s, as torch's log(Σ) + max), then z·mish(z).
__device__ __forceinline__ float lse_mish(float m, float s) {
    const float z = isfinite(m) ? m + logf(s) : m;
    return z * af_mish(z);
}

struct ClampLseEpilogue {
    const float* bias;
    float* part_max;  // [M][parts]
    float* part_sum;
    int parts;
    float t, lo, hi;

    template <int TY, int TX, int TM, int TN>
    __device__ void apply(float (&acc)[TM][TN], int row0, int col0, int M, int N, int tx, int ty) const {
        float b[TN];
#pragma unroll
        for (int j = 0; j < TN; ++j) b[j] = col0 + j < N ? bias[col0 + j] : 0.f;
#pragma unroll
        for (int i = 0; i < TM; ++i) {
            const int row = row0 + i;
            float m = -INFINITY, s = 0.f;
#pragma unroll
            for (int j = 0; j < TN; ++j)
                if (row < M && col0 + j < N) af_lse_push(m, s, af_clamp((acc[i][j] + b[j]) * t, lo, hi));
            af_lse_reduce_row<TX>(m, s);  // out-of-range threads join with the empty pair
            if (tx == 0 && row < M) {
                part_max[(size_t)row * parts + blockIdx.x] = m;
                part_sum[(size_t)row * parts + blockIdx.x] = s;
            }
        }
    }
};

constexpr int FINISH_WARPS = 8;  // one warp per row: a row has only N / tile-width pairs

__global__ void __launch_bounds__(FINISH_WARPS * 32)
lse_mish_finish(const float* __restrict__ part_max, const float* __restrict__ part_sum, float* __restrict__ out,
                int M, int parts) {
    const int row = blockIdx.x * FINISH_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= M) return;  // a whole warp leaves together, so the shuffles below stay full-warp
    float m = -INFINITY, s = 0.f;
    for (int p = lane; p < parts; p += 32)
        af_lse_merge(m, s, part_max[(size_t)row * parts + p], part_sum[(size_t)row * parts + p]);
    af_lse_reduce_row<32>(m, s);
    if (lane == 0) out[row] = lse_mish(m, s);
}

// Partial pairs per row this build produces (the caller allocates part_max/part_sum as M×parts).
AF_EXPORT int af_parts(int N) { return af_gemm_col_blocks(N); }

AF_EXPORT int af_gemm_clamp_lse_mish(const float* x, const float* w, const float* b, float* out, float* part_max,
                                     float* part_sum, float t, float lo, float hi, int M, int N, int K,
                                     cudaStream_t stream) {
    if (M == 0) return 0;  // an empty batch: nothing to launch (a 0-block grid is a launch error)
    const int parts = af_gemm_col_blocks(N);
    if (N > 0) {  // with no columns the finish kernel alone writes logsumexp(∅) = −inf, then its mish
        const ClampLseEpilogue epi{b, part_max, part_sum, parts, t, lo, hi};
        const int status = af_gemm_launch(x, w, M, N, K, epi, stream);
        if (status != 0) return status;
    }
    lse_mish_finish<<<af_ceil_div(M, FINISH_WARPS), FINISH_WARPS * 32, 0, stream>>>(part_max, part_sum, out, M, parts);
    AF_CHECK_LAUNCH();
}
