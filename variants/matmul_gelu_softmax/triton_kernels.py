"""Triton kernels of ``matmul_gelu_softmax`` (imported by triton_gemm.py when it is built).

``gelu_partials``: the epilogue of the shared main loop (``persistent_gemm``): from the
accumulator, + bias, exact GELU, the logits stored once, and per row of the tile the
online-softmax partial (max, Σ exp(v − max)) over the tile's columns. ``softmax_normalize``:
per row, the partials merged with the max subtracted (no overflow at any magnitude), then
out = exp(v − max) / Σ over the row, in place (or into a bfloat16 model's output);
``softmax_finish_inside`` the same in the GEMM's launch (a small tile's ``finish_inside``). The
backward's kernels load out and g in either dtype and compute in float32.
``softmax_grad_rows`` and ``gelu_softmax_backward``: ∂L/∂y = out ⊙ (g − Σ g·out) ⊙ gelu'(y), the
row sums by one program per row, then dy in tiles, written in the layouts the backward's GEMMs
want (``store_gradient``).
"""

import triton
import triton.language as tl

# row_block and parts_block are imported for the variant, which sizes its launches through this module.
from autofuse.kernels.triton.epilogue import (  # noqa: F401
    exp_nonpositive,
    gelu,
    gelu_grad,
    merged_partials,
    parts_block,
    row_block,
    store_gradient,
)


