// gemm_avgpool_gelu_residual, cuBLAS + fused epilogue: z = c + x·w̄ comes from one cuBLAS GEMV
// (torch.addmv on the host), and this one elementwise kernel writes out = x + gelu(z[row]).
//
// 2-D grid: blockIdx.x covers a span of BLOCK·VEC columns, blockIdx.y walks the rows (striding
// by gridDim.y, so more than 65535 rows work). VEC = 4 (float4 loads and stores) whenever
// K % 4 == 0 and x and out are 16-byte aligned, which the launcher checks at run time; else
// scalar. GELU is recomputed per thread and row: one erff per VEC elements, against a
// memory-bound 8 bytes moved per element.
#include "math.cuh"

#include <cstdint>

#ifndef AF_BLOCK
#define AF_BLOCK 256
#endif
constexpr int BLOCK = AF_BLOCK;
constexpr int MAX_GRID_Y = 65535;
static_assert(BLOCK % 32 == 0 && BLOCK >= 32 && BLOCK <= 1024, "AF_BLOCK must be a multiple of 32 in [32, 1024]");

template <int VEC>
__global__ void __launch_bounds__(BLOCK)
gelu_residual_rows(const float* __restrict__ x, const float* __restrict__ z, float* __restrict__ out, int M, int K) {
    const long long col = ((long long)blockIdx.x * BLOCK + threadIdx.x) * VEC;
    if (col >= K) return;  // no barriers below, so an early exit is safe
    for (int row = blockIdx.y; row < M; row += gridDim.y) {
        const float g = af_gelu(__ldg(z + row));
        const size_t i = (size_t)row * K + col;
        if constexpr (VEC == 4) {
            float4 t = __ldcs(reinterpret_cast<const float4*>(x + i));
            t.x += g, t.y += g, t.z += g, t.w += g;
            __stcs(reinterpret_cast<float4*>(out + i), t);
        } else {
            __stcs(out + i, __ldcs(x + i) + g);
        }
    }
}

template <int VEC>
static int launch(const float* x, const float* z, float* out, int M, int K, cudaStream_t stream) {
    const dim3 grid(af_ceil_div(af_ceil_div(K, VEC), BLOCK), M < MAX_GRID_Y ? M : MAX_GRID_Y);
    gelu_residual_rows<VEC><<<grid, BLOCK, 0, stream>>>(x, z, out, M, K);
    AF_CHECK_LAUNCH();
}

// x: M×K row-major, z: M (= c + x·w̄), out: M×K.
AF_EXPORT int af_gelu_residual(const float* x, const float* z, float* out, int M, int K, cudaStream_t stream) {
    if (M <= 0 || K <= 0) return 0;  // nothing to write; an empty grid would be a launch error
    const bool aligned = reinterpret_cast<std::uintptr_t>(x) % 16 == 0 && reinterpret_cast<std::uintptr_t>(out) % 16 == 0;
    return K % 4 == 0 && aligned ? launch<4>(x, z, out, M, K, stream) : launch<1>(x, z, out, M, K, stream);
}
