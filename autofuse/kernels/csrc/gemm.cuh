// The float32 GEMM main loops shared by every GEMM-based CUDA variant: C = A · Bᵀ with A (M×K)
// and B (N×K) both row-major (K contiguous): x and nn.Linear's weight as they come.
//
// One kind is compiled per library, chosen by a macro (the build passes it with -D):
//   AF_NAIVE      one thread per output element, operands read straight from global memory
//   AF_TILED      shared-memory tiles, one output per thread (AF_TILE = 16 or 32)
//   (neither)     register-blocked: AF_BM×AF_BN block tile, AF_BK k-slice, AF_TM×AF_TN outputs
//                 per thread, AF_VEC-wide (1 or 4) global loads, AF_STAGES (1 or 2) shared buffers
// Every loop uses fp32 FMA only (no tensor cores), so these variants are exact fp32 math.
//
// The epilogue is a functor the main loop hands its accumulators to; each thread owns rows
// row0..row0+TM-1 and columns col0..col0+TN-1, and the TX = BN/TN threads that share rows
// are consecutive lanes of one warp (TX is a power of two ≤ 32), so row reductions are
// warp shuffles of width TX.
#pragma once
#include "autofuse.cuh"
#include "math.cuh"

// --- naive -----------------------------------------------------------------------------
template <int BM, int BN, class Epi>
__global__ void __launch_bounds__(BM * BN) af_gemm_naive(const float* __restrict__ A, const float* __restrict__ B,
                                                         int M, int N, int K, Epi epi) {
    const int tx = threadIdx.x % BN, ty = threadIdx.x / BN;
    const int m = blockIdx.y * BM + ty, n = blockIdx.x * BN + tx;
    float acc[1][1] = {{0.f}};
    if (m < M && n < N) {
        const float* a = A + (size_t)m * K;
        const float* b = B + (size_t)n * K;
        float s = 0.f;
        for (int k = 0; k < K; ++k) s = fmaf(a[k], b[k], s);
        acc[0][0] = s;
    }
    epi.template apply<BM, BN, 1, 1>(acc, m, n, M, N, tx, ty);
}

// --- tiled -------------------------------------------------------------------------------
template <int TILE, class Epi>
__global__ void __launch_bounds__(TILE * TILE) af_gemm_tiled(const float* __restrict__ A, const float* __restrict__ B,
                                                             int M, int N, int K, Epi epi) {
    // +1 padding: Bs[tx][kk] across a warp would otherwise hit one bank.
    __shared__ float As[TILE][TILE + 1], Bs[TILE][TILE + 1];
    const int tx = threadIdx.x % TILE, ty = threadIdx.x / TILE;
    const int m = blockIdx.y * TILE + ty, n = blockIdx.x * TILE + tx, nb = blockIdx.x * TILE + ty;
    float s = 0.f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        const int k = k0 + tx;  // consecutive threads read consecutive k: coalesced
        As[ty][tx] = (m < M && k < K) ? A[(size_t)m * K + k] : 0.f;
        Bs[ty][tx] = (nb < N && k < K) ? B[(size_t)nb * K + k] : 0.f;
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < TILE; ++kk) s = fmaf(As[ty][kk], Bs[tx][kk], s);
        __syncthreads();
    }
    float acc[1][1] = {{s}};
    epi.template apply<TILE, TILE, 1, 1>(acc, m, n, M, N, tx, ty);
}

// --- register-blocked ----------------------------------------------------------------------
// Where logical row r of a tile is kept in shared memory. The compute loop reads each thread's
// P consecutive rows (P = TM or TN) as float4s; stored as-is, lanes tx and tx+1 would read
// 4·P bytes apart, a 2-way bank conflict for P = 8. Interleaving the groups of four (group g
// of thread t at g·(ROWS/P·4) + 4t) makes a quarter-warp's float4 reads consecutive.
template <int ROWS, int P>
__device__ __forceinline__ int af_swizzle(int r) {
    if constexpr (P % 4 != 0) {
        return r;
    } else {
        const int t = r / P, j = r % P;
        return (j / 4) * (ROWS / P * 4) + t * 4 + (j % 4);
    }
}

template <int ROWS, int BK, int VEC, int THREADS, int P>
struct AfTileLoader {
    // A ROWS×BK slice of a K-contiguous matrix, VEC consecutive k per load, transposed into
    // shared memory as [BK][ROWS] (rows swizzled, see af_swizzle) so the compute loop reads
    // consecutive rows.
    static constexpr int LOADS = ROWS * BK / (VEC * THREADS);
    static_assert(LOADS * VEC * THREADS == ROWS * BK, "BM*BK and BN*BK must be multiples of VEC*threads");
    float reg[LOADS][VEC];

