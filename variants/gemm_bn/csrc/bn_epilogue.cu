// gemm_bn, cuBLAS + BatchNorm epilogue (training mode): z = x·Wᵀ (no bias) comes from cuBLAS
// through torch; two kernels finish out = (z − μ_z)·coef + β, coef = s·γ/√(s²·σ²_z + eps).
//
// column_stats: a block per strip of 32 columns × chunk of rows, BLOCK threads as 32 columns ×
//   BLOCK/32 row lanes (each warp reads one 128-byte line of a row). Each thread runs Welford
//   over its rows, the lanes are merged with Chan's update and the chunk's partial stored; the
//   last block of a strip to arrive (a device-scope counter) merges the strip's chunk partials,
//   writes μ_z and coef and updates the running statistics as nn.BatchNorm1d does. Never
//   E[z²] − E[z]²: Welford and Chan's merge keep the variance stable at any mean.
// bn_normalize: z ← (z − μ_z)·coef + β in place, same coalesced layout.
#include "math.cuh"

#ifndef AF_BLOCK
#define AF_BLOCK 256
#endif
constexpr int BLOCK = AF_BLOCK;
constexpr int COLS = 32;              // one warp spans a strip's 32 columns
constexpr int LANES = BLOCK / COLS;   // row lanes per block
static_assert(BLOCK % COLS == 0 && BLOCK >= 64 && BLOCK <= 1024, "BLOCK is a multiple of 32 in [64, 1024]");

// Chunks of rows per strip: enough blocks to fill the GPU (N/32 strips × up to 64 chunks: 8192
// blocks at 16384×4096), and at least MIN_CHUNK_ROWS rows each so the cross-chunk merge stays small.
constexpr int MAX_CHUNKS = 64, MIN_CHUNK_ROWS = 256;
// Rows of one normalize block: each thread rewrites NORM_ROWS/LANES of them.
constexpr int NORM_ROWS = 8 * LANES;

inline int stat_chunks(int M) { return max(1, min(af_ceil_div(M, MIN_CHUNK_ROWS), MAX_CHUNKS)); }

// Welford's update with one value.
__device__ __forceinline__ void welford(float& n, float& mean, float& m2, float v) {
    n += 1.f;
    const float d = v - mean;
    mean += d / n;
    m2 = fmaf(d, v - mean, m2);
}

// Merge the LANES row lanes of each column; the result is valid in lane 0 (ly == 0). Ends
// with a barrier so the shared buffers can be reused at once.
struct LaneMerge {
    float n[LANES][COLS], mean[LANES][COLS], m2[LANES][COLS];

    __device__ void run(float& cn, float& cmean, float& cm2, int cx, int ly) {
        n[ly][cx] = cn;
        mean[ly][cx] = cmean;
        m2[ly][cx] = cm2;
        __syncthreads();
        if (ly == 0) {
#pragma unroll
            for (int l = 1; l < LANES; ++l) af_chan_merge(cn, cmean, cm2, n[l][cx], mean[l][cx], m2[l][cx]);
        }
        __syncthreads();
    }
};

struct BnParams {
    const float* bias;
    const float* scale;
    const float* gamma;
    float* running_mean;  // null with running_var: no running-statistics update
    float* running_var;
    float* col_mean;
    float* col_coef;
    float eps;
    float factor;
};

// One column's final statistics: μ_z and coef for the normalize pass, and BatchNorm1d's running
// statistics of y = (z + b)·s: mean s·(μ_z + b), unbiased variance s²·M2/(n − 1), lerped by factor.
__device__ __forceinline__ void bn_column_finish(int col, float n, float mean, float m2, const BnParams& p) {
    const float s = p.scale[col];
    const float var = m2 / n;  // biased: what BatchNorm normalises with
    p.col_mean[col] = mean;
    p.col_coef[col] = s * p.gamma[col] / sqrtf(s * s * var + p.eps);
    if (p.running_mean != nullptr) {
        const float keep = 1.f - p.factor;
        p.running_mean[col] = keep * p.running_mean[col] + p.factor * (s * (mean + p.bias[col]));
        p.running_var[col] = keep * p.running_var[col] + p.factor * (s * s * (m2 / (n - 1.f)));
    }
}

