// gemm_bn on autofuse's fp32 GEMM main loops (naive, tiled or register-blocked, chosen at
// build time; see gemm.cuh): out = BatchNorm1d((x·Wᵀ + b)·s).
//
// Training, with z = x·Wᵀ (no bias): out = (z − μ_z)·coef + β, coef = s·γ/√(s²·σ²_z + eps).
//   1. The GEMM epilogue stores z and leaves, per column and block of rows, the partial
//      (count, mean, M2) of the block's valid rows: a two-pass over the accumulators still in
//      registers (block mean first, then Σ(z − mean)²), never E[z²] − E[z]².
//   2. bn_finalize merges a column's partials with Chan's parallel update, writes μ_z and coef,
//      and updates the running statistics in place as nn.BatchNorm1d does.
//   3. bn_normalize rewrites z in place, coalesced along columns.
// Eval: the epilogue applies out = z·k + shift per column (k, shift folded by the caller).
#include "gemm.cuh"

// --- training: GEMM epilogue ---------------------------------------------------------------
struct BnTrainEpilogue {
    float* z;           // [M][N]: z = x·Wᵀ, normalised in place later
    float* part_count;  // [row_blocks][N]
    float* part_mean;
    float* part_m2;

    // Σ v over the block's threads that share this thread's columns (same tx), returned to
    // every one of them. The TY threads of a column are TX lanes apart, so a warp holds 32/TX
    // of them: shuffles of stride TX reduce those, shared memory the WARPS warp partials.
    // Every thread sums the WARPS partials itself, in the same order, so all get the same
    // bits without a broadcast barrier.
    template <int TY, int TX>
    __device__ static float column_sum(float v, float (*red)[TX], int tx) {
        constexpr int WARPS = TY * TX / 32;
#pragma unroll
        for (int offset = TX; offset < 32; offset <<= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
        if ((threadIdx.x & 31) < TX) red[threadIdx.x >> 5][tx] = v;
        __syncthreads();
        float total = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) total += red[w][tx];
        return total;
    }

    template <int TY, int TX, int TM, int TN>
    __device__ void apply(float (&acc)[TM][TN], int row0, int col0, int M, int N, int tx, int ty) const {
        static_assert(TX <= 32 && (TX & (TX - 1)) == 0, "the TX threads sharing rows are lanes of one warp");
        static_assert((TY * TX) % 32 == 0, "whole warps: every lane takes part in the shuffles");
        constexpr int WARPS = TY * TX / 32;
        // Two buffers, one per pass: a column's pass-1 reads of red[0] finish before any
        // thread passes the pass-2 barrier, and its pass-2 reads of red[1] before the next
        // column's pass-1 barrier, so two barriers per column suffice. At most
        // 2·(THREADS/32)·TX floats (8 KB at 1024 threads); cuda_fused.py keeps configurations
        // whose GEMM buffers leave room for it under 48 KB.
        __shared__ float red[2][WARPS][TX];
        const int block_rows = min(M - (int)blockIdx.y * (TY * TM), TY * TM);  // >= 1: the block exists
        const float count = (float)block_rows;
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int j = 0; j < TN; ++j)
                if (row0 + i < M && col0 + j < N) z[(size_t)(row0 + i) * N + col0 + j] = acc[i][j];
#pragma unroll
        for (int j = 0; j < TN; ++j) {
            float s = 0.f;
#pragma unroll
            for (int i = 0; i < TM; ++i)
                if (row0 + i < M) s += acc[i][j];
            const float mean = column_sum<TY, TX>(s, red[0], tx) / count;
            float q = 0.f;
#pragma unroll
            for (int i = 0; i < TM; ++i) {
                if (row0 + i < M) {
                    const float d = acc[i][j] - mean;
                    q = fmaf(d, d, q);
                }
            }
            const float m2 = column_sum<TY, TX>(q, red[1], tx);
            const int col = col0 + j;
            if (ty == 0 && col < N) {
                const size_t at = (size_t)blockIdx.y * N + col;
                part_count[at] = count;
                part_mean[at] = mean;
                part_m2[at] = m2;
            }
        }
    }
};

// --- training: finalize and normalize ---------------------------------------------------------
// One column's final statistics: μ_z and coef for the normalize pass, and BatchNorm1d's running
// statistics of y = (z + b)·s: mean s·(μ_z + b), unbiased variance s²·M2/(n − 1), lerped by factor.
__device__ __forceinline__ void bn_column_finish(int col, float n, float mean, float m2, const float* bias,
                                                 const float* scale, const float* gamma, float* running_mean,
                                                 float* running_var, float* col_mean, float* col_coef, float eps,
                                                 float factor) {
    const float s = scale[col];
    const float var = m2 / n;  // biased: what BatchNorm normalises with
    col_mean[col] = mean;
    col_coef[col] = s * gamma[col] / sqrtf(s * s * var + eps);
    if (running_mean != nullptr) {  // null: this call does not track running statistics
        const float keep = 1.f - factor;
        running_mean[col] = keep * running_mean[col] + factor * (s * (mean + bias[col]));
        running_var[col] = keep * running_var[col] + factor * (s * s * (m2 / (n - 1.f)));
    }
}

// A block per 32 columns: 8 lanes each merge every 8th row block's partial (reads coalesced
// along columns), then lane 0 merges the 8 results.
constexpr int FIN_COLS = 32, FIN_LANES = 8;

