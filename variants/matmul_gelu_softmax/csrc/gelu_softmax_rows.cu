// matmul_gelu_softmax, cuBLAS + fused epilogue: y = x·Wᵀ (+ b) comes from cuBLAS (through
// torch), float32 or, under bf16, bfloat16 (the GEMM's own output type: half the bytes to read
// back); this one kernel does everything after it, one block of BLOCK threads per row, and
// writes the float32 result (in place when y is float32). The bias comes here when cuBLAS did
// not add it (bias != nullptr: the bf16 GEMM has no free bias epilogue).
// A bfloat16 model (out_bf16): y is linear's own bfloat16 output, bias included, and the
// kernel rounds where the model's bfloat16 reference stores a tensor: gelu(y) is rounded to
// bfloat16 before the softmax reads it, and the softmax is written in bfloat16 (float32
// inside, as torch's). So the output is the reference's up to the order of the row's sum.
// That rounded gelu is a function of y's 16 bits: on many rows, a table gives it.
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
#include "bf16_table.cuh"
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

// The rest of a resident row once v holds its gelu values, m their max over this thread and nan
// whether one was NaN: the block's max, v ← exp(v − max) and its sum, then v/Σ written to the
// row of out. Thread t holds piece k, elements [(k·BLOCK + t)·V, +V), where it starts before N.
template <int CHUNKS, int V, typename OutT>
__device__ __forceinline__ void softmax_resident(float (&v)[CHUNKS * V], float m, bool nan, OutT* out, int N,
                                                 float* red) {
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
            af_store_floats<V>(out + c, &v[k * V]);
        }
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
    softmax_resident<CHUNKS, V>(v, m, nan, out + base, N, red);
}

// A bfloat16 model's gelu(y), rounded as the reference stores it, by table (bf16_table.cuh):
// |y| in [2^-12, 16), both signs, 8 KB; outside it (|y| < 2^-12, where gelu is about y/2, and
// |y| ≥ 16, where it is y or −0) the lookup computes it. Every block stages the table, which
// costs more than it saves on few rows: 1024×8192 on an H200, block 256 × 32 items, 16.1 µs
// against 19.7 (Nsight Compute: 7.9 million warp instructions against 12.6); 512 rows 10.5
// against 12.0, 200 rows 7.5 against 8.1, but 100 rows 6.7 against 6.3 and 37 rows 6.6 against
// 6.2. Hence TABLE_ROWS. (22's row kernel did not gain from one: see its source.)
using GeluTable = Bf16Table<127 - 12, 127 + 4>;
constexpr int TABLE_ROWS = 160;  // from this many rows on
__device__ uint4 gelu_table[GeluTable::SIZE / 8];
struct Gelu {
    __device__ float operator()(float v) const { return af_gelu(v); }
};

// gelu_softmax_resident for a bfloat16 model's whole 16-byte rows: the same steps, gelu by
// table. Thread t holds pieces (k·BLOCK + t) as loaded, 8 bfloat16 values each.
template <int CHUNKS>
__global__ void __launch_bounds__(BLOCK)
gelu_softmax_resident_bf16(const __nv_bfloat16* __restrict__ y, __nv_bfloat16* __restrict__ out, int N) {
    __shared__ float red[BLOCK / 32];
    __shared__ uint4 table[GeluTable::SIZE / 8];
    const uint4* row = reinterpret_cast<const uint4*>(y + (size_t)blockIdx.x * N);
    const int n_vec = N / 8;
    uint4 q[CHUNKS];
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
        const int i = k * BLOCK + threadIdx.x;
        if (i < n_vec) q[k] = row[i];
    }
    GeluTable::stage(gelu_table, table);
    __syncthreads();
    const auto* lookup = reinterpret_cast<const unsigned short*>(table);
    float v[8 * CHUNKS];
    float m = -INFINITY;
    bool nan = false;  // fmaxf drops a NaN
#pragma unroll
    for (int k = 0; k < CHUNKS; ++k) {
        if (k * BLOCK + (int)threadIdx.x < n_vec) {
            const unsigned words[4] = {q[k].x, q[k].y, q[k].z, q[k].w};
            bool miss = false;
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                v[8 * k + 2 * w] = GeluTable::lookup(words[w] & 0xffffu, lookup, miss);
                v[8 * k + 2 * w + 1] = GeluTable::lookup(words[w] >> 16, lookup, miss);
            }
            if (miss) {  // rare: a y the table does not hold (only a computed gelu can be NaN)
#pragma unroll
                for (int w = 0; w < 4; ++w) {
                    v[8 * k + 2 * w] = GeluTable::apply(words[w] & 0xffffu, lookup, Gelu());
                    v[8 * k + 2 * w + 1] = GeluTable::apply(words[w] >> 16, lookup, Gelu());
                }
#pragma unroll
                for (int i = 0; i < 8; ++i) nan |= isnan(v[8 * k + i]);
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) m = fmaxf(m, v[8 * k + i]);
        }
    }
    softmax_resident<CHUNKS, 8>(v, m, nan, out + (size_t)blockIdx.x * N, N, red);
}

template <typename T, typename OutT>
int launch_rows(const T* y, const float* bias, OutT* out, int M, int N, cudaStream_t stream) {
    constexpr int W = af_vec_width<T>;
    if constexpr (ITEMS > 0) {
        if (N <= BLOCK * ITEMS) {
            if constexpr (sizeof(OutT) == 2) {  // a bfloat16 model's
                if (M >= TABLE_ROWS && N % 8 == 0 && af_aligned16(y, out)) {
                    if (const int err = af_fill_once<GeluTable>(gelu_table, Gelu(), stream)) return err;
                    gelu_softmax_resident_bf16<ITEMS / 8><<<M, BLOCK, 0, stream>>>(y, out, N);
                    AF_CHECK_LAUNCH();
                }
            }
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

// out = bfloat16(gelu(x)) for n bfloat16 values, by the table (by_table) or computed: for tests.
AF_EXPORT int af_gelu_bf16(const void* x, void* out, int n, int by_table, cudaStream_t stream) {
    return af_apply_bf16<GeluTable>(gelu_table, Gelu(), x, out, n, by_table, stream);
}