__global__ void __launch_bounds__(BLOCK)
column_stats(const float* __restrict__ z, int M, int N, int chunk_rows, float* part_count, float* part_mean,
             float* part_m2, unsigned int* arrivals, BnParams params) {
    __shared__ LaneMerge merge;
    __shared__ bool last;
    const int cx = threadIdx.x % COLS, ly = threadIdx.x / COLS;
    const int col = blockIdx.x * COLS + cx;
    const int r0 = blockIdx.y * chunk_rows, r1 = min(M, r0 + chunk_rows);
    float n = 0.f, mean = 0.f, m2 = 0.f;
    if (col < N) {
        // Four independent loads in flight per thread before the dependent Welford updates.
        for (int r = r0 + ly; r < r1; r += 4 * LANES) {
            float v[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) v[u] = r + u * LANES < r1 ? z[(size_t)(r + u * LANES) * N + col] : 0.f;
#pragma unroll
            for (int u = 0; u < 4; ++u)
                if (r + u * LANES < r1) welford(n, mean, m2, v[u]);
        }
    }
    merge.run(n, mean, m2, cx, ly);
    if (ly == 0 && col < N) {
        const size_t at = (size_t)blockIdx.y * N + col;
        part_count[at] = n;
        part_mean[at] = mean;
        part_m2[at] = m2;
    }
    // The threadFenceReduction pattern: partials visible device-wide before this block counts
    // itself in; the block that counts last sees every chunk's partial.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&arrivals[blockIdx.x], 1u) == gridDim.y - 1;
    __syncthreads();
    if (!last) return;
    n = mean = m2 = 0.f;
    if (col < N) {
        for (int p = ly; p < (int)gridDim.y; p += LANES) {
            const size_t at = (size_t)p * N + col;  // __ldcg: from L2, never a stale L1 line
            af_chan_merge(n, mean, m2, __ldcg(part_count + at), __ldcg(part_mean + at), __ldcg(part_m2 + at));
        }
    }
    merge.run(n, mean, m2, cx, ly);
    if (ly == 0 && col < N) bn_column_finish(col, n, mean, m2, params);
    if (threadIdx.x == 0) arrivals[blockIdx.x] = 0;  // ready for reuse
}

__global__ void __launch_bounds__(BLOCK)
bn_normalize(float* __restrict__ z, const float* __restrict__ col_mean, const float* __restrict__ col_coef,
             const float* __restrict__ beta, int M, int N) {
    const int cx = threadIdx.x % COLS, ly = threadIdx.x / COLS;
    const int col = blockIdx.x * COLS + cx;
    if (col >= N) return;
    const float mu = col_mean[col], coef = col_coef[col], b = beta[col];
    const int end = min(M, ((int)blockIdx.y + 1) * NORM_ROWS);
    for (int r = blockIdx.y * NORM_ROWS + ly; r < end; r += LANES) {
        const size_t at = (size_t)r * N + col;
        z[at] = fmaf(z[at] - mu, coef, b);
    }
}

// Sizes of the workspaces the caller allocates: partials [chunks][N], arrivals [strips] (zeroed).
AF_EXPORT int af_bn_chunks(int M) { return stat_chunks(M); }
AF_EXPORT int af_bn_strips(int N) { return af_ceil_div(N, COLS); }

// z (M×N) is normalised in place; running_mean/running_var may both be null (no update).
AF_EXPORT int af_bn_train(float* z, const float* bias, const float* scale, const float* gamma, const float* beta,
                          float* running_mean, float* running_var, float* part_count, float* part_mean,
                          float* part_m2, unsigned int* arrivals, float* col_mean, float* col_coef, float eps,
                          float factor, int M, int N, cudaStream_t stream) {
    if (M == 0 || N == 0) return 0;  // nothing to launch (an empty grid is a launch error)
    const int chunks = stat_chunks(M);
    const int chunk_rows = af_ceil_div(M, chunks);
    const BnParams params{bias, scale, gamma, running_mean, running_var, col_mean, col_coef, eps, factor};
    column_stats<<<dim3(af_ceil_div(N, COLS), chunks), BLOCK, 0, stream>>>(z, M, N, chunk_rows, part_count,
                                                                           part_mean, part_m2, arrivals, params);
    const int status = (int)cudaGetLastError();
    if (status != 0) return status;
    bn_normalize<<<dim3(af_ceil_div(N, COLS), af_ceil_div(M, NORM_ROWS)), BLOCK, 0, stream>>>(z, col_mean, col_coef,
                                                                                               beta, M, N);
    AF_CHECK_LAUNCH();
}
