// gemm_bn, cuBLAS + BatchNorm epilogue (training mode): z = x·Wᵀ (no bias) comes from cuBLAS
// through torch; the kernels below finish out = (z − μ_z)·coef + β, coef = s·γ/√(s²·σ²_z + eps),
// and update the running statistics as nn.BatchNorm1d does. Two paths:
//
// Strip-resident (AF_STRIP_COLS = C > 0, batches whose M×C strip fits in shared memory): one
//   block per strip of C columns loads the whole strip once, computes each column's mean and
//   then Σ(v − mean)² from shared memory (an exact two-pass: stable at any mean, no divisions
//   per element), finishes its columns and writes the normalised strip to out (z itself, or a
//   separate buffer when autograd keeps z for the backward). One launch, one
//   read and one write of z.
// Two kernels (AF_STRIP_COLS = 0, or a batch too tall for the strip):
//   column_stats: a block per strip of 32 columns × chunk of rows. Each thread accumulates
//     shifted sums Σd, Σd² (d = v − K, K the chunk's first value of the column), the block adds
//     its threads' sums and stores the chunk's (count, mean, M2); the last block of a strip to
//     arrive (a device-scope counter) merges the chunks with Chan's update, writes μ_z and coef
//     and updates the running statistics. Never E[z²] − E[z]² (see column_stats).
//   bn_normalize: out ← (z − μ_z)·coef + β (out = z: in place).
// Both read and write z as float4 when N % 4 == 0 and z is 16-byte aligned, scalars otherwise.
//
// A bfloat16 model (af_bn_train_bf16; every tensor bfloat16, T = __nv_bfloat16): z is linear's
// output y = x·Wᵀ + b as its reference stores it (cuBLAS's bfloat16, bias included), and each
// element is read as y2 = bfloat16(y·s), the reference's stored x·s. The statistics are those of y2,
// the normalisation y2's (coef = γ/√(σ²_y2 + eps), a scale of 1 and a bias of 0 in the formulas
// below), all in float32, the output rounded once: BatchNorm as CUDA computes it on the reference's
// bfloat16 tensors. Half the bytes of the float32 path; the running statistics are updated in float32
// and stored back in bfloat16.
#include "math.cuh"
#include "rows.cuh"

#include <cuda_bf16.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#ifndef AF_BLOCK
#define AF_BLOCK 256
#endif
#ifndef AF_STRIP_COLS
#define AF_STRIP_COLS 0
#endif
constexpr int STRIP_COLS = AF_STRIP_COLS;  // 0: the two-kernel path only
constexpr int STRIP_BLOCK = AF_BLOCK;
constexpr int STRIP_WARPS = STRIP_BLOCK / 32;
// The two-kernel path's block: AF_BLOCK when it is the configuration, the former default (256)
// when it is only the fallback of a strip configuration for tall batches.
constexpr int BLOCK = STRIP_COLS > 0 ? 256 : AF_BLOCK;
constexpr int WARPS = BLOCK / 32;
constexpr int COLS = 32;  // columns of a two-kernel strip: one 128-byte line of a row
static_assert(BLOCK % 32 == 0 && BLOCK >= 64 && BLOCK <= 1024, "BLOCK is a multiple of 32 in [64, 1024]");
static_assert(STRIP_COLS == 0 || STRIP_COLS == 8 || STRIP_COLS == 16 || STRIP_COLS == 32, "STRIP_COLS is 0, 8, 16 or 32");
static_assert(STRIP_BLOCK % 32 == 0 && STRIP_BLOCK >= 64 && STRIP_BLOCK <= 1024, "AF_BLOCK is a multiple of 32 in [64, 1024]");

// Chunks of rows per strip: about TARGET_BLOCKS blocks in all (three waves and more on 132 SMs),
// each chunk as tall as that allows, at least MIN_CHUNK_ROWS rows and at most MAX_CHUNKS chunks.
// A block's reduction, partials and arrival cost the same at any height, so short chunks spend
// the kernel on them: at 16384×4096 (a bfloat16 model, H200, Nsight Compute) 64 chunks of 256
// rows (8192 blocks, 8 loads a thread) took 86 µs with DRAM 33% busy, 16 of 1024 72-73 µs (39%;
// whole lines, below, then 45).
constexpr int MAX_CHUNKS = 64, MIN_CHUNK_ROWS = 256, TARGET_BLOCKS = 2048;
constexpr int STATS_UNROLL = 4;  // independent loads in flight per thread in column_stats
constexpr int NORM_UNROLL = 8;   // rows each bn_normalize thread loads before it writes any

inline int stat_chunks(int M, int N) {
    const int wanted = af_ceil_div(TARGET_BLOCKS, af_ceil_div(N, COLS));
    return max(1, min(min(wanted, MAX_CHUNKS), af_ceil_div(M, MIN_CHUNK_ROWS)));
}