    __device__ void load(const float* __restrict__ src, int rows, int K, int row_base, int k0, bool vector_ok) {
#pragma unroll
        for (int i = 0; i < LOADS; ++i) {
            const int e = threadIdx.x + i * THREADS;
            const int r = e / (BK / VEC), k = k0 + (e % (BK / VEC)) * VEC;
            const int row = row_base + r;
            if constexpr (VEC == 4) {
                if (vector_ok) {
                    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
                    if (row < rows && k < K) v = *reinterpret_cast<const float4*>(src + (size_t)row * K + k);
                    reg[i][0] = v.x; reg[i][1] = v.y; reg[i][2] = v.z; reg[i][3] = v.w;
                    continue;
                }
            }
#pragma unroll
            for (int v = 0; v < VEC; ++v)
                reg[i][v] = (row < rows && k + v < K) ? src[(size_t)row * K + k + v] : 0.f;
        }
    }

    __device__ void store(float (*dst)[ROWS]) const {
#pragma unroll
        for (int i = 0; i < LOADS; ++i) {
            const int e = threadIdx.x + i * THREADS;
            const int r = e / (BK / VEC), kv = (e % (BK / VEC)) * VEC;
#pragma unroll
            for (int v = 0; v < VEC; ++v) dst[kv + v][af_swizzle<ROWS, P>(r)] = reg[i][v];
        }
    }
};

template <int BM, int BN, int BK, int TM, int TN, int VEC, int STAGES, class Epi>
__global__ void __launch_bounds__((BM / TM) * (BN / TN))
af_gemm_blocked(const float* __restrict__ A, const float* __restrict__ B, int M, int N, int K, Epi epi) {
    constexpr int TX = BN / TN, TY = BM / TM, THREADS = TX * TY;
    static_assert(STAGES == 1 || STAGES == 2, "STAGES is 1 or 2");
    __shared__ __align__(16) float As[STAGES][BK][BM];
    __shared__ __align__(16) float Bs[STAGES][BK][BN];
    const int tx = threadIdx.x % TX, ty = threadIdx.x / TX;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    // float4 loads need 16-byte aligned rows: K a multiple of 4 (torch allocations are aligned).
    const bool vector_ok = (K % 4 == 0);
    AfTileLoader<BM, BK, VEC, THREADS, TM> la;
    AfTileLoader<BN, BK, VEC, THREADS, TN> lb;
    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc[i][j] = 0.f;

    la.load(A, M, K, m0, 0, vector_ok);
    lb.load(B, N, K, n0, 0, vector_ok);
    la.store(As[0]);
    lb.store(Bs[0]);
    __syncthreads();
    int cur = 0;
    for (int k0 = 0; k0 < K; k0 += BK) {
        const bool next = k0 + BK < K;
        if (STAGES == 2 && next) {  // fetch the next slice into registers while computing this one
            la.load(A, M, K, m0, k0 + BK, vector_ok);
            lb.load(B, N, K, n0, k0 + BK, vector_ok);
        }
#pragma unroll
        for (int kk = 0; kk < BK; ++kk) {
            float a[TM], b[TN];
#pragma unroll
            for (int i = 0; i < TM; ++i) a[i] = As[cur][kk][af_swizzle<BM, TM>(ty * TM + i)];
#pragma unroll
            for (int j = 0; j < TN; ++j) b[j] = Bs[cur][kk][af_swizzle<BN, TN>(tx * TN + j)];
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        if (next) {
            if (STAGES == 1) {
                __syncthreads();
                la.load(A, M, K, m0, k0 + BK, vector_ok);
                lb.load(B, N, K, n0, k0 + BK, vector_ok);
            }
            const int dst = STAGES == 2 ? cur ^ 1 : 0;
            la.store(As[dst]);
            lb.store(Bs[dst]);
            __syncthreads();
            cur = dst;
        }
    }
    epi.template apply<TY, TX, TM, TN>(acc, m0 + ty * TM, n0 + tx * TN, M, N, tx, ty);
}

// --- the kind this library was built for ------------------------------------------------------
#if defined(AF_NAIVE)
constexpr int kTileM = 16, kTileN = 16;
#elif defined(AF_TILED)
constexpr int kTileM = AF_TILE, kTileN = AF_TILE;
#else
constexpr int kTileM = AF_BM, kTileN = AF_BN;
#endif

// Blocks along N (per-row partial results a row-reducing epilogue produces) and along M.
inline int af_gemm_col_blocks(int N) { return af_ceil_div(N, kTileN); }
inline int af_gemm_row_blocks(int M) { return af_ceil_div(M, kTileM); }

template <class Epi>
int af_gemm_launch(const float* A, const float* B, int M, int N, int K, const Epi& epi, cudaStream_t stream) {
    const dim3 grid(af_gemm_col_blocks(N), af_gemm_row_blocks(M));
#if defined(AF_NAIVE)
    af_gemm_naive<kTileM, kTileN, Epi><<<grid, kTileM * kTileN, 0, stream>>>(A, B, M, N, K, epi);
#elif defined(AF_TILED)
    af_gemm_tiled<AF_TILE, Epi><<<grid, AF_TILE * AF_TILE, 0, stream>>>(A, B, M, N, K, epi);
#else
    af_gemm_blocked<AF_BM, AF_BN, AF_BK, AF_TM, AF_TN, AF_VEC, AF_STAGES, Epi>
        <<<grid, (AF_BM / AF_TM) * (AF_BN / AF_TN), 0, stream>>>(A, B, M, N, K, epi);
#endif
    return (int)cudaGetLastError();
}

