// matmul_clamp_lse_mish, cuBLAS + fused epilogue: y = x·Wᵀ (+ b) comes from cuBLAS (through
// torch), float32 or, under bf16, bfloat16 (the GEMM's own output type: half the bytes to
// read); this one kernel does everything after it, one block of BLOCK threads per row, in
// one read of y (16-byte loads where the row length and pointers allow): the bias if cuBLAS
// did not add it (bias != nullptr: the bf16 GEMM has no free bias epilogue),
// v = clamp(t·y, lo, hi) with t = 2·scale_factor, the running (max, Σ exp) pair (max
// subtracted: no overflow at any clamp bound), then z·mish(z) into out[row].
//
// NaN and ±inf follow PyTorch (torch.clamp keeps a NaN, torch.logsumexp gives NaN for a row
// holding one, +inf for a row whose max is +inf, −inf for a row of −inf): see math.cuh.
//
// A bfloat16 model (af_clamp_lse_mish_rows_bf16): y is linear's own bfloat16 output, bias
// included, and the kernel rounds where the model's bfloat16 reference stores a tensor, so
// KernelBench's harness at bfloat16 finds the reference's output: v = clamp(2·bf16(y·s)), then
// torch's logsumexp of a bfloat16 row (m = max v; bf16(v − m), its exp and the row's float32
// sum each rounded; z = bf16(m + bf16(log Σ))), then bf16(z·bf16(mish(z))). Each term is
// rounded against the row's max, which one pass cannot know: the row is gone over twice (the
// second time from shared memory, where the first staged it, or from L2). The packed form below
// does the bfloat16 steps two elements an instruction. A tile-relative sum, rounded once, put 3
// of 1024 rows one bfloat16 step off z, and their outputs past the harness's tolerance (see the
// triton variant's lse_mish_finish_bf16).
#include "math.cuh"
#include "rows.cuh"

#include <cstring>

#ifndef AF_BLOCK
#define AF_BLOCK 256
#endif
constexpr int BLOCK = AF_BLOCK;
static_assert(BLOCK % 32 == 0 && BLOCK >= 32 && BLOCK <= 1024, "AF_BLOCK must be a multiple of 32 in [32, 1024]");
constexpr int UNROLL = 4;  // loads in flight per thread before their values are reduced

// z = logsumexp from the merged pair (m + log s, as torch's log(Σ) + max), then z·mish(z).
__device__ __forceinline__ float lse_mish(float m, float s) {
    const float z = isfinite(m) ? m + logf(s) : m;
    return z * af_mish(z);
}

// One row, V consecutive elements a load (V > 1 only when N % V == 0 and the pointers are
// 16-byte aligned, so a vector is wholly in the row). HAS_BIAS is a template argument so the
// fp32 path's inner loop carries no bias test.
template <typename T, int V, bool HAS_BIAS>
__device__ __forceinline__ void clamp_lse_mish_row(const T* __restrict__ y, const float* __restrict__ bias,
                                                   float* __restrict__ out, int N, float t, float lo, float hi) {
    constexpr int STEP = BLOCK * V;
    const T* r = y + (size_t)blockIdx.x * N;
    float m = -INFINITY, s = 0.f;
    int c = threadIdx.x * V;
    for (; c + (UNROLL - 1) * STEP < N; c += UNROLL * STEP) {
        float v[UNROLL * V];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) af_load_floats<V>(r + c + u * STEP, &v[u * V]);
        if constexpr (HAS_BIAS) {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                float b[V];
                af_load_floats<V>(bias + c + u * STEP, b);
#pragma unroll
                for (int i = 0; i < V; ++i) v[u * V + i] += b[i];
            }
        }
#pragma unroll
        for (int i = 0; i < UNROLL * V; ++i) af_lse_push(m, s, af_clamp(v[i] * t, lo, hi));
    }
    for (; c < N; c += STEP) {
        float v[V], b[V];
        af_load_floats<V>(r + c, v);
        if constexpr (HAS_BIAS) af_load_floats<V>(bias + c, b);
#pragma unroll
        for (int i = 0; i < V; ++i) af_lse_push(m, s, af_clamp((HAS_BIAS ? v[i] + b[i] : v[i]) * t, lo, hi));
    }
    af_lse_reduce_block<BLOCK>(m, s);
    if (threadIdx.x == 0) out[blockIdx.x] = lse_mish(m, s);
}