using bf16 = __nv_bfloat16;
template <typename T>
constexpr bool BF16_MODEL = std::is_same_v<T, bf16>;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(bf16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T from_float(float v) {
    if constexpr (BF16_MODEL<T>) return __float2bfloat16_rn(v);
    else return v;
}

// VEC adjacent elements as floats: one 16-byte (float) or 8-byte (bfloat16) access when VEC is 4
// (the caller guarantees alignment).
template <int VEC, typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&v)[VEC]) {
    if constexpr (VEC == 4 && BF16_MODEL<T>) {
        const uint2 q = *reinterpret_cast<const uint2*>(p);
        const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&q.x));
        const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&q.y));
        v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
    } else if constexpr (VEC == 4) {
        const float4 q = *reinterpret_cast<const float4*>(p);
        v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
    } else {
        v[0] = to_float(*p);
    }
}

template <int VEC, typename T>
__device__ __forceinline__ void store_vec(T* p, const float (&v)[VEC]) {
    if constexpr (VEC == 4 && BF16_MODEL<T>) {
        const __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]), hi = __floats2bfloat162_rn(v[2], v[3]);
        uint2 q;
        q.x = *reinterpret_cast<const unsigned int*>(&lo);
        q.y = *reinterpret_cast<const unsigned int*>(&hi);
        *reinterpret_cast<uint2*>(p) = q;
    } else if constexpr (VEC == 4) {
        *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
        *p = from_float<T>(v[0]);
    }
}

// The VEC columns' scales where a bfloat16 model's z is read as y2 (see the top), else unused.
template <int VEC, typename T>
__device__ __forceinline__ void load_scales(const T* scale, int col, float (&s)[VEC]) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) s[j] = BF16_MODEL<T> ? to_float(scale[col + j]) : 1.f;
}

// z's VEC elements as the statistics see them: a bfloat16 model's y2 = bfloat16(y·s), else z itself.
template <int VEC, typename T>
__device__ __forceinline__ void model_values(float (&v)[VEC], const float (&s)[VEC]) {
    if constexpr (BF16_MODEL<T>) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[j] = __bfloat162float(__float2bfloat16_rn(v[j] * s[j]));
    }
}

// A bfloat16 model's four loaded elements as y2 = bfloat16(y·s), two a bfloat16x2 multiply: the
// product of two bfloat16 values is exact in float32, so the packed multiply rounds once, as the
// reference's float32 multiply and bfloat16 store do. Against a conversion (F2F) an element, it
// took column_stats from 102 to 86 µs and bn_normalize from 118 to 86 at 16384×4096 (H200).
// Holding bn_normalize's rows as loaded and converting them late (60 registers against 66) did
// not help (88-91 µs).
template <int PAIRS>
__device__ __forceinline__ void model_values_of(const __nv_bfloat162* y, const __nv_bfloat162* s,
                                                float (&v)[2 * PAIRS]) {
#pragma unroll
    for (int k = 0; k < PAIRS; ++k) {
        const float2 f = __bfloat1622float2(__hmul2(y[k], s[k]));
        v[2 * k] = f.x, v[2 * k + 1] = f.y;
    }
}

__device__ __forceinline__ void model_values_of(uint2 q, const float (&s)[4], float (&v)[4]) {
    const __nv_bfloat162 pairs[2] = {__floats2bfloat162_rn(s[0], s[1]), __floats2bfloat162_rn(s[2], s[3])};
    model_values_of<2>(reinterpret_cast<const __nv_bfloat162*>(&q), pairs, v);
}

template <int VEC, typename T>
__device__ __forceinline__ void load_model_values(const T* p, const float (&s)[VEC], float (&v)[VEC]) {
    if constexpr (VEC == 4 && BF16_MODEL<T>) {
        model_values_of(*reinterpret_cast<const uint2*>(p), s, v);
    } else {
        load_vec<VEC>(p, v);
        model_values<VEC, T>(v, s);
    }
}

// Merge the BLOCK/32 row lanes of each of 32 columns (thread = column tid % 32, lane tid / 32);
// the result is valid in lane 0. Ends with a barrier so the shared buffers can be reused at once.
struct LaneMerge {
    static constexpr int LANES = BLOCK / 32;
    float n[LANES][32], mean[LANES][32], m2[LANES][32];

    __device__ void run(float& cn, float& cmean, float& cm2, int cx, int ly) {
        n[ly][cx] = cn;
        mean[ly][cx] = cmean;
        m2[ly][cx] = cm2;
        __syncthreads();
        if (ly == 0) {
#pragma unroll
            for (int l = 1; l < LANES; ++l) af_chan_merge(cn, cmean, cm2, n[l][cx], mean[l][cx], m2[l][cx]);
        }
        __syncthreads();
    }
};

template <typename T>
struct BnParams {
    const T* bias;
    const T* scale;
    const T* gamma;
    T* running_mean;  // null with running_var: no running-statistics update
    T* running_var;
    long long* count;  // BatchNorm's num_batches_tracked, which the kernel adds this batch to; null: the host counts
    float eps;
    float factor;
};