__global__ void __launch_bounds__(FIN_COLS* FIN_LANES)
bn_finalize(const float* __restrict__ part_count, const float* __restrict__ part_mean,
            const float* __restrict__ part_m2, int parts, const float* bias, const float* scale, const float* gamma,
            float* running_mean, float* running_var, float* col_mean, float* col_coef, float eps, float factor, int N) {
    __shared__ float sn[FIN_LANES][FIN_COLS], sm[FIN_LANES][FIN_COLS], sq[FIN_LANES][FIN_COLS];
    const int cx = threadIdx.x, ly = threadIdx.y;
    const int col = blockIdx.x * FIN_COLS + cx;
    float n = 0.f, mean = 0.f, m2 = 0.f;
    if (col < N) {
        for (int p = ly; p < parts; p += FIN_LANES) {
            const size_t at = (size_t)p * N + col;
            af_chan_merge(n, mean, m2, part_count[at], part_mean[at], part_m2[at]);
        }
    }
    sn[ly][cx] = n;
    sm[ly][cx] = mean;
    sq[ly][cx] = m2;
    __syncthreads();
    if (ly != 0 || col >= N) return;
#pragma unroll
    for (int l = 1; l < FIN_LANES; ++l) af_chan_merge(n, mean, m2, sn[l][cx], sm[l][cx], sq[l][cx]);
    bn_column_finish(col, n, mean, m2, bias, scale, gamma, running_mean, running_var, col_mean, col_coef, eps, factor);
}

// out = (z − μ)·coef + β in place. A block covers 32 columns × NORM_ROWS rows; each warp
// touches 32 consecutive floats of a row (one 128-byte line).
constexpr int NORM_COLS = 32, NORM_LANES = 8, NORM_ROWS = 64;

__global__ void __launch_bounds__(NORM_COLS* NORM_LANES)
bn_normalize(float* __restrict__ z, const float* __restrict__ col_mean, const float* __restrict__ col_coef,
             const float* __restrict__ beta, int M, int N) {
    const int col = blockIdx.x * NORM_COLS + threadIdx.x;
    if (col >= N) return;
    const float mu = col_mean[col], coef = col_coef[col], b = beta[col];
    const int end = min(M, ((int)blockIdx.y + 1) * NORM_ROWS);
    for (int r = blockIdx.y * NORM_ROWS + threadIdx.y; r < end; r += NORM_LANES) {
        const size_t at = (size_t)r * N + col;
        z[at] = fmaf(z[at] - mu, coef, b);
    }
}

// --- eval: one epilogue ---------------------------------------------------------------------------
struct BnEvalEpilogue {
    const float* k;      // [N]: s·γ/√(running_var + eps)
    const float* shift;  // [N]: (b·s − running_mean)·γ/√(running_var + eps) + β
    float* out;

    template <int TY, int TX, int TM, int TN>
    __device__ void apply(float (&acc)[TM][TN], int row0, int col0, int M, int N, int tx, int ty) const {
#pragma unroll
        for (int j = 0; j < TN; ++j) {
            const int col = col0 + j;
            if (col >= N) continue;
            const float kc = k[col], sc = shift[col];
#pragma unroll
            for (int i = 0; i < TM; ++i)
                if (row0 + i < M) out[(size_t)(row0 + i) * N + col] = fmaf(acc[i][j], kc, sc);
        }
    }
};

// --- launchers ------------------------------------------------------------------------------------
// Row blocks this build produces (the caller allocates the partials as row_blocks × N).
AF_EXPORT int af_row_blocks(int M) { return af_gemm_row_blocks(M); }

// running_mean/running_var may both be null (no running-statistics update); the others may not.
AF_EXPORT int af_gemm_bn_train(const float* x, const float* w, const float* bias, const float* scale,
                               const float* gamma, const float* beta, float* running_mean, float* running_var,
                               float* out, float* part_count, float* part_mean, float* part_m2, float* col_mean,
                               float* col_coef, float eps, float factor, int M, int N, int K, cudaStream_t stream) {
    if (M == 0 || N == 0) return 0;  // nothing to launch (an empty grid is a launch error)
    const BnTrainEpilogue epi{out, part_count, part_mean, part_m2};
    int status = af_gemm_launch(x, w, M, N, K, epi, stream);
    if (status != 0) return status;
    const int strips = af_ceil_div(N, FIN_COLS);
    bn_finalize<<<strips, dim3(FIN_COLS, FIN_LANES), 0, stream>>>(part_count, part_mean, part_m2,
                                                                  af_gemm_row_blocks(M), bias, scale, gamma,
                                                                  running_mean, running_var, col_mean, col_coef,
                                                                  eps, factor, N);
    status = (int)cudaGetLastError();
    if (status != 0) return status;
    const dim3 grid(af_ceil_div(N, NORM_COLS), af_ceil_div(M, NORM_ROWS));
    bn_normalize<<<grid, dim3(NORM_COLS, NORM_LANES), 0, stream>>>(out, col_mean, col_coef, beta, M, N);
    AF_CHECK_LAUNCH();
}

AF_EXPORT int af_gemm_bn_eval(const float* x, const float* w, const float* k, const float* shift, float* out, int M,
                              int N, int K, cudaStream_t stream) {
    if (M == 0 || N == 0) return 0;
    const BnEvalEpilogue epi{k, shift, out};
    return af_gemm_launch(x, w, M, N, K, epi, stream);
}