template <typename T, int V>
__global__ void __launch_bounds__(BLOCK)
clamp_lse_mish_rows(const T* __restrict__ y, const float* __restrict__ bias, float* __restrict__ out, int N,
                    float t, float lo, float hi) {
    if (bias) {
        clamp_lse_mish_row<T, V, true>(y, bias, out, N, t, lo, hi);
    } else {
        clamp_lse_mish_row<T, V, false>(y, bias, out, N, t, lo, hi);
    }
}

template <typename T>
int launch_rows(const T* y, const float* bias, float* out, float t, float lo, float hi, int M, int N,
                cudaStream_t stream) {
    constexpr int W = af_vec_width<T>;
    if (N % W == 0 && af_aligned16(y, bias)) {
        clamp_lse_mish_rows<T, W><<<M, BLOCK, 0, stream>>>(y, bias, out, N, t, lo, hi);
    } else {
        clamp_lse_mish_rows<T, 1><<<M, BLOCK, 0, stream>>>(y, bias, out, N, t, lo, hi);
    }
    AF_CHECK_LAUNCH();
}

// v = clamp(2·bf16(y·s), lo, hi) as the bfloat16 tensor the reference holds. Monotone in y
// (non-decreasing for s ≥ 0, non-increasing for s < 0): so a row's max v is that of its max or
// min y, and the first pass reads y without computing v.
__device__ __forceinline__ float clamped_bf16(float y, float s, float lo, float hi) {
    return af_round_bf16(af_clamp(af_round_bf16(y * s) * 2.f, lo, hi));
}

// bfloat16(a) and bfloat16(b) as floats, both from one packed conversion (F2FP): Hopper's
// conversions are slow, and at four single ones (F2F) an element this kernel was bound by them
// (21 µs for 1024 rows of 8192 on an H100, against 5.6 to read them).
__device__ __forceinline__ float2 round_bf16x2(float a, float b) {
    return __bfloat1622float2(__floats2bfloat162_rn(a, b));
}

// The second pass's terms bf16(exp(bf16(v − shift))) of two elements, with v as clamped_bf16
// computes it: clamping 2·bf16(y·s), itself a bfloat16 value, to bounds rounded to bfloat16 is
// rounding the clamped value (rounding is monotone). A NaN needs no test here: it made the row's
// max, hence shift and the sum, NaN in the first pass.
__device__ __forceinline__ float exp_terms2(float y0, float y1, float s, float blo, float bhi, float shift) {
    const float2 p = round_bf16x2(y0 * s, y1 * s);
    const float v0 = fminf(fmaxf(2.f * p.x, blo), bhi), v1 = fminf(fmaxf(2.f * p.y, blo), bhi);
    const float2 d = round_bf16x2(v0 - shift, v1 - shift);
    const float2 e = round_bf16x2(expf(d.x), expf(d.y));
    return e.x + e.y;
}