// Add this batch to BatchNorm's count, from one thread of the grid: where the count was a
// kernel of its own (torch's add_), it sat between the GEMM and this one, 1.3 µs and its gap.
template <typename T>
__device__ __forceinline__ void count_batch(const BnParams<T>& p) {
    if (p.count != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *p.count += 1;
}

// One column's final statistics: returns coef for the normalize step, and updates BatchNorm1d's
// running statistics of y = (z + b)·s: mean s·(μ_z + b), unbiased variance s²·M2/(n − 1),
// lerped by factor (a bfloat16 model's statistics are y2's already: s = 1, b = 0). Both paths
// finish their columns here, with one formula.
template <typename T>
__device__ __forceinline__ float bn_column_finish(int col, float n, float mean, float m2, const BnParams<T>& p) {
    const float s = BF16_MODEL<T> ? 1.f : to_float(p.scale[col]);
    const float b = BF16_MODEL<T> ? 0.f : to_float(p.bias[col]);
    const float var = m2 / n;  // biased: what BatchNorm normalises with
    if (p.running_mean != nullptr) {
        const float keep = 1.f - p.factor;
        p.running_mean[col] = from_float<T>(keep * to_float(p.running_mean[col]) + p.factor * (s * (mean + b)));
        p.running_var[col] = from_float<T>(keep * to_float(p.running_var[col]) + p.factor * (s * s * (m2 / (n - 1.f))));
    }
    return s * to_float(p.gamma[col]) / sqrtf(s * s * var + p.eps);
}

// ---------------------------------------------------------------------------------------------
// Strip-resident path.

// Dynamic shared memory of one strip block: the M×C strip in the model's type T, then
// STRIP_WARPS×C partial sums and the strip's per-column mean, coef and β in float. All of it
// dynamic (no static shared memory), so the device's opt-in limit is the whole budget. A bfloat16
// model's values are bfloat16 numbers (y2 = bf16(y·s)), so its strip holds them as they are: half
// the bytes, so twice the blocks an SM at a batch. 1024×8192 on an H200 (Nsight Compute): staged
// in float, 32 columns took 23 µs with one 1024-thread block an SM and 16 columns 29 µs with three
// 256-thread blocks, DRAM 12-15% busy, issue slots 21-29%: each SM went through load, statistics
// and write one phase at a time.
template <typename T>
inline size_t strip_bytes(int M) {
    return (size_t)M * STRIP_COLS * sizeof(T) + (size_t)(STRIP_WARPS + 3) * STRIP_COLS * sizeof(float);
}

// Sum v over the threads that share column tid % C (C ≤ 32: a warp holds 32/C of them); every
// thread gets its column's total. red holds STRIP_WARPS×C floats, out C. Ends with a barrier
// after everyone has read out, so the caller may write red or out at once.
template <int C>
__device__ __forceinline__ float strip_column_sum(float v, float* red, float* out) {
#pragma unroll
    for (int offset = 16; offset >= C; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane < C) red[warp * C + lane] = v;  // lane < C: column lane, this warp's sum
    __syncthreads();
    if (threadIdx.x < C) {
        float total = 0.f;
#pragma unroll
        for (int w = 0; w < STRIP_WARPS; ++w) total += red[w * C + threadIdx.x];
        out[threadIdx.x] = total;
    }
    __syncthreads();
    const float total = out[threadIdx.x % C];
    __syncthreads();
    return total;
}

template <int VEC, typename T>
__global__ void __launch_bounds__(STRIP_BLOCK)
strip_bn(const T* z, T* out, int M, int N, const T* __restrict__ beta, BnParams<T> params) {
    constexpr int C = STRIP_COLS > 0 ? STRIP_COLS : 32;  // 32: never launched, keeps the template valid
    constexpr int PER_ROW = C / VEC;                      // threads (vectors) per strip row
    constexpr int ROW_STEP = STRIP_BLOCK / PER_ROW;       // strip rows one pass of the block covers
    constexpr int LANES = STRIP_BLOCK / C;                // row lanes per column in the statistics
    extern __shared__ float4 smem_f4[];                   // float4: 16-byte aligned for vector access
    T* strip = reinterpret_cast<T*>(smem_f4);             // [M][C], row-major (M·C·sizeof(T): 16 bytes a row or more)
    float* red = reinterpret_cast<float*>(strip + (size_t)M * C);  // [STRIP_WARPS][C]
    float* col_mean = red + STRIP_WARPS * C;              // [C] each
    float* col_coef = col_mean + C;
    float* col_beta = col_coef + C;
    const int col0 = blockIdx.x * C;
    const int width = min(C, N - col0);  // columns of this strip inside z (a multiple of VEC)
    count_batch(params);

    // 1. Load the strip: PER_ROW threads read one row's C columns (C·sizeof(T) bytes); four rows
    //    in flight per thread (8 or 16 were no faster: a bfloat16 model's 1024-row call on an
    //    H200, 1.132x the GEMM at 16 columns either way, 1.113 → 1.145-1.151 at 32). Columns past
    //    N are zero (never written back). Stored as T: exact, a bfloat16 model's values being
    //    bfloat16 numbers.
    const int c = (threadIdx.x % PER_ROW) * VEC;
    const bool live = c < width;
    float s[VEC];
    load_scales<VEC>(params.scale, live ? col0 + c : 0, s);
    for (int r = threadIdx.x / PER_ROW; r < M; r += 4 * ROW_STEP) {
        float v[4][VEC];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int row = r + u * ROW_STEP;
            if (live && row < M) load_model_values<VEC>(z + (size_t)row * N + col0 + c, s, v[u]);
            else
#pragma unroll
                for (int j = 0; j < VEC; ++j) v[u][j] = 0.f;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u)
            if (r + u * ROW_STEP < M) store_vec<VEC>(strip + (r + u * ROW_STEP) * C + c, v[u]);
    }
    __syncthreads();

    // 2. Exact two-pass statistics from shared memory: thread (column sc, lane sl) reads rows
    //    sl, sl + LANES, ...: a warp reads 32 consecutive floats (no bank conflicts).
    const int sc = threadIdx.x % C, sl = threadIdx.x / C;
    float sum = 0.f;
    for (int r = sl; r < M; r += LANES) sum += to_float(strip[r * C + sc]);
    const float n = (float)M;
    const float mean = strip_column_sum<C>(sum, red, col_mean) / n;
    float m2 = 0.f;
    for (int r = sl; r < M; r += LANES) {
        const float d = to_float(strip[r * C + sc]) - mean;
        m2 = fmaf(d, d, m2);
    }
    m2 = strip_column_sum<C>(m2, red, col_coef);
    if (threadIdx.x < C) {
        const bool in = threadIdx.x < width;
        col_mean[threadIdx.x] = mean;  // thread tid < C holds column tid (sc == tid)
        col_coef[threadIdx.x] = in ? bn_column_finish(col0 + threadIdx.x, n, mean, m2, params) : 0.f;
        col_beta[threadIdx.x] = in ? to_float(beta[col0 + threadIdx.x]) : 0.f;
    }
    __syncthreads();

    // 3. Write the normalised strip back, same layout as the load.
    if (!live) return;
    float mu[VEC], coef[VEC], b[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) mu[j] = col_mean[c + j], coef[j] = col_coef[c + j], b[j] = col_beta[c + j];
    for (int r = threadIdx.x / PER_ROW; r < M; r += ROW_STEP) {
        float v[VEC];
        load_vec<VEC>(strip + r * C + c, v);
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[j] = fmaf(v[j] - mu[j], coef[j], b[j]);
        store_vec<VEC>(out + (size_t)r * N + col0 + c, v);
    }
}

