"""The Triton GEMM main loop every ``triton`` variant shares (imported only when one is built).

A problem's kernel (``variants/<problem>/triton_kernels.py``) is a loop over output tiles that
calls ``tile_coords`` and ``tile_accumulator`` and then applies its own epilogue to the
float32 accumulator while it is still in registers. One kernel serves both schedules: launched
with one program per tile it is the classic grid; launched with one program per SM it is
persistent, each program walking tiles ``num_programs`` apart.

- Grouped ordering (``tile_coords``): GROUP_M row-blocks of x sweep every column block before
  the next group starts, so a band of x stays in L2 while W streams through.
- Operands: x (M×K) and W (N×K) are both K-major, as Hopper's tensor cores want them. With
  TMA they arrive through tensor descriptors (the copy engine, zero padding past the edges);
  otherwise through pointer loads whose rows past M or N are clamped to valid ones (their
  results are never stored) and whose K tail is masked only when K % BLOCK_K != 0.
- Precision (``operand_dot``): "fp32" is 3xTF32 (a = hi + lo, each TF32; hi·hi + hi·lo + lo·hi
  accumulated in float32: float32 accuracy from tensor cores, verified by the gate); "tf32"
  plain TF32; "bf16" rounds the operands to bfloat16 after loading (x may arrive as float32 and
  is converted in registers) and accumulates in float32; "ieee" is float32 FMA.
- Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) multiplies bfloat16 blocks wrongly
  (numpy sees their raw bits), so under it (INTERPRET) bf16 operands are rounded and multiplied
  as float32: the same arithmetic.
"""

import triton
import triton.language as tl


@triton.jit
def tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """(row block, column block) of the ``tile``-th tile in grouped order."""
    per_group = GROUP_M * num_n
    group = tile // per_group
    first_m = group * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % rows
    pid_n = (tile % per_group) // rows
    return pid_m, pid_n


@triton.jit
def operand_dot(a, b, acc, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + a·b (a: BM×BK, b: BK×BN) at PRECISION; see the module docstring."""
    if PRECISION == "bf16":
        a = a.to(tl.bfloat16)
        b = b.to(tl.bfloat16)
        if INTERPRET:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc)
    elif PRECISION == "tf32":
        return tl.dot(a, b, acc, input_precision="tf32")
    elif PRECISION == "fp32":
        return tl.dot(a, b, acc, input_precision="tf32x3")
    else:
        return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def tile_accumulator(x_ptr, w_ptr, x_desc, w_desc, M, N, K, pid_m, pid_n,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PRECISION: tl.constexpr, TMA: tl.constexpr, EVEN_K: tl.constexpr,
                     INTERPRET: tl.constexpr):
    """x[rows]·W[cols]ᵀ for one BLOCK_M × BLOCK_N tile, accumulated in float32.

    x and W are row-major with row strides K (contiguous). With TMA, x_desc and w_desc are
    tensor descriptors of block shapes [BLOCK_M, BLOCK_K] and [BLOCK_N, BLOCK_K] and the
    pointers are unused; otherwise the descriptors are unused.
    """
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_tiles = tl.cdiv(K, BLOCK_K)
    if TMA:
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        for kt in range(0, k_tiles):
            a = x_desc.load([off_m, kt * BLOCK_K])
            b = w_desc.load([off_n, kt * BLOCK_K])
            acc = operand_dot(a, b.T, acc, PRECISION, INTERPRET)
    else:
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.where(rm < M, rm, 0)  # rows past the edge read row 0; their results are never stored
        rn = tl.where(rn < N, rn, 0)
        rk = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + rm[:, None].to(tl.int64) * K + rk[None, :]
        b_ptrs = w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :]
        for kt in range(0, k_tiles):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_left = K - kt * BLOCK_K
                a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
                b = tl.load(b_ptrs, mask=rk[None, :] < k_left, other=0.0)
            acc = operand_dot(a, b.T, acc, PRECISION, INTERPRET)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
    return acc


@triton.jit
def gelu(v):
    """The exact erf GELU, as F.gelu: v·Φ(v)."""
    return 0.5 * v * (1.0 + tl.erf(v * 0.7071067811865476))


@triton.jit
def gelu_grad(v):
    """d gelu(v)/dv = Φ(v) + v·φ(v)."""
    return 0.5 * (1.0 + tl.erf(v * 0.7071067811865476)) + v * tl.exp(-0.5 * v * v) * 0.3989422804014327
