// A unary function of a bfloat16 value, rounded to bfloat16, read from a table instead of
// computed: a bfloat16 model's epilogue often applies f to a tensor the reference stored in
// bfloat16 and rounds f's float32 result as the reference stores it, so the result is a
// function of the input's 16 bits. 99's row kernel was bound by issue slots, and its gelu (erff)
// with the rounding took about 20 instructions an element against about 7 for a lookup.
//
// The table holds the inputs of both signs whose magnitude lies in [2^(EXP_LO-127),
// 2^(EXP_HI-127)), as bfloat16 bits; each entry is f computed on the device by the kernel's own
// function, once per process and device (af_fill_once), so a lookup returns exactly what
// computing it returns (a test compares all 65536 inputs). An input outside the range (zero,
// tiny, huge, inf, NaN) is computed as before.
#pragma once
#include "autofuse.cuh"

#include <cuda_bf16.h>

#include <mutex>

template <int EXP_LO, int EXP_HI>
struct Bf16Table {
    static_assert(0 < EXP_LO && EXP_LO < EXP_HI && EXP_HI < 255, "a range of exponents");
    static constexpr int SPAN = (EXP_HI - EXP_LO) * 128;  // entries of one sign
    static constexpr int SIZE = 2 * SPAN;                  // the positive ones, then the negative
    static constexpr unsigned FIRST = EXP_LO * 128;        // the magnitude bits of entry 0

    // The bfloat16 bits of entry i.
    __host__ __device__ static unsigned bits_of(int i) { return (i >= SPAN ? 0x8000u : 0u) + FIRST + i % SPAN; }

    // The entry of bfloat16 bits (the low 16 of bits; the rest zero), branch-free: bits the
    // table does not hold set miss and read an entry at their sign's edge instead (below FIRST,
    // the unsigned difference wraps to a large number).
    __device__ __forceinline__ static unsigned index(unsigned bits, bool& miss) {
        const unsigned at = (bits & 0x7fffu) - FIRST;
        miss |= at >= (unsigned)SPAN;
        return min(at, (unsigned)SPAN - 1) + (bits >> 15) * SPAN;
    }

    // f(x) rounded to bfloat16, as a float, from the table (staged in shared memory); valid
    // unless miss is set. Lookups leave no branch, so a thread keeps several in flight; the caller
    // tests miss once for a group of them and goes over the group again with apply if it is set.
    __device__ __forceinline__ static float lookup(unsigned bits, const unsigned short* table, bool& miss) {
        return __uint_as_float((unsigned)table[index(bits, miss)] << 16);
    }

    // f(x) rounded to bfloat16, as a float: the entry when the table holds x, else computed.
    template <typename F>
    __device__ __forceinline__ static float apply(unsigned bits, const unsigned short* table, F f) {
        bool miss = false;
        const float r = lookup(bits, table, miss);
        return miss ? __bfloat162float(__float2bfloat16_rn(f(__uint_as_float(bits << 16)))) : r;
    }

    // Copy the table from global to shared memory, 16 bytes a thread at a time; the caller
    // synchronises the block before reading it.
    __device__ __forceinline__ static void stage(const uint4* global, uint4* shared) {
        for (int i = threadIdx.x; i < SIZE / 8; i += blockDim.x) shared[i] = global[i];
    }
};

template <typename Table, typename F>
__global__ void af_fill_bf16_table(unsigned short* table, F f) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < Table::SIZE) {
        const float x = __uint_as_float(Table::bits_of(i) << 16);
        table[i] = __bfloat16_as_ushort(__float2bfloat16_rn(f(x)));
    }
}

// The host helpers below have internal linkage (an unnamed namespace): a static local of a
// template function with external linkage is one symbol across every library loaded in the
// process (GNU unique), so the second configuration's library saw its table as filled by the
// first's, and read zeros.
namespace {

// Fill the __device__ array `symbol` holding Table on the current device, once per process (per
// device); later calls return at once, before any other runtime call than cudaGetDevice: the row
// kernels read the symbol directly, so its address is looked up for the fill alone. The first
// fill waits for its kernel, so every stream sees a full table after it. Under stream capture the
// fill is captured instead (a captured graph fills the table before its own reads at each replay)
// and stays pending until a plain call makes it.
template <typename Table, typename F, typename Symbol>
int af_fill_once(const Symbol& symbol, F f, cudaStream_t stream) {
    constexpr int MAX_DEVICES = 64;
    static std::mutex lock;
    static bool filled[MAX_DEVICES] = {};
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return (int)err;
    if (device >= MAX_DEVICES) return (int)cudaErrorInvalidDevice;
    const std::lock_guard<std::mutex> guard(lock);
    if (filled[device]) return 0;
    void* table = nullptr;
    if ((err = cudaGetSymbolAddress(&table, symbol)) != cudaSuccess) return (int)err;
    af_fill_bf16_table<Table><<<af_ceil_div(Table::SIZE, 256), 256, 0, stream>>>(static_cast<unsigned short*>(table), f);
    if ((err = cudaGetLastError()) != cudaSuccess) return (int)err;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if ((err = cudaStreamIsCapturing(stream, &capture)) != cudaSuccess) return (int)err;
    if (capture != cudaStreamCaptureStatusNone) return 0;
    if ((err = cudaStreamSynchronize(stream)) != cudaSuccess) return (int)err;
    filled[device] = true;
    return 0;
}

template <typename Table, typename F>
__global__ void af_apply_bf16_table(const unsigned short* x, unsigned short* out, int n, const unsigned short* table,
                                    F f, bool by_table) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float r = by_table ? Table::apply(x[i], table, f) : f(__uint_as_float((unsigned)x[i] << 16));
    out[i] = __bfloat16_as_ushort(__float2bfloat16_rn(r));
}

// out = f(x) rounded to bfloat16 for n bfloat16 values, through the table (filled first) or
// computed: a test compares the two on every input (the export af_gelu_bf16).
template <typename Table, typename F, typename Symbol>
int af_apply_bf16(const Symbol& symbol, F f, const void* x, void* out, int n, int by_table, cudaStream_t stream) {
    if (n <= 0) return n == 0 ? 0 : (int)cudaErrorInvalidValue;
    int err = af_fill_once<Table>(symbol, f, stream);
    if (err) return err;
    void* table = nullptr;
    if ((err = (int)cudaGetSymbolAddress(&table, symbol))) return err;
    af_apply_bf16_table<Table><<<af_ceil_div(n, 256), 256, 0, stream>>>(static_cast<const unsigned short*>(x),
                                                                          static_cast<unsigned short*>(out), n,
                                                                          static_cast<const unsigned short*>(table),
                                                                          f, by_table != 0);
    AF_CHECK_LAUNCH();
}

}  // namespace