// ---------------------------------------------------------------------------------------------
// Two-kernel path.

// Add v over the threads that share column (VEC group) cx of a C-column strip: C/VEC threads per
// row, so a warp holds VEC·32/C row lanes of each column. Thread tid < C gets column tid's total
// (valid only there). red holds WARPS×C floats; ends with a barrier.
template <int VEC, int C = COLS>
__device__ __forceinline__ float strip_sum(const float (&v)[VEC], float (&red)[WARPS][C]) {
    constexpr int PER_ROW = C / VEC;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        float s = v[j];
#pragma unroll
        for (int offset = 16; offset >= PER_ROW; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
        if (lane < PER_ROW) red[warp][lane * VEC + j] = s;
    }
    __syncthreads();
    float total = 0.f;
    if (threadIdx.x < C) {
#pragma unroll
        for (int w = 0; w < WARPS; ++w) total += red[w][threadIdx.x];
    }
    __syncthreads();
    return total;
}

// The end of column_stats over a C-column strip, called by every thread of the block: the
// block's shifted sums (s1, s2; each column's K in shift[]) become this chunk's partials, and the
// last block of the strip to arrive merges every chunk's with Chan's update and finishes the
// columns.
template <int VEC, int C, typename T>
__device__ __forceinline__ void finish_chunk(const float (&s1)[VEC], const float (&s2)[VEC], const float* shift,
                                             float (&red)[WARPS][C], LaneMerge& merge, bool& last, int rows, int N,
                                             float* part_count, float* part_mean, float* part_m2,
                                             unsigned int* arrivals, float* col_mean, float* col_coef,
                                             const BnParams<T>& params) {
    const float sum1 = strip_sum<VEC, C>(s1, red);  // its barriers also publish shift[]
    const float sum2 = strip_sum<VEC, C>(s2, red);
    const int col = blockIdx.x * C + threadIdx.x;  // meaningful for threadIdx.x < C
    if (threadIdx.x < C && col < N) {
        const float n = (float)rows;
        const float mean_d = sum1 / n;
        const float m2 = sum2 - sum1 * mean_d;
        const size_t at = (size_t)blockIdx.y * N + col;
        part_count[at] = n;
        part_mean[at] = shift[threadIdx.x] + mean_d;
        part_m2[at] = m2 < 0.f ? 0.f : m2;  // rounding can dip below 0; a NaN stays NaN (fmaxf would drop it)
    }
    // The threadFenceReduction pattern: partials visible device-wide before this block counts
    // itself in; the block that counts last sees every chunk's partial.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&arrivals[blockIdx.x], 1u) == gridDim.y - 1;
    __syncthreads();
    if (!last) return;
    const int mx = threadIdx.x % 32, my = threadIdx.x / 32;
    for (int half = 0; half < C / 32; ++half) {  // LaneMerge takes 32 columns at a time
        const int mcol = blockIdx.x * C + half * 32 + mx;
        float n = 0.f, mean = 0.f, m2 = 0.f;
        if (mcol < N) {
            for (int p = my; p < (int)gridDim.y; p += LaneMerge::LANES) {
                const size_t at = (size_t)p * N + mcol;  // __ldcg: from L2, never a stale L1 line
                af_chan_merge(n, mean, m2, __ldcg(part_count + at), __ldcg(part_mean + at), __ldcg(part_m2 + at));
            }
        }
        merge.run(n, mean, m2, mx, my);
        if (my == 0 && mcol < N) {
            col_mean[mcol] = mean;
            col_coef[mcol] = bn_column_finish(mcol, n, mean, m2, params);
        }
    }
    if (threadIdx.x == 0) arrivals[blockIdx.x] = 0;  // ready for reuse: the caller zeroes the buffer only once
}