template <int V>
__global__ void __launch_bounds__(BLOCK)
clamp_lse_mish_rows_bf16(const __nv_bfloat16* __restrict__ y, __nv_bfloat16* __restrict__ out, int N, float s,
                         float lo, float hi) {
    __shared__ float red[BLOCK / 32];
    const __nv_bfloat16* r = y + (size_t)blockIdx.x * N;
    float y_max = -INFINITY, y_min = INFINITY;
    bool nan = false;
    for (int c = threadIdx.x * V; c < N; c += BLOCK * V) {
        float v[V];
        af_load_floats<V>(r + c, v);
#pragma unroll
        for (int i = 0; i < V; ++i) {
            nan |= isnan(v[i] * s);  // a NaN, or ±inf times a zero scale: torch.amax keeps it
            y_max = fmaxf(y_max, v[i]);
            y_min = fminf(y_min, v[i]);
        }
    }
    y_max = af_block_max<BLOCK>(y_max, red);
    y_min = -af_block_max<BLOCK>(-y_min, red);
    // A NaN scale or bound makes every v NaN through clamped_bf16 itself.
    const float m = __syncthreads_or(nan) ? NAN : clamped_bf16(s >= 0.f ? y_max : y_min, s, lo, hi);
    const float shift = isinf(m) ? 0.f : m;  // logsumexp's masked_fill of an infinite max
    const float blo = af_round_bf16(lo), bhi = af_round_bf16(hi);
    float sum = 0.f;
    for (int c = threadIdx.x * V; c < N; c += BLOCK * V) {
        float v[V];
        af_load_floats<V>(r + c, v);  // from L2: the first pass read it
        if constexpr (V % 2 == 0) {
#pragma unroll
            for (int i = 0; i < V; i += 2) sum += exp_terms2(v[i], v[i + 1], s, blo, bhi, shift);
        } else {
#pragma unroll
            for (int i = 0; i < V; ++i) sum += af_round_bf16(expf(af_round_bf16(clamped_bf16(v[i], s, lo, hi) - shift)));
        }
    }
    sum = af_block_sum<BLOCK>(sum, red);
    if (threadIdx.x == 0) {
        const float z = af_round_bf16(af_round_bf16(logf(af_round_bf16(sum))) + shift);
        out[blockIdx.x] = __float2bfloat16_rn(z * af_round_bf16(af_mish(z)));
    }
}

// The packed form, for rows of whole 16-byte vectors and a scale that is a bfloat16 value (the
// default's 2): the same roundings in bfloat16x2 arithmetic, one instruction for two elements.
// bf16(y·s) is one rounding of the exact product either way (two bfloat16 values multiply
// exactly in float32); doubling, and clamping to bounds rounded to bfloat16, are exact; and
// bf16(v − shift) of two bfloat16 values is the same whether the difference is rounded once or
// first to float32 (exact unless the exponents are 16 apart, when neither lands on a bfloat16
// midpoint). The first pass takes the max and min of the raw pairs, NaN-propagating; ±inf times
// a zero scale is then tested once, on the row's extremes. STAGED keeps the row in shared
// memory between the passes (N·2 bytes, up to 48 KB) rather than reading it again from L2.
// 1024 rows of 8192 on an H200, block 256: 11.5 µs against the float form's 14.9, 6.1 million
// warp instructions against 9.3 (Nsight Compute). What is left is issue: about half the issue
// slots busy, the ALU pipe the busiest (42%), expf's 8 instructions an element the largest share.
// Holding the row in registers instead (4 or 8 uint4 a thread) was as fast at 1024 rows and 3%
// slower at 37; forcing one wave of all 1024 rows (32 registers, full occupancy) was no faster.
// Nor was reading bf16(exp(d)) from a table of the bfloat16 d (bf16_table.cuh, as 99's gelu):
// 5.3 million instructions against 6.0, but 12.4-14.1 µs against 11.8-12.0 (block 256; at 37
// rows 5.6 against 4.9, H200); the issue slots were then 45-48% busy against 65%: waiting on the
// lookups took the place of the instructions saved (stall reasons not measured).
template <bool STAGED>
__global__ void __launch_bounds__(BLOCK)
clamp_lse_mish_rows_bf16_packed(const __nv_bfloat16* __restrict__ y, __nv_bfloat16* __restrict__ out, int N,
                                float s, float lo, float hi) {
    extern __shared__ uint4 staged[];  // the row, when STAGED: N·2 bytes
    __shared__ float red[BLOCK / 32];
    const uint4* r = reinterpret_cast<const uint4*>(y + (size_t)blockIdx.x * N);
    const int n_vec = N / 8;
    __nv_bfloat162 top = __float2bfloat162_rn(-INFINITY), bottom = __float2bfloat162_rn(INFINITY);
#pragma unroll 4
    for (int i = threadIdx.x; i < n_vec; i += BLOCK) {
        const uint4 q = r[i];
        if constexpr (STAGED) staged[i] = q;
        const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&q);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            top = __hmax2_nan(top, pairs[k]);
            bottom = __hmin2_nan(bottom, pairs[k]);
        }
    }
    const float2 t2 = __bfloat1622float2(top), b2 = __bfloat1622float2(bottom);
    const bool nan = isnan(t2.x) || isnan(t2.y);
    const float y_max = af_block_max<BLOCK>(fmaxf(t2.x, t2.y), red);
    const float y_min = -af_block_max<BLOCK>(-fminf(b2.x, b2.y), red);
    // A NaN anywhere, or ±inf times a zero (or NaN) scale: torch.amax keeps it.
    const bool row_nan = __syncthreads_or(nan) || isnan(y_max * s) || isnan(y_min * s);
    const float m = row_nan ? NAN : clamped_bf16(s >= 0.f ? y_max : y_min, s, lo, hi);
    const float shift = isinf(m) ? 0.f : m;  // logsumexp's masked_fill of an infinite max
    const __nv_bfloat162 s2 = __float2bfloat162_rn(s), two = __float2bfloat162_rn(2.f);
    const __nv_bfloat162 lo2 = __float2bfloat162_rn(lo), hi2 = __float2bfloat162_rn(hi);
    const __nv_bfloat162 shift2 = __float2bfloat162_rn(shift);
    float sum = 0.f;
