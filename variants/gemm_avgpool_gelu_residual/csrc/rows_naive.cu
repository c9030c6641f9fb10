// gemm_avgpool_gelu_residual, naive: out = x + gelu(x·w̄ + c), w̄ = mean(W, 0) and
// c = mean(b) − mean(subtract) folded on the host (the GEMM is provably unnecessary).
//
// The plain reference for the CUDA path, two kernels: one thread per row walks its row and
// sums x·w̄ sequentially into z[row]; then one thread per output element writes
// x + gelu(z[row]). Loads are uncoalesced in the first kernel (adjacent threads read rows
// K floats apart), which is what the tiled and single-pass kinds fix.
#include "math.cuh"

#include <climits>

// Small blocks for the row kernel: a batch of 2048 rows still spreads over 32 SMs.
constexpr int DOT_THREADS = 64;
constexpr int ELEMENT_THREADS = 256;

__global__ void __launch_bounds__(DOT_THREADS)
row_dot_naive(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ offset,
              float* __restrict__ z, int M, int K) {
    const int row = blockIdx.x * DOT_THREADS + threadIdx.x;
    if (row >= M) return;
    const float* xr = x + (size_t)row * K;
    float acc = 0.f;
    for (int k = 0; k < K; ++k) acc = fmaf(xr[k], w[k], acc);
    z[row] = acc + *offset;
}

// Grid-stride only so that more than 2^31 - 1 blocks' worth of elements still works;
// at any realistic size each thread writes exactly one element.
__global__ void __launch_bounds__(ELEMENT_THREADS)
gelu_residual_naive(const float* __restrict__ x, const float* __restrict__ z, float* __restrict__ out, int K,
                    size_t total) {
    const size_t stride = (size_t)gridDim.x * ELEMENT_THREADS;
    for (size_t i = (size_t)blockIdx.x * ELEMENT_THREADS + threadIdx.x; i < total; i += stride)
        out[i] = x[i] + af_gelu(z[i / K]);
}

// x: M×K row-major, w: K (= w̄), offset: one float on the device (= c), z: M scratch, out: M×K.
AF_EXPORT int af_rows_naive(const float* x, const float* w, const float* offset, float* z, float* out, int M, int K,
                            cudaStream_t stream) {
    if (M <= 0 || K <= 0) return 0;  // nothing to write; an empty grid would be a launch error
    row_dot_naive<<<af_ceil_div(M, DOT_THREADS), DOT_THREADS, 0, stream>>>(x, w, offset, z, M, K);
    int status = (int)cudaGetLastError();
    if (status != 0) return status;
    const size_t total = (size_t)M * K;
    const size_t blocks = af_ceil_div(total, (size_t)ELEMENT_THREADS);
    const unsigned grid = (unsigned)(blocks < (size_t)INT_MAX ? blocks : (size_t)INT_MAX);
    gelu_residual_naive<<<grid, ELEMENT_THREADS, 0, stream>>>(x, z, out, K, total);
    AF_CHECK_LAUNCH();
}