// Shifted sums instead of Welford: d = v − K with K a value of the column (the chunk's first), so
// Σd and Σd² are additive (no division per element, loads stay in flight, the block adds its
// threads' sums without Chan merges) and M2 = Σd² − (Σd)²/n cancels only down from
// Σd² = n·(σ² + (μ − K)²): about ε·(1 + (μ − K)²/σ²) relative error, and K, a sample of the
// column, lies within a few σ of μ. Plain Σv² − (Σv)²/n loses ε·μ²/σ²: every digit when
// |μ| ≫ σ (a large bias or offset). The chunks are then merged with Chan's update as before.
template <int VEC, typename T>
__global__ void __launch_bounds__(BLOCK)
column_stats(const T* __restrict__ z, int M, int N, int chunk_rows, float* part_count, float* part_mean,
             float* part_m2, unsigned int* arrivals, float* col_mean, float* col_coef, BnParams<T> params) {
    constexpr int PER_ROW = COLS / VEC, LANES = BLOCK / PER_ROW;
    __shared__ float red[WARPS][COLS];
    count_batch(params);
    __shared__ float shift[COLS];
    __shared__ LaneMerge merge;
    __shared__ bool last;
    const int cx = threadIdx.x % PER_ROW, ly = threadIdx.x / PER_ROW;
    const int c0 = blockIdx.x * COLS + cx * VEC;  // this thread's first column; N % VEC == 0
    const int r0 = blockIdx.y * chunk_rows, r1 = min(M, r0 + chunk_rows);
    float k[VEC], s1[VEC], s2[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) k[j] = s1[j] = s2[j] = 0.f;
    if (c0 < N && r0 < r1) {
        float s[VEC];
        load_scales<VEC>(params.scale, c0, s);
        load_model_values<VEC>(z + (size_t)r0 * N + c0, s, k);
        for (int r = r0 + ly; r < r1; r += STATS_UNROLL * LANES) {
            float v[STATS_UNROLL][VEC];
#pragma unroll
            for (int u = 0; u < STATS_UNROLL; ++u)
                if (r + u * LANES < r1) load_model_values<VEC>(z + (size_t)(r + u * LANES) * N + c0, s, v[u]);
#pragma unroll
            for (int u = 0; u < STATS_UNROLL; ++u)
                if (r + u * LANES < r1) {
#pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        const float d = v[u][j] - k[j];
                        s1[j] += d;
                        s2[j] = fmaf(d, d, s2[j]);
                    }
                }
        }
        if (ly == 0) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) shift[cx * VEC + j] = k[j];
        }
    }
    finish_chunk<VEC, COLS>(s1, s2, shift, red, merge, last, r1 - r0, N, part_count, part_mean, part_m2, arrivals,
                            col_mean, col_coef, params);
}

