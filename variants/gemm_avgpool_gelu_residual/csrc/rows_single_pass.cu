// gemm_avgpool_gelu_residual, single pass: out = x + gelu(x·w̄ + c), w̄ = mean(W, 0) and
// c = mean(b) − mean(subtract) folded on the host.
//
// The memory floor is one read of x and one write of out (128 MB at 2048×8192). One block of
// BLOCK threads per row reads the row ONCE into registers: thread t holds ITEMS chunks of
// VEC floats, chunk i covering elements [(i·BLOCK + t)·VEC, +VEC), so for every i the block
// reads one contiguous, coalesced span (float4 loads when VEC = 4). It dots them with w̄
// (K·4 bytes, 32 KB at K = 8192: L2- and mostly L1-resident, shared by every row), reduces
// over the block, applies GELU, and writes x + g from the same registers; r = x·w̄ + c goes to
// r_out when it is not null (the backward's dr = gelu'(r)·Σg then reads g alone, not x again). x is loaded and
// out stored with the streaming (evict-first) hints: neither is touched again, and w̄
// should keep its cache lines.
//
// Preconditions (the launcher checks them, the Python side guarantees them):
// K ≤ BLOCK·VEC·ITEMS (the row fits in the registers); for VEC = 4, K % 4 == 0 and x, w,
// out 16-byte aligned.
#include "math.cuh"

#include <cstdint>

#ifndef AF_BLOCK
#define AF_BLOCK 256
#endif
#ifndef AF_VEC
#define AF_VEC 4
#endif
#ifndef AF_ITEMS
#define AF_ITEMS 8
#endif
constexpr int BLOCK = AF_BLOCK;
constexpr int VEC = AF_VEC;
constexpr int ITEMS = AF_ITEMS;
constexpr int ROW_CAPACITY = BLOCK * VEC * ITEMS;
static_assert(BLOCK % 32 == 0 && BLOCK >= 32 && BLOCK <= 1024, "AF_BLOCK must be a multiple of 32 in [32, 1024]");
static_assert(VEC == 1 || VEC == 4, "AF_VEC must be 1 or 4");
static_assert(ITEMS >= 1 && ITEMS * VEC <= 64, "AF_ITEMS·AF_VEC floats per thread must be in [1, 64]");

// One chunk of VEC floats: STREAM = true for x (evict-first), false for w̄ (read-only cache).
template <bool STREAM>
__device__ __forceinline__ void load_chunk(const float* __restrict__ p, float (&v)[VEC]) {
    if constexpr (VEC == 4) {
        const float4* q = reinterpret_cast<const float4*>(p);
        float4 t;
        if constexpr (STREAM) t = __ldcs(q); else t = __ldg(q);
        v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
    } else {
        if constexpr (STREAM) v[0] = __ldcs(p); else v[0] = __ldg(p);
    }
}

__device__ __forceinline__ void store_chunk(float* __restrict__ p, const float (&v)[VEC], float g) {
    if constexpr (VEC == 4) {
        __stcs(reinterpret_cast<float4*>(p), make_float4(v[0] + g, v[1] + g, v[2] + g, v[3] + g));
    } else {
        __stcs(p, v[0] + g);
    }
}

__global__ void __launch_bounds__(BLOCK)
gelu_residual_single_pass(const float* __restrict__ x, const float* __restrict__ w,
                          const float* __restrict__ offset, float* __restrict__ out, float* __restrict__ r_out,
                          int K) {
    __shared__ float partials[BLOCK / 32];
    const float* xr = x + (size_t)blockIdx.x * K;
    float* outr = out + (size_t)blockIdx.x * K;

    // All loads of the row first, independent of each other, so they are in flight together.
    float v[ITEMS][VEC];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int e = (i * BLOCK + threadIdx.x) * VEC;
        if (e < K) {
            load_chunk<true>(xr + e, v[i]);
        } else {
#pragma unroll
            for (int j = 0; j < VEC; ++j) v[i][j] = 0.f;
        }
    }

    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int e = (i * BLOCK + threadIdx.x) * VEC;
        if (e < K) {
            float wv[VEC];
            load_chunk<false>(w + e, wv);
#pragma unroll
            for (int j = 0; j < VEC; ++j) acc = fmaf(v[i][j], wv[j], acc);
        }
    }
    const float r = af_block_sum<BLOCK>(acc, partials) + __ldg(offset);
    if (r_out != nullptr && threadIdx.x == 0) r_out[blockIdx.x] = r;
    const float g = af_gelu(r);

#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int e = (i * BLOCK + threadIdx.x) * VEC;
        if (e < K) store_chunk(outr + e, v[i], g);
    }
}

// Row capacity of this build, so the host can tell which in_features it serves.
AF_EXPORT int af_row_capacity() { return ROW_CAPACITY; }

// x: M×K row-major, w: K (= w̄), offset: one float on the device (= c), out: M×K, r: M or null.
AF_EXPORT int af_rows_single_pass(const float* x, const float* w, const float* offset, float* out, float* r, int M,
                                  int K, cudaStream_t stream) {
    if (M <= 0 || K <= 0) return 0;  // nothing to write; an empty grid would be a launch error
    if (K > ROW_CAPACITY || K % VEC != 0) return (int)cudaErrorInvalidValue;
    const auto misaligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % (VEC * sizeof(float)) != 0; };
    if (misaligned(x) || misaligned(w) || misaligned(out)) return (int)cudaErrorMisalignedAddress;
    gelu_residual_single_pass<<<M, BLOCK, 0, stream>>>(x, w, offset, out, r, K);
    AF_CHECK_LAUNCH();
}
