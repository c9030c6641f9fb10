"""Triton kernels of ``matmul_clamp_lse_mish`` (imported by triton_gemm.py when it is built).

``clamp_lse_partials``: the epilogue of the shared main loop (``persistent_gemm``): from the
accumulator, + bias, × t, clamp, and per row of the tile the pair (max, Σ exp(v − max)); the
logits never reach memory (unless a gradient needs them: y_ptr, or under bf16 q_ptr: their
softmax factors relative to the tile's max, in bfloat16; or a bfloat16 model's clamped logits,
v_ptr, which its finish reads). ``lse_mish_finish``: per row, the pairs merged with the max
subtracted (no overflow at any clamp bound), z = max + log Σ, out = z·mish(z); z is kept for the
backward. ``lse_mish_finish_bf16``: the same z, and out as a bfloat16 model's reference computes
it, from the clamped logits again (``lse_mish_finish_bf16`` says why). ``clamp_lse_backward``:
∂L/∂y = g·h'(z)·exp(clamp(t·y) − z)·[lo ≤ t·y ≤ hi]·t in tiles, h'(z) included, written in the
layouts the backward's GEMMs want (``store_gradient``); ``clamp_lse_backward_from_q`` the same
from the bf16 forward's saved softmax factors (q_ptr); ``clamp_lse_rows`` the z of logits whose
forward kept none (the cuBLAS + epilogue variant of a bfloat16 model).
"""

import triton
import triton.language as tl

# parts_block is imported for the variant, which sizes its launches through this module.
from autofuse.kernels.triton.epilogue import (  # noqa: F401
    bfloat16_round,
    exp_nonpositive,
    merged_partials,
    parts_block,
    store_gradient,
)


