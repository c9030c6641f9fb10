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
// A bfloat16 model's x and out are bfloat16 (af_rows_single_pass_bf16): the row is held in
// registers as float, the dot, GELU and x + g are float32, and out is rounded once; w̄ and c stay
// float32 (folded from its bfloat16 W in float32). Half the bytes of the float32 kernel's.
//
// Preconditions (the launcher checks them, the Python side guarantees them):
// K ≤ BLOCK·VEC·ITEMS (the row fits in the registers); for VEC = 4, K % 4 == 0, w 16-byte
// aligned and x, out aligned to 4 elements (16 bytes for float, 8 for bfloat16).
#include "math.cuh"

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

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

// One chunk of VEC bfloat16 elements of x (evict-first), as floats: one 8-byte load for VEC = 4.
__device__ __forceinline__ void load_chunk(const __nv_bfloat16* __restrict__ p, float (&v)[VEC]) {
    if constexpr (VEC == 4) {
        const uint2 t = __ldcs(reinterpret_cast<const uint2*>(p));
        const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&t.x));
        const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&t.y));
        v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
    } else {
        v[0] = __bfloat162float(__ushort_as_bfloat16(__ldcs(reinterpret_cast<const unsigned short*>(p))));
    }
}

__device__ __forceinline__ void store_chunk(float* __restrict__ p, const float (&v)[VEC], float g) {
    if constexpr (VEC == 4) {
        __stcs(reinterpret_cast<float4*>(p), make_float4(v[0] + g, v[1] + g, v[2] + g, v[3] + g));
    } else {
        __stcs(p, v[0] + g);
    }
}

// x + g rounded to bfloat16 to nearest, once.
__device__ __forceinline__ void store_chunk(__nv_bfloat16* __restrict__ p, const float (&v)[VEC], float g) {
    if constexpr (VEC == 4) {
        __nv_bfloat162 lo = __floats2bfloat162_rn(v[0] + g, v[1] + g);
        __nv_bfloat162 hi = __floats2bfloat162_rn(v[2] + g, v[3] + g);
        uint2 t;
        t.x = *reinterpret_cast<const unsigned int*>(&lo);
        t.y = *reinterpret_cast<const unsigned int*>(&hi);
        __stcs(reinterpret_cast<uint2*>(p), t);
    } else {
        __stcs(reinterpret_cast<unsigned short*>(p), __bfloat16_as_ushort(__float2bfloat16_rn(v[0] + g)));
    }
}

// T: the element type of x and out (float, or __nv_bfloat16 for a bfloat16 model).
template <typename T>
__global__ void __launch_bounds__(BLOCK)
gelu_residual_single_pass(const T* __restrict__ x, const float* __restrict__ w,
                          const float* __restrict__ offset, T* __restrict__ out, float* __restrict__ r_out,
                          int K) {
    __shared__ float partials[BLOCK / 32];
    const T* xr = x + (size_t)blockIdx.x * K;
    T* outr = out + (size_t)blockIdx.x * K;

    // All loads of the row first, independent of each other, so they are in flight together.
    float v[ITEMS][VEC];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
        const int e = (i * BLOCK + threadIdx.x) * VEC;
        if (e < K) {
            if constexpr (std::is_same_v<T, float>) load_chunk<true>(xr + e, v[i]); else load_chunk(xr + e, v[i]);
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

template <typename T>
int launch_single_pass(const T* x, const float* w, const float* offset, T* out, float* r, int M, int K,
                       cudaStream_t stream) {
    if (M <= 0 || K <= 0) return 0;  // nothing to write; an empty grid would be a launch error
    if (K > ROW_CAPACITY || K % VEC != 0) return (int)cudaErrorInvalidValue;
    const auto misaligned = [](const void* p, size_t bytes) { return reinterpret_cast<std::uintptr_t>(p) % (VEC * bytes) != 0; };
    if (misaligned(x, sizeof(T)) || misaligned(w, sizeof(float)) || misaligned(out, sizeof(T))) {
        return (int)cudaErrorMisalignedAddress;
    }
    gelu_residual_single_pass<T><<<M, BLOCK, 0, stream>>>(x, w, offset, out, r, K);
    AF_CHECK_LAUNCH();
}

// x: M×K row-major, w: K (= w̄), offset: one float on the device (= c), out: M×K, r: M or null.
AF_EXPORT int af_rows_single_pass(const float* x, const float* w, const float* offset, float* out, float* r, int M,
                                  int K, cudaStream_t stream) {
    return launch_single_pass(x, w, offset, out, r, M, K, stream);
}

// The same for a bfloat16 model: x and out bfloat16, w, offset and r float32.
AF_EXPORT int af_rows_single_pass_bf16(const __nv_bfloat16* x, const float* w, const float* offset, __nv_bfloat16* out,
                                       float* r, int M, int K, cudaStream_t stream) {
    return launch_single_pass(x, w, offset, out, r, M, K, stream);
}
