"""Triton kernels of ``matmul_gelu_softmax`` (imported by triton_gemm.py when it is built).

``gemm_gelu_partials``: the shared main loop, then from the accumulator: + bias, exact GELU,
the logits stored once, and per row of the tile the online-softmax partial (max, Σ exp(v − max))
over the tile's columns. ``softmax_normalize``: per row, the partials merged with the max
subtracted (no overflow at any magnitude), then out = exp(v − max) / Σ over the row, in place.
``softmax_grad_rows`` and ``gelu_softmax_backward``: ∂L/∂y = out ⊙ (g − Σ g·out) ⊙ gelu'(y), the
row sums by one program per row, then dy in tiles, written in the layouts the backward's GEMMs
want (``store_gradient``).
"""

import triton
import triton.language as tl

# row_block and parts_block are imported for the variant, which sizes its launches through this module.
from autofuse.kernels.triton.gemm import (  # noqa: F401
    exp_nonpositive,
    gelu,
    gelu_grad,
    parts_block,
    row_block,
    store_gradient,
    tile_accumulator,
    tile_coords,
)


@triton.jit
def gemm_gelu_partials(x_ptr, x_lo_ptr, w_ptr, w_lo_ptr, x_desc, x_lo_desc, w_desc, w_lo_desc,
                       x_scale_ptr, w_scale_ptr, bias_ptr, logits_ptr,
                       y_ptr, part_max_ptr, part_sum_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, MODE: tl.constexpr, TMA: tl.constexpr,
                       EVEN_K: tl.constexpr, INTERPRET: tl.constexpr, SAVE_Y: tl.constexpr, x32_ptr=None, w32_ptr=None,
                       EXACT_K: tl.constexpr = 0):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        acc = tile_accumulator(x_ptr, x_lo_ptr, w_ptr, w_lo_ptr, x_desc, x_lo_desc, w_desc, w_lo_desc, x_scale_ptr,
                               w_scale_ptr, M, N, K,
                               pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K,
                               MODE, TMA, EVEN_K, INTERPRET, x32_ptr, w32_ptr, EXACT_K)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rm < M
        col_ok = rn < N
        y = acc + tl.load(bias_ptr + rn, mask=col_ok, other=0.0)[None, :]
        v = gelu(y)
        live = tl.where(col_ok[None, :], v, float("-inf"))
        tile_max = tl.max(live, axis=1)
        tile_sum = tl.sum(exp_nonpositive(live - tile_max[:, None]), axis=1)
        tl.store(part_max_ptr + rm * num_n + pid_n, tile_max, mask=row_ok)
        tl.store(part_sum_ptr + rm * num_n + pid_n, tile_sum, mask=row_ok)
        offsets = rm[:, None].to(tl.int64) * N + rn[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        tl.store(logits_ptr + offsets, v, mask=mask)
        if SAVE_Y:
            tl.store(y_ptr + offsets, y, mask=mask)


@triton.jit
def softmax_normalize(logits_ptr, part_max_ptr, part_sum_ptr, N, PARTS,
                      BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr):
    row = tl.program_id(0)
    p = tl.arange(0, BLOCK_P)
    part_max = tl.load(part_max_ptr + row * PARTS + p, mask=p < PARTS, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + row * PARTS + p, mask=p < PARTS, other=0.0)
    row_max = tl.max(part_max, axis=0)
    inv_total = 1.0 / tl.sum(part_sum * exp_nonpositive(part_max - row_max), axis=0)
    base = logits_ptr + row.to(tl.int64) * N
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        v = tl.load(base + cols, mask=cols < N, other=0.0)
        tl.store(base + cols, exp_nonpositive(v - row_max) * inv_total, mask=cols < N)


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
        out = tl.load(out_ptr + base + cols, mask=cols < N, other=-1.0)
        grad = tl.load(grad_ptr + base + cols, mask=cols < N, other=0.0)
        i = tl.argmax(out, axis=0)
        m = tl.max(out, axis=0)
        better = m > top_out
        top = tl.where(better, start + i, top)
        top_grad = tl.where(better, tl.sum(tl.where(lanes == i, grad, 0.0), axis=0), top_grad)
        top_out = tl.maximum(m, top_out)
    rest = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + lanes
        out = tl.load(out_ptr + base + cols, mask=cols < N, other=0.0)
        grad = tl.load(grad_ptr + base + cols, mask=cols < N, other=0.0)
        rest += out * (top_grad - grad)
    rest_total = tl.sum(rest, axis=0)
    tl.store(top_ptr + row, top)
    tl.store(rest_ptr + row, rest_total)
    tl.store(total_ptr + row, top_grad - rest_total)


@triton.jit
def gelu_softmax_backward(y_ptr, out_ptr, grad_ptr, top_ptr, rest_ptr, total_ptr, dy_ptr, dyt_ptr, part_ptr, M, N,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                          SUMS: tl.constexpr):
    """One (BLOCK_R × BLOCK_C) tile of ∂L/∂y = out ⊙ (g − Σ g·out) ⊙ gelu'(y), the top entry's
    out·rest (``softmax_grad_rows``), stored as ``store_gradient`` says."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < N)[None, :]
    top = tl.load(top_ptr + rows, mask=row_ok, other=-1)
    rest = tl.load(rest_ptr + rows, mask=row_ok, other=0.0)
    total = tl.load(total_ptr + rows, mask=row_ok, other=0.0)
    offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
    y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    out = tl.load(out_ptr + offsets, mask=mask, other=0.0)
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0)
    da = out * tl.where(cols[None, :] == top[:, None], rest[:, None], grad - total[:, None])
    store_gradient(da * gelu_grad(y), rows, cols, M, N, dy_ptr, dyt_ptr, part_ptr, ROWS, COLS, SUMS)