@triton.jit
def clamp_lse_partials(acc, rm, rn, row_ok, col_ok, pid_m, pid_n, num_n, M, N, args):
    """The GEMM's epilogue (``persistent_gemm``): + bias, × t, clamp, and per row the tile's
    (max, Σ exp(v − max)) into column pid_n of the partials; the logits where y_ptr is not None, the
    softmax factors where q_ptr is not None, the clamped logits v in bfloat16 where v_ptr is not
    None (a bfloat16 model's, for ``lse_mish_finish_bf16``). args: (bias_ptr, y_ptr, q_ptr, v_ptr,
    part_max_ptr, part_sum_ptr, t, lo, hi)."""
    bias_ptr, y_ptr, q_ptr, v_ptr, part_max_ptr, part_sum_ptr, t, lo, hi = args
    y = acc + tl.load(bias_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    # A bfloat16 model rounds where its bfloat16 reference stores a tensor: linear's output, x·s
    # (x + x and the clamp are exact), and in the finish logsumexp's terms, sum, log and z, and mish(z).
    # The float32-exact output lies up to ~1.5% from that reference at the default clamp (z near
    # 10-19, z·mish(z) near 100-360), past KernelBench's atol = rtol = 1e-2.
    if bias_ptr.dtype.element_ty == tl.bfloat16:
        y = bfloat16_round(y)
        v = tl.minimum(tl.maximum(bfloat16_round(y * (t * 0.5)) * 2.0, lo), hi)
    else:
        v = tl.minimum(tl.maximum(y * t, lo), hi)
    live = tl.where(col_ok[None, :], v, float("-inf"))
    tile_max = tl.max(live, axis=1)
    e = exp_nonpositive(live - tile_max[:, None])
    tile_sum = tl.sum(e, axis=1)
    tl.store(part_max_ptr + rm * num_n + pid_n, tile_max, mask=row_ok)
    tl.store(part_sum_ptr + rm * num_n + pid_n, tile_sum, mask=row_ok)
    offsets = rm[:, None].to(tl.int64) * N + rn[None, :]
    if y_ptr is not None:
        tl.store(y_ptr + offsets, y, mask=row_ok[:, None] & col_ok[None, :])
    if q_ptr is not None:  # the backward's softmax factor, relative to the tile's max; 0 where clamped
        inside = (y * t >= lo) & (y * t <= hi)
        q = tl.where(inside, e, 0.0).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + offsets, q, mask=row_ok[:, None] & col_ok[None, :])
    if v_ptr is not None:  # bfloat16 already, but for a bound; rounded, its conversion is exact on the CPU too
        tl.store(v_ptr + offsets, bfloat16_round(v).to(tl.bfloat16), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def tanh_softplus(z):
    """tanh(softplus(z)), mish(z)/z, from one exp and no log or tanh. With w = e^z,
    tanh(log(1 + w)) = w(w + 2)/(w(w + 2) + 2): for z ≤ 0 that has no cancellation; for z > 0,
    with v = e^−z, it is (1 + 2v)/(1 + 2v + 2v²). So it stays float32-accurate where
    log(1 + e^z) rounds to log(1) = 0 (z < −17: softplus written with tl.log returned 0, and
    z·mish(z) with it; the GPU gate caught it at batch 2, K = 1, large inputs) and where
    (1 − e^−2u)/(1 + e^−2u) cancels for small u."""
    w = exp_nonpositive(-tl.abs(z))
    n = w * (w + 2.0)
    return tl.where(z > 0.0, (1.0 + 2.0 * w) / (1.0 + 2.0 * w + 2.0 * w * w), n / (n + 2.0))


@triton.jit
def lse_mish_rows(part_max_ptr, part_sum_ptr, z_ptr, out_ptr, rows, M, PARTS, BLOCK_P: tl.constexpr):
    """A float32 model's z = max + log Σ for ``rows`` (kept for the backward where z_ptr is not
    None) and out = z·mish(z), float32-accurate."""
    row_max, total = merged_partials(part_max_ptr, part_sum_ptr, rows, M, PARTS, BLOCK_P)
    z = row_max + tl.log(total)  # the backward's z (its softmax is exp(v − z)): float32-accurate
    if z_ptr is not None:
        tl.store(z_ptr + rows, z, mask=rows < M)
    tl.store(out_ptr + rows, z * z * tanh_softplus(z), mask=rows < M)


@triton.jit
def lse_mish_finish(part_max_ptr, part_sum_ptr, z_ptr, out_ptr, M, PARTS,
                    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    """``lse_mish_rows``, BLOCK_R rows a program."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    lse_mish_rows(part_max_ptr, part_sum_ptr, z_ptr, out_ptr, rows, M, PARTS, BLOCK_P)


@triton.jit
def lse_mish_rows_bf16(v_ptr, part_max_ptr, part_sum_ptr, z_ptr, out_ptr, rows, M, N, PARTS, BLOCK_C: tl.constexpr,
                       BLOCK_P: tl.constexpr):
    """A bfloat16 model's finish for ``rows``: z as ``lse_mish_rows`` keeps it for the backward
    (where z_ptr is not None), and out rounded where its bfloat16 reference stores a tensor
    (``bfloat16_round``). torch's logsumexp of a bfloat16 row is m = max(v), then v − m, its exp,
    their sum (float32 inside), its log and log + m, each stored in bfloat16; then mish(z) and
    z·mish(z). So each term exp(v − m) is rounded against the row's max, which the per-tile pairs
    (each relative to its tile's max, unrounded) cannot reproduce: z from them, rounded as the chain
    here, differed by one bfloat16 step in 3 of 1024 rows (H100, 1024×8192², KernelBench's inputs;
    335 with z rounded once), and z·mish(z) then past atol = rtol = 1e-2; with the terms rounded so
    (emulated on the host), all 1024 matched. So this reads each row's v again (bfloat16, stored
    by ``clamp_lse_partials``), BLOCK_C columns at a time; m is the pairs' max, which is max(v)."""
    row_ok = rows < M
    row_max, total = merged_partials(part_max_ptr, part_sum_ptr, rows, M, PARTS, BLOCK_P)
    if z_ptr is not None:
        tl.store(z_ptr + rows, row_max + tl.log(total), mask=row_ok)  # the backward's z: float32-accurate
    cols = tl.arange(0, BLOCK_C)
    row_v = v_ptr + rows[:, None].to(tl.int64) * N
    acc = tl.zeros((rows.shape[0], BLOCK_C), tl.float32)  # per column slot: one sum across the row at the end
    for start in range(0, N, BLOCK_C):
        mask = row_ok[:, None] & (start + cols < N)[None, :]
        v = tl.load(row_v + start + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        e = bfloat16_round(exp_nonpositive(bfloat16_round(v - row_max[:, None])))
        acc += tl.where(mask, e, 0.0)  # masked columns add 0, rows past M too (their sum is replaced)
    s = tl.where(row_ok, tl.sum(acc, axis=1), 1.0)
    zb = bfloat16_round(row_max + bfloat16_round(tl.log(bfloat16_round(s))))
    out = bfloat16_round(zb * bfloat16_round(zb * tanh_softplus(zb)))  # so the store's conversion is exact
    tl.store(out_ptr + rows, out.to(tl.bfloat16), mask=row_ok)


@triton.jit
def lse_mish_finish_bf16(v_ptr, part_max_ptr, part_sum_ptr, z_ptr, out_ptr, M, N, PARTS, BLOCK_R: tl.constexpr,
                         BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    """``lse_mish_rows_bf16``, BLOCK_R rows a program."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    lse_mish_rows_bf16(v_ptr, part_max_ptr, part_sum_ptr, z_ptr, out_ptr, rows, M, N, PARTS, BLOCK_C, BLOCK_P)


# The finish inside the GEMM's launch (``lse_mish_finish_inside``), one program's work: a float32
# model's rows INSIDE_ROWS at a time, INSIDE_PARTS pairs a step; a bfloat16 model's two rows at a
# time, INSIDE_COLS logits a step (two steps for 4096 columns, four at 8192). Two rows, not one:
# at M = 1 Triton makes M a constant, and one row's block then has no mask left to keep; Triton
# 3.6's thread-locality pass rewrote merged_partials' max of loaded pairs and failed an assertion
# (H200, the bfloat16 model's batch-1 seed). The GEMM kernel takes the finish's registers: the
# 16×64 seed's from 44 to 148 a thread (bf16) and from 48 to 66 at M = 1 and 80 at M = 8 (a
# bfloat16 model; no spills; sm_90, Triton 3.9), where its stages' shared memory (120 KB) fits one
# block an SM either way.
INSIDE_ROWS = tl.constexpr(16)
INSIDE_PARTS = tl.constexpr(256)
INSIDE_ROWS_BF16 = tl.constexpr(2)
INSIDE_COLS = tl.constexpr(2048)


@triton.jit
def lse_mish_finish_inside(M, N, num_n, args):
    """The finish of every row, by the GEMM's last program to arrive (``persistent_gemm``'s FINISH):
    the call in one launch. args: (the counter, part_max_ptr, part_sum_ptr, v_ptr, out_ptr), the
    pairs and a bfloat16 model's logits as ``clamp_lse_partials`` stored them. For small batches,
    whose rows one program merges in a few steps; without a gradient (z is not kept)."""
    _, part_max_ptr, part_sum_ptr, v_ptr, out_ptr = args
    if v_ptr is None:
        for start in range(0, M, INSIDE_ROWS):
            lse_mish_rows(part_max_ptr, part_sum_ptr, None, out_ptr, start + tl.arange(0, INSIDE_ROWS), M, num_n,
                          INSIDE_PARTS)
    else:
        for start in range(0, M, INSIDE_ROWS_BF16):
            lse_mish_rows_bf16(v_ptr, part_max_ptr, part_sum_ptr, None, out_ptr, start + tl.arange(0, INSIDE_ROWS_BF16),
                               M, N, num_n, INSIDE_COLS, INSIDE_PARTS)


@triton.jit
def output_scale(z_ptr, g_ptr, rows, row_ok, t):
    """g·h'(z)·t per row, h'(z) = 2z·tanh(sp(z)) + z²·(1 − tanh²(sp(z)))·σ(z); and z."""
    z = tl.load(z_ptr + rows, mask=row_ok, other=0.0)
    th = tanh_softplus(z)
    e = exp_nonpositive(-tl.abs(z))
    sigmoid = tl.where(z >= 0.0, 1.0 / (1.0 + e), e / (1.0 + e))
    g = tl.load(g_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)  # a bfloat16 model's g: bfloat16
    return g * (2.0 * z * th + z * z * (1.0 - th * th) * sigmoid) * t, z


@triton.jit
def clamp_lse_rows(y_ptr, z_ptr, t, lo, hi, M, N, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """z = logsumexp(clamp(t·y, lo, hi)) of BLOCK_R rows a program, float32-accurate, from logits y
    in float32 or bfloat16 (a bfloat16 model's cuBLAS output): the backward's z where its forward
    kept none. BLOCK_C columns a step, each step's (max, Σ exp(v − max)) merged into the row's
    running pair as ``merged_partials`` merges a GEMM's tiles'. A row holding a NaN t·y gets NaN,
    as torch.clamp keeps it and torch.logsumexp propagates it (the min and max here drop it)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < M
    cols = tl.arange(0, BLOCK_C)
    row_max = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_R,), tl.float32)
    nans = tl.zeros((BLOCK_R,), tl.int32)
    for start in range(0, N, BLOCK_C):
        mask = row_ok[:, None] & (start + cols < N)[None, :]
        y = tl.load(y_ptr + rows[:, None].to(tl.int64) * N + start + cols[None, :], mask=mask, other=0.0)
        scaled = y.to(tl.float32) * t
        nans += tl.sum((scaled != scaled).to(tl.int32), axis=1)
        v = tl.where(mask, tl.minimum(tl.maximum(scaled, lo), hi), float("-inf"))
        new_max = tl.where(row_ok, tl.maximum(row_max, tl.max(v, axis=1)), 0.0)
        total = total * exp_nonpositive(row_max - new_max) + tl.sum(exp_nonpositive(v - new_max[:, None]), axis=1)
        row_max = new_max
    tl.store(z_ptr + rows, tl.where(nans > 0, float("nan"), row_max + tl.log(total)), mask=row_ok)


@triton.jit
def clamp_lse_backward(y_ptr, z_ptr, g_ptr, dy_ptr, dyt_ptr, part_ptr, t, lo, hi, M, N, BLOCK_R: tl.constexpr,
                       BLOCK_C: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, SUMS: tl.constexpr):
    """One (BLOCK_R × BLOCK_C) tile of ∂L/∂y = g·h'(z)·t · exp(clamp(t·y) − z)·[lo ≤ t·y ≤ hi], with
    h'(z) = 2z·tanh(sp(z)) + z²·(1 − tanh²(sp(z)))·σ(z) per row, stored as ``store_gradient`` says."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < M
    scale, z = output_scale(z_ptr, g_ptr, rows, row_ok, t)
    mask = row_ok[:, None] & (cols < N)[None, :]
    v = tl.load(y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], mask=mask, other=0.0).to(tl.float32) * t
    inside = (v >= lo) & (v <= hi)
    dy = tl.where(inside, exp_nonpositive(tl.minimum(tl.maximum(v, lo), hi) - z[:, None]) * scale[:, None], 0.0)
    store_gradient(dy, rows, cols, M, N, dy_ptr, dyt_ptr, part_ptr, ROWS, COLS, SUMS)


@triton.jit
def clamp_lse_backward_from_q(q_ptr, part_max_ptr, z_ptr, g_ptr, dy_ptr, dyt_ptr, part_ptr, t, M, N, PARTS, TILE_N,
                              BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                              SUMS: tl.constexpr):
    """``clamp_lse_backward`` from what the bf16 forward saved instead of the logits: q = exp(c − m)
    (0 where clamped) with m the max of the row over its forward tile of TILE_N columns
    (``part_max``, PARTS per row), so exp(c − z)·[inside] = q·exp(m − z), m ≤ z. BLOCK_C divides
    TILE_N, so a program's columns share one m per row: a factor per row, one product per entry
    (an m gathered per entry made this pass 2.7x slower on an H100)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    first = tl.program_id(1) * BLOCK_C
    cols = first + tl.arange(0, BLOCK_C)
    row_ok = rows < M
    scale, z = output_scale(z_ptr, g_ptr, rows, row_ok, t)
    m = tl.load(part_max_ptr + rows * PARTS + first // TILE_N, mask=row_ok, other=0.0)
    factor = exp_nonpositive(tl.minimum(m - z, 0.0)) * scale
    mask = row_ok[:, None] & (cols < N)[None, :]
    q = tl.load(q_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # q == 0 where clamped: a 0 there even in a row whose z or g is NaN, as clamp's own backward gives
    store_gradient(tl.where(q != 0.0, q * factor[:, None], 0.0), rows, cols, M, N, dy_ptr, dyt_ptr, part_ptr,
                   ROWS, COLS, SUMS)