// z ← (z − μ_z)·coef + β in place: COLS/VEC threads per row, NORM_UNROLL rows loaded per thread
// before any is written (the loads and stores go through one pointer, so the compiler would
// otherwise keep one load in flight). Row blocks run last-to-first: column_stats' grid reads the
// last chunks of rows last, so those are the rows likeliest still in L2 when this kernel starts.
template <int VEC, typename T>
__global__ void __launch_bounds__(BLOCK)
bn_normalize(const T* z, T* out, const float* __restrict__ col_mean, const float* __restrict__ col_coef,
             const T* __restrict__ beta, const T* __restrict__ scale, int M, int N) {
    constexpr int PER_ROW = COLS / VEC, LANES = BLOCK / PER_ROW;
    const int cx = threadIdx.x % PER_ROW, ly = threadIdx.x / PER_ROW;
    const int c0 = blockIdx.x * COLS + cx * VEC;
    if (c0 >= N) return;  // N % VEC == 0: the VEC columns are all inside or all outside
    float mu[VEC], coef[VEC], b[VEC], s[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) mu[j] = col_mean[c0 + j], coef[j] = col_coef[c0 + j], b[j] = to_float(beta[c0 + j]);
    load_scales<VEC>(scale, c0, s);
    const int first = (gridDim.y - 1 - blockIdx.y) * (NORM_UNROLL * LANES) + ly;
    float v[NORM_UNROLL][VEC];
#pragma unroll
    for (int u = 0; u < NORM_UNROLL; ++u)
        if (first + u * LANES < M) load_model_values<VEC>(z + (size_t)(first + u * LANES) * N + c0, s, v[u]);
#pragma unroll
    for (int u = 0; u < NORM_UNROLL; ++u)
        if (first + u * LANES < M) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) v[u][j] = fmaf(v[u][j] - mu[j], coef[j], b[j]);
            store_vec<VEC>(out + (size_t)(first + u * LANES) * N + c0, v[u]);
        }
}

// ---------------------------------------------------------------------------------------------
// The two kernels for a bfloat16 model, with whole lines: 64 columns a block (128 bytes of a
// row), 8 a thread in one 16-byte access. The 32-column strips above read half a line of a
// bfloat16 row in 8-byte pieces; at 16384×4096 (H200, Nsight Compute) these take column_stats
// from 72 to 45 µs (DRAM 39% → 63%) and bn_normalize from 86 to 64 (57% → 77%), the same sums in
// the same order. Need N % 8 == 0 and z, out and scale 16-byte aligned (the launcher checks).
// The chunks of rows are stat_chunks', so column_stats_bf16_lines has half the blocks it aims for.
constexpr int LINE_COLS = 64, NORM_LINE_UNROLL = 4;  // 8 rows a thread: 80 registers, no faster

// Eight loaded elements as y2 = bfloat16(y·s), as the four above.
__device__ __forceinline__ void model_values_of(uint4 q, const __nv_bfloat162 (&s)[4], float (&v)[8]) {
    model_values_of<4>(reinterpret_cast<const __nv_bfloat162*>(&q), s, v);
}

__device__ __forceinline__ void load_scale_pairs(const bf16* scale, int c0, __nv_bfloat162 (&s)[4]) {
    const uint4 q = *reinterpret_cast<const uint4*>(scale + c0);
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&q);
#pragma unroll
    for (int k = 0; k < 4; ++k) s[k] = pairs[k];
}

// column_stats (whose comments hold) over 64-column strips.
__global__ void __launch_bounds__(BLOCK)
column_stats_bf16_lines(const bf16* __restrict__ z, int M, int N, int chunk_rows, float* part_count,
                        float* part_mean, float* part_m2, unsigned int* arrivals, float* col_mean, float* col_coef,
                        BnParams<bf16> params) {
    constexpr int C = LINE_COLS, V = 8, PER_ROW = C / V, LANES = BLOCK / PER_ROW;
    count_batch(params);
    __shared__ float red[WARPS][C];
    __shared__ float shift[C];
    __shared__ LaneMerge merge;
    __shared__ bool last;
    const int cx = threadIdx.x % PER_ROW, ly = threadIdx.x / PER_ROW;
    const int c0 = blockIdx.x * C + cx * V;
    const int r0 = blockIdx.y * chunk_rows, r1 = min(M, r0 + chunk_rows);
    float k[V], s1[V], s2[V];
#pragma unroll
    for (int j = 0; j < V; ++j) k[j] = s1[j] = s2[j] = 0.f;
    if (c0 < N && r0 < r1) {
        __nv_bfloat162 sc[4];
        load_scale_pairs(params.scale, c0, sc);
        model_values_of(*reinterpret_cast<const uint4*>(z + (size_t)r0 * N + c0), sc, k);
        for (int r = r0 + ly; r < r1; r += STATS_UNROLL * LANES) {
            uint4 raw[STATS_UNROLL];
#pragma unroll
            for (int u = 0; u < STATS_UNROLL; ++u)
                if (r + u * LANES < r1) raw[u] = *reinterpret_cast<const uint4*>(z + (size_t)(r + u * LANES) * N + c0);
#pragma unroll
            for (int u = 0; u < STATS_UNROLL; ++u)
                if (r + u * LANES < r1) {
                    float v[V];
                    model_values_of(raw[u], sc, v);
#pragma unroll
                    for (int j = 0; j < V; ++j) {
                        const float d = v[j] - k[j];
                        s1[j] += d;
                        s2[j] = fmaf(d, d, s2[j]);
                    }
                }
        }
        if (ly == 0) {
#pragma unroll
            for (int j = 0; j < V; ++j) shift[cx * V + j] = k[j];
        }
    }
    finish_chunk<V, C>(s1, s2, shift, red, merge, last, r1 - r0, N, part_count, part_mean, part_m2, arrivals, col_mean,
                       col_coef, params);
}

