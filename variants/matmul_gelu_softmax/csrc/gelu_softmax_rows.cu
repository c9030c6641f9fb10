// matmul_gelu_softmax, cuBLAS + fused epilogue: y = x·Wᵀ (+ b) comes from cuBLAS (through
// torch), float32 or, under bf16, bfloat16 (the GEMM's own output type: half the bytes to read
// back); this one kernel does everything after it, one block of BLOCK threads per row, and
// writes the float32 result (in place when y is float32). The bias comes here when cuBLAS did
// not add it (bias != nullptr: the bf16 GEMM has no free bias epilogue).
// A bfloat16 model (out_bf16): y is linear's own bfloat16 output, bias included, and the
// kernel rounds where the model's bfloat16 reference stores a tensor: gelu(y) is rounded to
// bfloat16 before the softmax reads it, and the softmax is written in bfloat16 (float32
// inside, as torch's). So the output is the reference's up to the order of the row's sum.
//
// ITEMS > 0, rows of at most BLOCK·ITEMS: the row stays in registers, ITEMS values a thread,
// loaded 16 bytes at a time: one read of y (every load issued before any is used), the block's
// max, then Σ exp(g − max) with the exponentials kept, and one write. A softmax over 8192
// columns then costs one read and one write of the logits (the streaming kernel below re-read
// its own output and issued one 4-byte load at a time).
// ITEMS = 0, or longer rows: stream the row twice, writing gelu(y) and keeping the running
// (max, Σ exp) pair, then rescaling in place from L2 (a row is at most a few hundred KB).
//
// NaN and ±inf as torch.softmax: a NaN in a row makes the whole row NaN, so does a +inf
// (inf − inf in the shifted exponent).
#include "math.cuh"
#include "rows.cuh"

#ifndef AF_BLOCK
#define AF_BLOCK 256
#endif
#ifndef AF_ITEMS
#define AF_ITEMS 0
#endif
constexpr int BLOCK = AF_BLOCK;
constexpr int ITEMS = AF_ITEMS;
static_assert(BLOCK % 32 == 0 && BLOCK >= 32 && BLOCK <= 1024, "AF_BLOCK must be a multiple of 32 in [32, 1024]");
static_assert(ITEMS % 8 == 0 && ITEMS >= 0 && ITEMS <= 32, "AF_ITEMS is 0, 8, 16, 24 or 32");

template <typename T>
__global__ void __launch_bounds__(BLOCK) gelu_softmax_stream(const T* y, const float* bias, float* out, int N) {
    const size_t base = (size_t)blockIdx.x * N;
    float m = -INFINITY, s = 0.f;
    for (int c = threadIdx.x; c < N; c += BLOCK) {
        const float v = af_to_float(y[base + c]);
        const float g = af_gelu(bias ? v + bias[c] : v);
        out[base + c] = g;
        af_lse_push(m, s, g);
    }
    af_lse_reduce_block<BLOCK>(m, s);
    const float inv = 1.f / s;
    for (int c = threadIdx.x; c < N; c += BLOCK) out[base + c] = expf(out[base + c] - m) * inv;
}

// A bfloat16 model's streaming rows: gelu(y) rounded as the reference stores it, computed again
// from y on the second pass (from L2) rather than stored and re-read; V elements a load, 32
// registers a thread (sm_90). The resident kernel below won the default shape's tune.
template <int V>
__global__ void __launch_bounds__(BLOCK) gelu_softmax_stream_bf16(const __nv_bfloat16* __restrict__ y,
                                                                  __nv_bfloat16* __restrict__ out, int N) {
    using bf16 = __nv_bfloat16;
    const size_t base = (size_t)blockIdx.x * N;
    float m = -INFINITY, s = 0.f;
    for (int c = threadIdx.x * V; c < N; c += BLOCK * V) {
        float v[V];
        af_load_floats<V>(y + base + c, v);
#pragma unroll
        for (int i = 0; i < V; ++i) af_lse_push(m, s, af_stored_as<bf16>(af_gelu(v[i])));
    }
    af_lse_reduce_block<BLOCK>(m, s);
    const float inv = 1.f / s;
    for (int c = threadIdx.x * V; c < N; c += BLOCK * V) {
        float v[V];
        af_load_floats<V>(y + base + c, v);
#pragma unroll
        for (int i = 0; i < V; ++i) v[i] = expf(af_stored_as<bf16>(af_gelu(v[i])) - m) * inv;
        af_store_floats<V>(out + base + c, v);
    }
}

