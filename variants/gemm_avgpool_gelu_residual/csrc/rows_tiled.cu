// gemm_avgpool_gelu_residual, tiled: out = x + gelu(x·w̄ + c), w̄ = mean(W, 0) and
// c = mean(b) − mean(subtract) folded on the host.
//
// One block of BLOCK threads per row. Pass 1: a coalesced strided dot product of the row
// with w̄ (consecutive threads read consecutive floats), then a block reduction and GELU.
// Pass 2: the same strided walk writes x + g, re-reading the row from L2 (a row is K·4
// bytes, 32 KB at K = 8192; the rows of all resident blocks fit in L2). So DRAM sees the
// row read about once, but every element is loaded twice; the single-pass kind keeps it
// in registers instead. r = x·w̄ + c goes to r_out when it is not null (for the backward).
#include "math.cuh"

#ifndef AF_BLOCK
#define AF_BLOCK 256
#endif
constexpr int BLOCK = AF_BLOCK;
static_assert(BLOCK % 32 == 0 && BLOCK >= 32 && BLOCK <= 1024, "AF_BLOCK must be a multiple of 32 in [32, 1024]");

__global__ void __launch_bounds__(BLOCK)
gelu_residual_tiled(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ offset,
                    float* __restrict__ out, float* __restrict__ r_out, int K) {
    __shared__ float partials[BLOCK / 32];
    const float* xr = x + (size_t)blockIdx.x * K;
    float* outr = out + (size_t)blockIdx.x * K;
    float acc = 0.f;
    for (int k = threadIdx.x; k < K; k += BLOCK) acc = fmaf(xr[k], __ldg(w + k), acc);
    const float r = af_block_sum<BLOCK>(acc, partials) + __ldg(offset);
    if (r_out != nullptr && threadIdx.x == 0) r_out[blockIdx.x] = r;
    const float g = af_gelu(r);
    for (int k = threadIdx.x; k < K; k += BLOCK) outr[k] = xr[k] + g;
}

// x: M×K row-major, w: K (= w̄), offset: one float on the device (= c), out: M×K, r: M or null.
AF_EXPORT int af_rows_tiled(const float* x, const float* w, const float* offset, float* out, float* r, int M, int K,
                            cudaStream_t stream) {
    if (M <= 0 || K <= 0) return 0;  // nothing to write; an empty grid would be a launch error
    gelu_residual_tiled<<<M, BLOCK, 0, stream>>>(x, w, offset, out, r, K);
    AF_CHECK_LAUNCH();
}
