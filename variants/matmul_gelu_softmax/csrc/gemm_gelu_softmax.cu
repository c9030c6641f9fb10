// matmul_gelu_softmax on autofuse's fp32 GEMM main loops (naive, tiled or register-blocked,
// chosen at build time; see gemm.cuh): softmax(gelu(x·Wᵀ + b), dim=1).
//
// The GEMM epilogue adds the bias, applies the exact erf GELU, stores the row and leaves, per
// row and per block of columns, the pair (max, Σ exp(v − max)). A second kernel merges a
// row's pairs (max subtracted: no overflow at any magnitude) and rescales the row in place.
#include "gemm.cuh"

struct GeluSoftmaxEpilogue {
    const float* bias;
    float* y;
    float* part_max;  // [M][parts]
    float* part_sum;
    int parts;

    template <int TY, int TX, int TM, int TN>
    __device__ void apply(float (&acc)[TM][TN], int row0, int col0, int M, int N, int tx, int ty) const {
#pragma unroll
        for (int i = 0; i < TM; ++i) {
            const int row = row0 + i;
            float m = -INFINITY, s = 0.f;
#pragma unroll
            for (int j = 0; j < TN; ++j) {
                const int col = col0 + j;
                if (row < M && col < N) {
                    const float v = af_gelu(acc[i][j] + bias[col]);
                    y[(size_t)row * N + col] = v;
                    af_lse_push(m, s, v);
                }
            }
            af_lse_reduce_row<TX>(m, s);
            if (tx == 0 && row < M) {
                part_max[(size_t)row * parts + blockIdx.x] = m;
                part_sum[(size_t)row * parts + blockIdx.x] = s;
            }
        }
    }
};

constexpr int FINAL_THREADS = 256;

__global__ void __launch_bounds__(FINAL_THREADS)
softmax_finish(float* __restrict__ y, const float* __restrict__ part_max, const float* __restrict__ part_sum,
               int N, int parts) {
    const int row = blockIdx.x;
    float m = -INFINITY, s = 0.f;
    for (int p = threadIdx.x; p < parts; p += FINAL_THREADS)
        af_lse_merge(m, s, part_max[(size_t)row * parts + p], part_sum[(size_t)row * parts + p]);
    af_lse_reduce_block<FINAL_THREADS>(m, s);
    const float inv = 1.f / s;
    float* r = y + (size_t)row * N;
    for (int c = threadIdx.x; c < N; c += FINAL_THREADS) r[c] = expf(r[c] - m) * inv;
}

// Partial results per row this build produces (the caller allocates part_max/part_sum as M×parts).
AF_EXPORT int af_parts(int N) { return af_gemm_col_blocks(N); }

AF_EXPORT int af_gemm_gelu_softmax(const float* x, const float* w, const float* b, float* y, float* part_max,
                                   float* part_sum, int M, int N, int K, cudaStream_t stream) {
    const int parts = af_gemm_col_blocks(N);
    const GeluSoftmaxEpilogue epi{b, y, part_max, part_sum, parts};
    int status = af_gemm_launch(x, w, M, N, K, epi, stream);
    if (status != 0) return status;
    softmax_finish<<<M, FINAL_THREADS, 0, stream>>>(y, part_max, part_sum, N, parts);
    AF_CHECK_LAUNCH();
}