// bn_normalize over 64-column strips, NORM_LINE_UNROLL rows a thread.
__global__ void __launch_bounds__(BLOCK)
bn_normalize_bf16_lines(const bf16* z, bf16* out, const float* __restrict__ col_mean,
                        const float* __restrict__ col_coef, const bf16* __restrict__ beta,
                        const bf16* __restrict__ scale, int M, int N) {
    constexpr int V = 8, PER_ROW = LINE_COLS / V, LANES = BLOCK / PER_ROW;
    const int cx = threadIdx.x % PER_ROW, ly = threadIdx.x / PER_ROW;
    const int c0 = blockIdx.x * LINE_COLS + cx * V;
    if (c0 >= N) return;
    float mu[V], coef[V], b[V];
#pragma unroll
    for (int j = 0; j < V; ++j) mu[j] = col_mean[c0 + j], coef[j] = col_coef[c0 + j], b[j] = to_float(beta[c0 + j]);
    __nv_bfloat162 sc[4];
    load_scale_pairs(scale, c0, sc);
    const int first = (gridDim.y - 1 - blockIdx.y) * (NORM_LINE_UNROLL * LANES) + ly;
    uint4 raw[NORM_LINE_UNROLL];
#pragma unroll
    for (int u = 0; u < NORM_LINE_UNROLL; ++u)
        if (first + u * LANES < M) raw[u] = *reinterpret_cast<const uint4*>(z + (size_t)(first + u * LANES) * N + c0);
#pragma unroll
    for (int u = 0; u < NORM_LINE_UNROLL; ++u) {
        if (first + u * LANES >= M) continue;
        float v[V];
        model_values_of(raw[u], sc, v);
        uint4 q;
        __nv_bfloat162* outs = reinterpret_cast<__nv_bfloat162*>(&q);
#pragma unroll
        for (int k = 0; k < 4; ++k)
            outs[k] = __floats2bfloat162_rn(fmaf(v[2 * k] - mu[2 * k], coef[2 * k], b[2 * k]),
                                            fmaf(v[2 * k + 1] - mu[2 * k + 1], coef[2 * k + 1], b[2 * k + 1]));
        *reinterpret_cast<uint4*>(out + (size_t)(first + u * LANES) * N + c0) = q;
    }
}

// ---------------------------------------------------------------------------------------------
// Host side.

// Does this configuration's strip kernel hold M rows on `device`? The device's opt-in limit
// (227 KB on H100, 163 KB on A100) decides; configs() offers strips up to 200 KB only.
AF_EXPORT int af_bn_strip_fits(int M, int device) {
    if (STRIP_COLS == 0 || M <= 0) return 0;
    int limit = 0;
    if (cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
        cudaGetLastError();  // not a launch failure: clear it, take the two-kernel path
        return 0;
    }
    return strip_bytes<float>(M) <= (size_t)limit;  // a float32 model's; a bfloat16 model's strip is smaller
}

// Sizes of the two-kernel path's workspaces: partials [chunks][N], arrivals [strips] (zeroed).
AF_EXPORT int af_bn_chunks(int M, int N) { return stat_chunks(M, N); }
AF_EXPORT int af_bn_strips(int N) { return af_ceil_div(N, COLS); }

constexpr int MAX_DEVICES = 64;
// Per device and kernel (float32 or bfloat16 model, scalar or vector): the dynamic shared memory
// cudaFuncSetAttribute allowed.
static std::atomic<int> strip_allowed[2][2][MAX_DEVICES];

template <int VEC, typename T>
static int launch_strip(const T* z, T* out, const T* beta, const BnParams<T>& params, int M, int N,
                        cudaStream_t stream) {
    int device = 0, limit = 0;
    int status = (int)cudaGetDevice(&device);
    if (status == 0) status = (int)cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (status != 0) return status;
    const size_t bytes = strip_bytes<T>(M);
    if (bytes > (size_t)limit || device >= MAX_DEVICES) return (int)cudaErrorInvalidValue;  // af_bn_strip_fits said no
    std::atomic<int>& allowed = strip_allowed[BF16_MODEL<T>][VEC == 4][device];
    if ((size_t)allowed.load() < bytes) {  // once per device: allow everything the device offers
        status = (int)cudaFuncSetAttribute(strip_bn<VEC, T>, cudaFuncAttributeMaxDynamicSharedMemorySize, limit);
        if (status != 0) return status;
        allowed.store(limit);
    }
    strip_bn<VEC, T><<<af_ceil_div(N, STRIP_COLS), STRIP_BLOCK, bytes, stream>>>(z, out, M, N, beta, params);
    AF_CHECK_LAUNCH();
}

