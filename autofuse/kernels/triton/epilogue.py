"""What the problems' Triton epilogues and backward kernels share (imported only when a triton
variant is built, as ``gemm.py``).

- Rounding and stores: ``bfloat16_round`` (to nearest even in bits, as torch rounds where a
  bfloat16 model stores a tensor, and the same under Triton's interpreter), ``to_store`` (a value
  in its pointer's dtype, rounded so), ``store_gradient`` (an epilogue backward's ∂L/∂y in the
  layouts ``autograd.GradLayouts`` names, with its column sums).
- Reductions over partials: ``chunk_tile`` and ``chunk_sums`` (per column, over the chunks of
  rows a pass wrote), ``column_sums`` (the launch that adds them: a bias's gradient), and
  ``merged_partials`` (per row, a softmax's or log-sum-exp's per-tile (max, Σ exp) pairs merged).
- Math: ``exp_nonpositive`` (exp to float32 accuracy for a softmax's x − max), ``gelu`` and
  ``gelu_grad`` (the exact erf GELU).
- Host-side block sizes of the row kernels that use them: ``row_block``, ``parts_block``.
"""

import triton
import triton.language as tl


@triton.jit
def bfloat16_round(v):
    """``v`` (float32) rounded to bfloat16 to nearest even and back, in bits, as torch rounds where a
    bfloat16 model stores a tensor (Triton's interpreter converts to bfloat16 by truncation, so a
    conversion would differ on the CPU). A NaN stays NaN; past bfloat16's largest is inf, as in torch."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))


@triton.jit
def to_store(v, ptr):
    """v (float32) in ptr's dtype, a bfloat16 one rounded to nearest even in bits first
    (``bfloat16_round``): the GPU converts so, Triton's interpreter by truncation, and the CPU
    checks hold a bfloat16 model's tensors to within one bfloat16 step of their reference. A
    bfloat16 model's outputs and gradients are stored so; the pointer's dtype says which."""
    if ptr.dtype.element_ty == tl.bfloat16:
        v = bfloat16_round(v)
    return v.to(ptr.dtype.element_ty)


@triton.jit
def store_gradient(dy, rows, cols, M, N, dy_ptr, dyt_ptr, part_ptr, ROWS: tl.constexpr, COLS: tl.constexpr,
                   SUMS: tl.constexpr):
    """Store one (rows × cols) tile of an epilogue backward's ∂L/∂y (M × N, float32) in the layouts
    ``autograd.GradLayouts`` names: dy (ROWS), dyᵀ (COLS; N × M, so dW's operand is K-major),
    and the tile's column sums (SUMS) in the partial sums' row of the program's row block, the
    launch's first axis. dy and dyᵀ take their pointers' dtype (bfloat16 under bf16); the sums
    stay float32."""
    row_ok = rows < M
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    dy = tl.where(mask, dy, 0.0)
    if ROWS:
        tl.store(dy_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], dy.to(dy_ptr.dtype.element_ty), mask=mask)
    if COLS:
        tl.store(dyt_ptr + cols[:, None].to(tl.int64) * M + rows[None, :], tl.trans(dy).to(dyt_ptr.dtype.element_ty),
                 mask=tl.trans(mask))
    if SUMS:
        block = tl.program_id(0)  # the launch's first axis walks the row blocks
        tl.store(part_ptr + block.to(tl.int64) * N + cols, tl.sum(dy, axis=0), mask=col_ok)


@triton.jit
def chunk_tile(start, cols, ok, N, CHUNKS, BLOCK_P: tl.constexpr):
    """Chunks start … start + BLOCK_P − 1 of a (chunks × N) matrix of partials, at ``cols``: their
    mask and offsets."""
    chunks = start + tl.arange(0, BLOCK_P)
    return (chunks < CHUNKS)[:, None] & ok[None, :], chunks[:, None].to(tl.int64) * N + cols[None, :]


@triton.jit
def chunk_sums(a_ptr, b_ptr, cols, ok, N, CHUNKS, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
               A_ONLY: tl.constexpr):
    """Per column, the sums over the chunks of two (chunks × N) matrices of partials, at a_ptr and
    b_ptr (A_ONLY: a_ptr's alone, b's sums zero), BLOCK_P chunks at a time."""
    sum_a = tl.zeros((BLOCK_C,), dtype=tl.float32)
    sum_b = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for start in range(0, CHUNKS, BLOCK_P):
        mask, offsets = chunk_tile(start, cols, ok, N, CHUNKS, BLOCK_P)
        sum_a += tl.sum(tl.load(a_ptr + offsets, mask=mask, other=0.0), axis=0)
        if not A_ONLY:
            sum_b += tl.sum(tl.load(b_ptr + offsets, mask=mask, other=0.0), axis=0)
    return sum_a, sum_b


@triton.jit
def column_sums(part_ptr, out_ptr, P, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """out = Σ over the P rows of part (P × N, float32: ``store_gradient``'s SUMS), in out's dtype
    (``to_store``): a bias's gradient in its own dtype, one launch."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    total, _ = chunk_sums(part_ptr, part_ptr, cols, col_ok, N, P, BLOCK_P, BLOCK_N, True)
    tl.store(out_ptr + cols, to_store(total, out_ptr), mask=col_ok)


@triton.jit
def exp_nonpositive(x):
    """exp(x) for x ≤ 0 (a softmax's or log-sum-exp's x − max) to float32 accuracy, NaN kept.

    ``tl.exp`` on float32 is x·log₂e then ex2.approx: the product's rounding is an error of
    |x|·2⁻²⁴ in the exponent, so exp(−20) comes out ~1e-6 off, where expf is within 2 ulp (the
    gate's large inputs put softmax arguments in the hundreds). Here x = k·ln2 + r with k an
    integer and |r| ≤ ln2/2 (ln2 in two parts, so k·ln2_hi is exact), and
    exp(x) = 2^r·log₂e · 2^k: the approximation sees only r.
    Below −104 the result is 0 (float32 flushes it anyway), so −inf gives 0."""
    x = tl.where(x < -104.0, -104.0, x)
    k = tl.floor(x * 1.4426950408889634 + 0.5)
    r = (x - k * 0.693145751953125) - k * 1.4286068203094173e-06
    return tl.exp2(r * 1.4426950408889634) * tl.exp2(k)


@triton.jit
def merged_partials(part_max_ptr, part_sum_ptr, rows, M, PARTS, BLOCK_P: tl.constexpr):
    """Per row, (the row's max, Σ over its tiles of the tile's sum scaled to that max) from an
    epilogue's per-tile pairs (max, Σ exp(v − max)), PARTS a row, BLOCK_P a step, each step's sum
    rescaled to the new max (one step where a finish kernel sizes BLOCK_P to hold a row's pairs:
    ``parts_block``); rows past M give (0, 1), which keeps their arithmetic finite."""
    p = tl.arange(0, BLOCK_P)
    row_max = tl.full(rows.shape, float("-inf"), tl.float32)
    total = tl.zeros(rows.shape, tl.float32)
    for start in range(0, PARTS, BLOCK_P):
        mask = (rows[:, None] < M) & (start + p[None, :] < PARTS)
        offsets = rows[:, None] * PARTS + start + p[None, :]
        part_max = tl.load(part_max_ptr + offsets, mask=mask, other=float("-inf"))
        part_sum = tl.load(part_sum_ptr + offsets, mask=mask, other=0.0)
        new_max = tl.where(rows < M, tl.maximum(row_max, tl.max(part_max, axis=1)), 0.0)
        total = total * exp_nonpositive(row_max - new_max) + tl.sum(
            part_sum * exp_nonpositive(part_max - new_max[:, None]), axis=1)
        row_max = new_max
    return row_max, tl.where(rows < M, total, 1.0)


@triton.jit
def gelu(v):
    """The exact erf GELU, as F.gelu: v·Φ(v)."""
    return 0.5 * v * (1.0 + tl.erf(v * 0.7071067811865476))


@triton.jit
def gelu_grad(v):
    """d gelu(v)/dv = Φ(v) + v·φ(v)."""
    return 0.5 * (1.0 + tl.erf(v * 0.7071067811865476)) + v * tl.exp(-0.5 * v * v) * 0.3989422804014327


def row_block(n: int) -> int:
    """Columns a row kernel handles per step: the row whole up to 2048, else 2048 at a time."""
    return min(2048, triton.next_power_of_2(max(n, 16)))


def parts_block(parts: int) -> int:
    """A power of two holding a row's per-tile partial results, for the kernels that merge them."""
    return triton.next_power_of_2(max(parts, 2))