// Thread t holds elements [(k·BLOCK + t)·V, +V) for k < ITEMS/V: each load instruction of a
// warp reads consecutive 16-byte pieces. V > 1 only when N % V == 0 and the pointers are
// 16-byte aligned (the launcher checks), so a piece is either wholly in the row or wholly out.
// y and out may be the same array (in place): each thread writes only what it read.
template <typename T, typename OutT, int V>
__global__ void __launch_bounds__(BLOCK) gelu_softmax_resident(const T* y, const float* __restrict__ bias, OutT* out,
                                                               int N) {
    constexpr int CHUNKS = ITEMS / V;
    __shared__ float red[BLOCK / 32];
    const size_t base = (size_t)blockIdx.x * N;
    float v[ITEMS];
    float m = -INFINITY;
    bool nan = false;
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
        const int c = (k * BLOCK + threadIdx.x) * V;
        if (c < N) af_load_floats<V>(y + base + c, &v[k * V]);
    }
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
        const int c = (k * BLOCK + threadIdx.x) * V;
        if (c < N) {
            float b[V];
            if (bias) af_load_floats<V>(bias + c, b);
#pragma unroll
            for (int i = 0; i < V; ++i) {
                const float g = af_stored_as<OutT>(af_gelu(bias ? v[k * V + i] + b[i] : v[k * V + i]));
                v[k * V + i] = g;
                nan |= isnan(g);
                m = fmaxf(m, g);
            }
        }
    }
    m = af_block_max<BLOCK>(m, red);
    if (__syncthreads_or(nan)) m = NAN;  // fmaxf dropped it; torch's softmax row is all NaN
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
        const int c = (k * BLOCK + threadIdx.x) * V;
        if (c < N) {
#pragma unroll
            for (int i = 0; i < V; ++i) {
                v[k * V + i] = expf(v[k * V + i] - m);
                s += v[k * V + i];
            }
        }
    }
    const float inv = 1.f / af_block_sum<BLOCK>(s, red);
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
        const int c = (k * BLOCK + threadIdx.x) * V;
        if (c < N) {
#pragma unroll
            for (int i = 0; i < V; ++i) v[k * V + i] *= inv;
            af_store_floats<V>(out + base + c, &v[k * V]);
        }
    }
}

template <typename T, typename OutT>
int launch_rows(const T* y, const float* bias, OutT* out, int M, int N, cudaStream_t stream) {
    constexpr int W = af_vec_width<T>;
    if constexpr (ITEMS > 0) {
        if (N <= BLOCK * ITEMS) {
            if (N % W == 0 && af_aligned16(y, bias, out)) {
                gelu_softmax_resident<T, OutT, W><<<M, BLOCK, 0, stream>>>(y, bias, out, N);
            } else {
                gelu_softmax_resident<T, OutT, 1><<<M, BLOCK, 0, stream>>>(y, bias, out, N);
            }
            AF_CHECK_LAUNCH();
        }
    }
    if constexpr (sizeof(OutT) == 2) {  // a bfloat16 model's: y bfloat16, the bias in it
        if (N % 8 == 0 && af_aligned16(y, out)) {
            gelu_softmax_stream_bf16<8><<<M, BLOCK, 0, stream>>>(y, out, N);
        } else {
            gelu_softmax_stream_bf16<1><<<M, BLOCK, 0, stream>>>(y, out, N);
        }
    } else {
        gelu_softmax_stream<T><<<M, BLOCK, 0, stream>>>(y, bias, out, N);
    }
    AF_CHECK_LAUNCH();
}

// y: M×N float32 (y_bf16 == 0) or bfloat16; out: M×N float32, may be y itself when y is float32,
// or (out_bf16, a bfloat16 model's: y bfloat16 with the bias in it) M×N bfloat16, never y.
AF_EXPORT int af_gelu_softmax_rows(const void* y, int y_bf16, const float* bias, void* out, int out_bf16, int M, int N,
                                   cudaStream_t stream) {
    if (M == 0) return 0;  // an empty batch: nothing to launch (a 0-block grid is a launch error)
    const auto* y16 = static_cast<const __nv_bfloat16*>(y);
    if (out_bf16) {
        if (!y_bf16 || bias || out == y) return (int)cudaErrorInvalidValue;
        return launch_rows(y16, bias, static_cast<__nv_bfloat16*>(out), M, N, stream);
    }
    if (y_bf16) return launch_rows(y16, bias, static_cast<float*>(out), M, N, stream);
    return launch_rows(static_cast<const float*>(y), bias, static_cast<float*>(out), M, N, stream);
}