@triton.jit
def gelu_partials(acc, rm, rn, row_ok, col_ok, pid_m, pid_n, num_n, M, N, args):
    """The GEMM's epilogue (``persistent_gemm``): + bias, GELU, the logits stored, and per row the
    tile's (max, Σ exp(v − max)) into column pid_n of the partials; the pre-GELU y where y_ptr is
    not None. args: (bias_ptr, logits_ptr, y_ptr, part_max_ptr, part_sum_ptr)."""
    bias_ptr, logits_ptr, y_ptr, part_max_ptr, part_sum_ptr = args
    y = acc + tl.load(bias_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    v = gelu(y)
    live = tl.where(col_ok[None, :], v, float("-inf"))
    tile_max = tl.max(live, axis=1)
    tile_sum = tl.sum(exp_nonpositive(live - tile_max[:, None]), axis=1)
    tl.store(part_max_ptr + rm * num_n + pid_n, tile_max, mask=row_ok)
    tl.store(part_sum_ptr + rm * num_n + pid_n, tile_sum, mask=row_ok)
    offsets = rm[:, None].to(tl.int64) * N + rn[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(logits_ptr + offsets, v, mask=mask)
    if y_ptr is not None:
        tl.store(y_ptr + offsets, y, mask=mask)


@triton.jit
def softmax_normalize(logits_ptr, out_ptr, part_max_ptr, part_sum_ptr, N, PARTS,
                      BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr):
    """One row of exp(v − max)/Σ from the float32 logits into out (the logits themselves, in place,
    or a bfloat16 model's bfloat16 output)."""
    row = tl.program_id(0)
    p = tl.arange(0, BLOCK_P)
    part_max = tl.load(part_max_ptr + row * PARTS + p, mask=p < PARTS, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + row * PARTS + p, mask=p < PARTS, other=0.0)
    row_max = tl.max(part_max, axis=0)
    inv_total = 1.0 / tl.sum(part_sum * exp_nonpositive(part_max - row_max), axis=0)
    base = row.to(tl.int64) * N
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        v = tl.load(logits_ptr + base + cols, mask=cols < N, other=0.0)
        prob = exp_nonpositive(v - row_max) * inv_total
        tl.store(out_ptr + base + cols, prob.to(out_ptr.dtype.element_ty), mask=cols < N)


# The finish inside the GEMM's launch (``softmax_finish_inside``), one program's work: a row at a
# time, its pairs INSIDE_PARTS a step and its logits INSIDE_COLS a step. One row's block compiles
# at M = 1 here (Triton 3.6 and 3.9), where 22's failed (its triton_kernels.py says why): the rows'
# max has one use after merged_partials' loop.
INSIDE_PARTS = tl.constexpr(256)
INSIDE_COLS = tl.constexpr(4096)


@triton.jit
def softmax_finish_inside(M, N, num_n, args):
    """``softmax_normalize`` of every row, by the GEMM's last program to arrive (``persistent_gemm``'s
    FINISH): the call in one launch, for small batches. args: (the counter, logits_ptr, out_ptr,
    part_max_ptr, part_sum_ptr)."""
    _, logits_ptr, out_ptr, part_max_ptr, part_sum_ptr = args
    cols = tl.arange(0, INSIDE_COLS)
    for row in range(0, M):
        rows = row + tl.arange(0, 1)
        row_max, total = merged_partials(part_max_ptr, part_sum_ptr, rows, M, num_n, INSIDE_PARTS)
        inv_total = 1.0 / total
        row_start = rows[:, None].to(tl.int64) * N
        for start in range(0, N, INSIDE_COLS):
            mask = (start + cols < N)[None, :]
            v = tl.load(logits_ptr + row_start + start + cols[None, :], mask=mask, other=0.0)
            prob = exp_nonpositive(v - row_max[:, None]) * inv_total[:, None]
            tl.store(out_ptr + row_start + start + cols[None, :], prob.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def softmax_grad_rows(out_ptr, grad_ptr, top_ptr, rest_ptr, total_ptr, N, BLOCK_N: tl.constexpr):
    """Per row, what the softmax's backward needs besides the row itself: the largest output's
    column (top), rest = Σ_k out_k·(g_top − g_k) and total = Σ g·out = g_top − rest (see
    gradients.epilogue_backward): two passes over the row, one program per row."""
    row = tl.program_id(0)
    base = row.to(tl.int64) * N
    lanes = tl.arange(0, BLOCK_N)
    top, top_out, top_grad = -1, -1.0, 0.0
    for start in range(0, N, BLOCK_N):
        cols = start + lanes
        out = tl.load(out_ptr + base + cols, mask=cols < N, other=-1.0).to(tl.float32)
        grad = tl.load(grad_ptr + base + cols, mask=cols < N, other=0.0).to(tl.float32)
        i = tl.argmax(out, axis=0)
        m = tl.max(out, axis=0)
        better = m > top_out
        top = tl.where(better, start + i, top)
        top_grad = tl.where(better, tl.sum(tl.where(lanes == i, grad, 0.0), axis=0), top_grad)
        top_out = tl.maximum(m, top_out)
    rest = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + lanes
        out = tl.load(out_ptr + base + cols, mask=cols < N, other=0.0).to(tl.float32)
        grad = tl.load(grad_ptr + base + cols, mask=cols < N, other=0.0).to(tl.float32)
        rest += out * (top_grad - grad)
    rest_total = tl.sum(rest, axis=0)
    tl.store(top_ptr + row, top)
    tl.store(rest_ptr + row, rest_total)
    tl.store(total_ptr + row, top_grad - rest_total)


@triton.jit
def gelu_softmax_backward(y_ptr, bias_ptr, out_ptr, grad_ptr, top_ptr, rest_ptr, total_ptr, dy_ptr, dyt_ptr, part_ptr,
                          M, N, BIAS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr,
                          COLS: tl.constexpr, SUMS: tl.constexpr):
    """One (BLOCK_R × BLOCK_C) tile of ∂L/∂y = out ⊙ (g − Σ g·out) ⊙ gelu'(y), the top entry's
    out·rest (``softmax_grad_rows``), stored as ``store_gradient`` says. With BIAS, y is the
    saved logits plus the float32 bias the forward's epilogue added (bf16 cuBLAS left it)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < N)[None, :]
    top = tl.load(top_ptr + rows, mask=row_ok, other=-1)
    rest = tl.load(rest_ptr + rows, mask=row_ok, other=0.0)
    total = tl.load(total_ptr + rows, mask=row_ok, other=0.0)
    offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
    y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if BIAS:
        y += tl.load(bias_ptr + cols, mask=cols < N, other=0.0)[None, :]
    out = tl.load(out_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    da = out * tl.where(cols[None, :] == top[:, None], rest[:, None], grad - total[:, None])
    store_gradient(da * gelu_grad(y), rows, cols, M, N, dy_ptr, dyt_ptr, part_ptr, ROWS, COLS, SUMS)
