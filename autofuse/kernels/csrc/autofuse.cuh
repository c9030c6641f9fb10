// autofuse.cuh: the one header every kernel translation unit includes.
//
// Kernel sources include no torch headers, so one configuration compiles in about a
// second (a torch-header extension took ~40 s cold on the H200 machine, DESIGN.md).
// Host launchers are `AF_EXPORT int name(raw pointers, ints, floats, cudaStream_t)`,
// loaded with ctypes and called on torch's current stream; they return a cudaError_t
// as int, which autofuse.kernels.build.check_status turns into an exception.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

// Default visibility so ctypes finds the symbol even if the build hides others;
// C linkage so the name is not mangled.
#define AF_EXPORT extern "C" __attribute__((visibility("default")))

// Every launcher ends with this: a bad launch configuration surfaces here, while an
// error inside the kernel surfaces at the next synchronising call.
#define AF_CHECK_LAUNCH() return (int)cudaGetLastError()

// A plain (non-inline) definition on purpose: autofuse builds one .so from exactly one
// .cu, so this header is included by exactly one translation unit per library, which
// therefore holds exactly one af_error_string. Including it from two .cu files linked
// into one library would be a duplicate-symbol error.
AF_EXPORT const char* af_error_string(int code) {
    return cudaGetErrorString(static_cast<cudaError_t>(code));
}

// Grid sizes, on the host (launchers) and the device (tile loops) alike.
template <typename T>
__host__ __device__ constexpr T af_ceil_div(T a, T b) {
    return (a + b - 1) / b;
}

// Warp reductions by butterfly shuffles: every lane ends with the result, so no
// broadcast is needed. All 32 lanes of the warp must call them (full mask).
__device__ __forceinline__ float af_warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

__device__ __forceinline__ float af_warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

namespace af_detail {
struct Sum {
    static __device__ __forceinline__ float identity() { return 0.0f; }
    static __device__ __forceinline__ float warp(float v) { return af_warp_sum(v); }
};
struct Max {
    static __device__ __forceinline__ float identity() { return -INFINITY; }
    static __device__ __forceinline__ float warp(float v) { return af_warp_max(v); }
};

// Reduce over a 1-D block of THREADS threads (blockDim.x == THREADS), every thread
// calling with its value; smem holds THREADS/32 floats. Each warp reduces the per-warp
// partials itself, so all threads get the result without a second broadcast barrier.
// The closing barrier lets the caller reuse smem at once (for example a max, then a sum
// in a softmax): without it a fast warp could overwrite a partial a slow warp still reads.
template <int THREADS, typename Op>
__device__ __forceinline__ float block_reduce(float v, float* smem) {
    static_assert(THREADS % 32 == 0 && THREADS >= 32 && THREADS <= 1024,
                  "THREADS must be a multiple of 32 in [32, 1024]");
    constexpr int WARPS = THREADS / 32;
    v = Op::warp(v);
    if constexpr (WARPS == 1) {
        return v;
    } else {
        const int lane = threadIdx.x & 31;
        const int warp = threadIdx.x >> 5;
        if (lane == 0) smem[warp] = v;
        __syncthreads();
        v = Op::warp(lane < WARPS ? smem[lane] : Op::identity());
        __syncthreads();
        return v;
    }
}
}  // namespace af_detail

template <int THREADS>
__device__ __forceinline__ float af_block_sum(float v, float* smem) {
    return af_detail::block_reduce<THREADS, af_detail::Sum>(v, smem);
}

template <int THREADS>
__device__ __forceinline__ float af_block_max(float v, float* smem) {
    return af_detail::block_reduce<THREADS, af_detail::Max>(v, smem);
}
