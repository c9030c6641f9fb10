// Reading a row of float or bfloat16 logits as floats, 16 bytes per load where alignment allows.
//
// The row epilogues run after a cuBLAS GEMM whose result is float32 (fp32, tf32) or bfloat16
// (bf16: the GEMM's own output type, half the bytes to read back). Element type T is a
// template argument of the kernel; V is how many consecutive elements one load takes:
// af_vec_width<T> (one 16-byte load) when the row length and the pointers allow, else 1.
#pragma once
#include "autofuse.cuh"

#include <cuda_bf16.h>

#include <cstdint>

template <typename T>
constexpr int af_vec_width = 16 / (int)sizeof(T);

__device__ __forceinline__ float af_to_float(float v) { return v; }
__device__ __forceinline__ float af_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// v converted to an output element of type T (bfloat16: rounded to nearest even, as torch stores).
template <typename T>
__device__ __forceinline__ T af_from_float(float v) {
    if constexpr (sizeof(T) == 2) return __float2bfloat16_rn(v);
    else return v;
}

// v as a tensor of element type T holds it: a bfloat16 model's epilogue rounds where its
// bfloat16 reference stores an intermediate tensor, and goes on from the stored value.
template <typename T>
__device__ __forceinline__ float af_stored_as(float v) {
    return af_to_float(af_from_float<T>(v));
}

// bfloat16(v) as a float (rounded to nearest even).
__device__ __forceinline__ float af_round_bf16(float v) { return af_stored_as<__nv_bfloat16>(v); }

// out[0..V) = p[0..V) as floats; p is 16-byte aligned when V > 1.
template <int V, typename T>
__device__ __forceinline__ void af_load_floats(const T* __restrict__ p, float* out) {
    if constexpr (V == 1) {
        out[0] = af_to_float(p[0]);
    } else if constexpr (sizeof(T) == 4) {
        static_assert(V % 4 == 0, "float rows load 4 at a time");
#pragma unroll
        for (int i = 0; i < V / 4; ++i) {
            const float4 q = reinterpret_cast<const float4*>(p)[i];
            out[4 * i] = q.x, out[4 * i + 1] = q.y, out[4 * i + 2] = q.z, out[4 * i + 3] = q.w;
        }
    } else {
        static_assert(sizeof(T) == 2 && V % 8 == 0, "bfloat16 rows load 8 at a time");
#pragma unroll
        for (int i = 0; i < V / 8; ++i) {
            const uint4 q = reinterpret_cast<const uint4*>(p)[i];
            const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&q);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float2 f = __bfloat1622float2(pairs[k]);
                out[8 * i + 2 * k] = f.x, out[8 * i + 2 * k + 1] = f.y;
            }
        }
    }
}

// p[0..V) = v[0..V); p is 16-byte aligned when V > 1 (V is then a multiple of 4).
template <int V>
__device__ __forceinline__ void af_store_floats(float* __restrict__ p, const float* v) {
    if constexpr (V == 1) {
        p[0] = v[0];
    } else {
        static_assert(V % 4 == 0, "float stores go 4 at a time");
#pragma unroll
        for (int i = 0; i < V / 4; ++i) reinterpret_cast<float4*>(p)[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
    }
}

// p[0..V) = v[0..V) rounded to bfloat16; p is 16-byte aligned when V > 1 (V is then a multiple of 8).
template <int V>
__device__ __forceinline__ void af_store_floats(__nv_bfloat16* __restrict__ p, const float* v) {
    if constexpr (V == 1) {
        p[0] = __float2bfloat16_rn(v[0]);
    } else {
        static_assert(V % 8 == 0, "bfloat16 stores go 8 at a time");
#pragma unroll
        for (int i = 0; i < V / 8; ++i) {
            uint4 q;
            __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&q);
#pragma unroll
            for (int k = 0; k < 4; ++k) pairs[k] = __floats2bfloat162_rn(v[8 * i + 2 * k], v[8 * i + 2 * k + 1]);
            reinterpret_cast<uint4*>(p)[i] = q;
        }
    }
}

// True when every non-null pointer is 16-byte aligned: rows of a length that is a multiple of
// the vector width then start aligned too.
inline bool af_aligned16(const void* a, const void* b = nullptr, const void* c = nullptr) {
    const auto misaligned = [](const void* p) { return p != nullptr && reinterpret_cast<std::uintptr_t>(p) % 16 != 0; };
    return !misaligned(a) && !misaligned(b) && !misaligned(c);
}