template <int VEC, typename T>
static int launch_two_kernels(const T* z, T* out, const T* beta, const BnParams<T>& params, float* part_count,
                              float* part_mean, float* part_m2, unsigned int* arrivals, float* col_mean,
                              float* col_coef, int M, int N, cudaStream_t stream) {
    const int chunks = stat_chunks(M, N);
    if constexpr (BF16_MODEL<T>) {
        if (N % 8 == 0 && af_aligned16(z, out, params.scale)) {
            const int strips = af_ceil_div(N, LINE_COLS);  // arrivals holds af_bn_strips(N), more than these
            column_stats_bf16_lines<<<dim3(strips, chunks), BLOCK, 0, stream>>>(
                z, M, N, af_ceil_div(M, chunks), part_count, part_mean, part_m2, arrivals, col_mean, col_coef, params);
            const int status = (int)cudaGetLastError();
            if (status != 0) return status;
            const int rows = NORM_LINE_UNROLL * (BLOCK / (LINE_COLS / 8));
            bn_normalize_bf16_lines<<<dim3(strips, af_ceil_div(M, rows)), BLOCK, 0, stream>>>(
                z, out, col_mean, col_coef, beta, params.scale, M, N);
            AF_CHECK_LAUNCH();
        }
    }
    const int strips = af_ceil_div(N, COLS);
    column_stats<VEC, T><<<dim3(strips, chunks), BLOCK, 0, stream>>>(z, M, N, af_ceil_div(M, chunks), part_count,
                                                                  part_mean, part_m2, arrivals, col_mean,
                                                                  col_coef, params);
    const int status = (int)cudaGetLastError();
    if (status != 0) return status;
    const int rows = NORM_UNROLL * (BLOCK / (COLS / VEC));
    bn_normalize<VEC, T><<<dim3(strips, af_ceil_div(M, rows)), BLOCK, 0, stream>>>(z, out, col_mean, col_coef, beta,
                                                                                  params.scale, M, N);
    AF_CHECK_LAUNCH();
}

// z (M×N) is normalised into out, which may be z itself (in place: each element is read before it is
// written, by the same thread); running_mean/running_var may both be null (no update), and count
// (num_batches_tracked, which one thread of the first kernel adds 1 to) null where the host counts. With
// part_count null the strip kernel runs (the caller asked af_bn_strip_fits), and the other
// workspaces may be null too; otherwise the two kernels run with them.
template <typename T>
static int bn_train(const T* z, T* out, const T* bias, const T* scale, const T* gamma, const T* beta, T* running_mean,
                    T* running_var, long long* count, float* part_count, float* part_mean, float* part_m2, unsigned int* arrivals,
                    float* col_mean, float* col_coef, float eps, float factor, int M, int N, cudaStream_t stream) {
    if (M == 0 || N == 0) return 0;  // nothing to launch (an empty grid is a launch error)
    const BnParams<T> params{bias, scale, gamma, running_mean, running_var, count, eps, factor};
    // VEC = 4 along a row needs every row start aligned to 4 elements: N % 4 == 0 and aligned bases.
    constexpr std::uintptr_t ALIGN = 4 * sizeof(T);
    const bool vec = N % 4 == 0 && reinterpret_cast<std::uintptr_t>(z) % ALIGN == 0 &&
                     reinterpret_cast<std::uintptr_t>(out) % ALIGN == 0;
    if (part_count == nullptr) {
        if (STRIP_COLS == 0) return (int)cudaErrorInvalidValue;
        return vec ? launch_strip<4>(z, out, beta, params, M, N, stream)
                   : launch_strip<1>(z, out, beta, params, M, N, stream);
    }
    return vec ? launch_two_kernels<4>(z, out, beta, params, part_count, part_mean, part_m2, arrivals, col_mean,
                                       col_coef, M, N, stream)
               : launch_two_kernels<1>(z, out, beta, params, part_count, part_mean, part_m2, arrivals, col_mean,
                                       col_coef, M, N, stream);
}

AF_EXPORT int af_bn_train(const float* z, float* out, const float* bias, const float* scale, const float* gamma,
                          const float* beta, float* running_mean, float* running_var, long long* count,
                          float* part_count, float* part_mean, float* part_m2, unsigned int* arrivals,
                          float* col_mean, float* col_coef, float eps, float factor, int M, int N,
                          cudaStream_t stream) {
    return bn_train(z, out, bias, scale, gamma, beta, running_mean, running_var, count, part_count, part_mean,
                    part_m2, arrivals, col_mean, col_coef, eps, factor, M, N, stream);
}

// A bfloat16 model's: z is linear's bfloat16 output with its bias (see the top), every tensor bfloat16.
AF_EXPORT int af_bn_train_bf16(const bf16* z, bf16* out, const bf16* bias, const bf16* scale, const bf16* gamma,
                               const bf16* beta, bf16* running_mean, bf16* running_var, long long* count,
                               float* part_count, float* part_mean, float* part_m2, unsigned int* arrivals,
                               float* col_mean, float* col_coef, float eps, float factor, int M, int N,
                               cudaStream_t stream) {
    return bn_train(z, out, bias, scale, gamma, beta, running_mean, running_var, count, part_count, part_mean,
                    part_m2, arrivals, col_mean, col_coef, eps, factor, M, N, stream);
}