#pragma unroll 4
    for (int i = threadIdx.x; i < n_vec; i += BLOCK) {
        const uint4 q = STAGED ? staged[i] : r[i];  // a thread reads back only what it staged
        const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&q);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const __nv_bfloat162 v = __hmin2(__hmax2(__hmul2(__hmul2(pairs[k], s2), two), lo2), hi2);
            const float2 d = __bfloat1622float2(__hsub2(v, shift2));
            const float2 e = round_bf16x2(expf(d.x), expf(d.y));
            sum += e.x + e.y;
        }
    }
    sum = af_block_sum<BLOCK>(sum, red);
    if (threadIdx.x == 0) {
        const float z = af_round_bf16(af_round_bf16(logf(af_round_bf16(sum))) + shift);
        out[blockIdx.x] = __float2bfloat16_rn(z * af_round_bf16(af_mish(z)));
    }
}

// True when s is a bfloat16 value (its low 16 bits are zero): the packed form's condition.
inline bool is_bfloat16_value(float s) {
    uint32_t bits;
    memcpy(&bits, &s, sizeof bits);
    return (bits & 0xffffu) == 0;
}

// A bfloat16 model's rows: y M×N bfloat16 (bias included), out M bfloat16; s = scale_factor.
AF_EXPORT int af_clamp_lse_mish_rows_bf16(const void* y, void* out, float s, float lo, float hi, int M, int N,
                                          cudaStream_t stream) {
    if (M == 0) return 0;
    const auto* y16 = static_cast<const __nv_bfloat16*>(y);
    auto* out16 = static_cast<__nv_bfloat16*>(out);
    const bool vectors = N % 8 == 0 && af_aligned16(y16);
    if (vectors && is_bfloat16_value(s)) {
        const size_t row_bytes = (size_t)N * 2;
        if (row_bytes <= 48 * 1024) {
            clamp_lse_mish_rows_bf16_packed<true><<<M, BLOCK, row_bytes, stream>>>(y16, out16, N, s, lo, hi);
        } else {
            clamp_lse_mish_rows_bf16_packed<false><<<M, BLOCK, 0, stream>>>(y16, out16, N, s, lo, hi);
        }
    } else if (vectors) {
        clamp_lse_mish_rows_bf16<8><<<M, BLOCK, 0, stream>>>(y16, out16, N, s, lo, hi);
    } else {
        clamp_lse_mish_rows_bf16<1><<<M, BLOCK, 0, stream>>>(y16, out16, N, s, lo, hi);
    }
    AF_CHECK_LAUNCH();
}

// y: M×N float32 (y_bf16 == 0) or bfloat16; out: M float32.
AF_EXPORT int af_clamp_lse_mish_rows(const void* y, int y_bf16, const float* bias, float* out, float t, float lo,
                                     float hi, int M, int N, cudaStream_t stream) {
    if (M == 0) return 0;  // an empty batch: nothing to launch (a 0-block grid is a launch error)
    if (y_bf16) return launch_rows(static_cast<const __nv_bfloat16*>(y), bias, out, t, lo, hi, M, N, stream);
    return launch_rows(static_cast<const float*>(y), bias, out, t, lo, hi, M, N, stream);
}
