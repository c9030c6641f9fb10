"""Triton kernels of ``gemm_bn`` (imported by triton_gemm.py when it is built).

The GEMM is the shared main loop (``persistent_gemm``) with one of two epilogues.
Eval: ``affine`` applies out = z·k + shift per column to the accumulator in registers.
Training: ``column_partials`` computes, per column and row tile, the tile's (mean, M2)
from a two-pass over the accumulator (tile mean, then Σ(z − mean)²; rows past the batch
excluded) and stores z less its tile's mean (in z's dtype: float32, or bfloat16 under bf16).
``bn_finish`` merges a column's tiles with Chan's parallel update (stable at any mean; never
E[z²] − E[z]²), writes σ² (biased) and coef = s·γ/√(s²σ² + eps), turns the tile means into
shifts (tile mean − μ, in place: z − μ = stored z + its tile's shift), and updates the running
statistics as nn.BatchNorm1d does. ``bn_normalize`` writes (z − μ)·coef + β.
The passes over z take rows in blocks that lie within one row tile (TILE_ROWS a multiple of
BLOCK_R, or one tile), so each loads one row of shifts (``block_shift``).
A bfloat16 model's parameters, running statistics and g are loaded as float32; its output and
running statistics are stored back in bfloat16.
Eval mode with a gradient (cuBLAS's z): ``eval_terms`` takes k, shift and r from the parameters,
``eval_apply`` writes the output; its backward pass is ``eval_grad_sums``, then
``eval_param_grads`` adds the chunks' sums into the parameters' gradients.
``column_grad_sums`` and ``bn_backward`` are the training backward's two passes, with
``bn_grad_coefficients`` between them (gradients.py); where the forward kept no statistics
(cuBLAS's z), ``column_grad_stats`` is the first pass and takes them from z in the same read.
"""

import triton
import triton.language as tl

from autofuse.kernels.triton.epilogue import bfloat16_round, chunk_sums, chunk_tile, store_gradient, to_store


@triton.jit
def affine(acc, rm, rn, row_ok, col_ok, pid_m, pid_n, num_n, M, N, args):
    """Eval's epilogue (``persistent_gemm``): out = z·k + shift per column; z itself too where
    a gradient needs it (z_ptr not None). args: (k_ptr, shift_ptr, out_ptr, z_ptr)."""
    k_ptr, shift_ptr, out_ptr, z_ptr = args
    k = tl.load(k_ptr + rn, mask=col_ok, other=0.0)
    shift = tl.load(shift_ptr + rn, mask=col_ok, other=0.0)
    offsets = rm[:, None].to(tl.int64) * N + rn[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(out_ptr + offsets, (acc * k[None, :] + shift[None, :]).to(out_ptr.dtype.element_ty), mask=mask)
    if z_ptr is not None:
        tl.store(z_ptr + offsets, acc, mask=mask)


@triton.jit
def column_partials(acc, rm, rn, row_ok, col_ok, pid_m, pid_n, num_n, M, N, args):
    """Training's epilogue (``persistent_gemm``): the tile's (mean, M2) per column into row pid_m
    of the partials, and z less its tile's mean. args: (z_ptr, part_mean_ptr, part_m2_ptr,
    bias_ptr, scale_ptr), the last two a bfloat16 model's (else None): its z is taken as its
    bfloat16 reference stores y (``bfloat16_model_z``) and stored rounded to nearest in bits
    (``to_store``). A float32 model's bfloat16 z under bf16 keeps the plain conversion, whose
    truncation on the CPU puts the scale's gradient (an eps-sized difference) at 0.009 of float64
    in ``bn_without_running_stats`` where rounding to nearest, as the GPU stores it, puts it at
    0.031 (bf16's bound: 0.015)."""
    z_ptr, part_mean_ptr, part_m2_ptr, bias_ptr, scale_ptr = args
    if scale_ptr is not None:
        acc = bfloat16_model_z(acc, bias_ptr, scale_ptr, rn, col_ok)
    BLOCK_M: tl.constexpr = acc.shape[0]
    rows = tl.minimum(M - pid_m * BLOCK_M, BLOCK_M).to(tl.float32)
    tile_mean = tl.sum(tl.where(row_ok[:, None], acc, 0.0), axis=0) / rows
    centred = tl.where(row_ok[:, None], acc - tile_mean[None, :], 0.0)
    tl.store(part_mean_ptr + pid_m * N + rn, tile_mean, mask=col_ok)
    tl.store(part_m2_ptr + pid_m * N + rn, tl.sum(centred * centred, axis=0), mask=col_ok)
    if scale_ptr is not None:  # a bfloat16 model's z (bfloat16): rounded to nearest on the CPU too
        centred = bfloat16_round(centred)
    tl.store(z_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], centred.to(z_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def column_batchnorm(acc, rm, rn, row_ok, col_ok, pid_m, pid_n, num_n, M, N, args):
    """Training's epilogue where one row tile holds the whole batch (M ≤ BLOCK_M): the tile's
    columns are the batch's, so their statistics, the running statistics' update and the
    normalised output are all made here, from the float32 accumulator, in one launch (the
    partials, ``bn_finish`` and ``bn_normalize`` took three). As ``column_partials`` then
    ``bn_finish`` and ``bn_normalize`` with one row tile: (mean, M2) by a two-pass over the tile,
    var = M2/M, coef = s·γ/√(s²·var + eps), out = (z − μ)·coef + β; here z − μ is not rounded to
    z's dtype before it is normalised. With z_ptr (a gradient is needed) z − μ, a row of zero
    shifts and var are stored as the backward reads them. args: (out_ptr, z_ptr, shift_ptr,
    var_ptr, bias_ptr, scale_ptr, gamma_ptr, beta_ptr, running_mean_ptr, running_var_ptr, eps,
    factor, count_ptr); running_mean_ptr None: no running statistics; count_ptr (BatchNorm's
    num_batches_tracked, or None where the host counts) gets this batch added by the tile of
    column block 0, the one tile that has it. A bfloat16 model (bfloat16 out) takes z
    as its reference stores y (``bfloat16_model_z``). Each tile's columns are its own, so a tile
    handed to it twice (the range check's exact pass) would update their running statistics twice:
    the launcher keeps it to the operand paths without one (not the float16 splits)."""
    (out_ptr, z_ptr, shift_ptr, var_ptr, bias_ptr, scale_ptr, gamma_ptr, beta_ptr, running_mean_ptr,
     running_var_ptr, eps, factor, count_ptr) = args
    if out_ptr.dtype.element_ty == tl.bfloat16:
        acc = bfloat16_model_z(acc, bias_ptr, scale_ptr, rn, col_ok)
    rows = tl.sum(row_ok.to(tl.float32), axis=0)  # M, as a float32 tensor (M itself may be a constant)
    mean = tl.sum(tl.where(row_ok[:, None], acc, 0.0), axis=0) / rows
    centred = tl.where(row_ok[:, None], acc - mean[None, :], 0.0)
    m2 = tl.sum(centred * centred, axis=0)
    var = m2 / rows
    scale = tl.load(scale_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)
    gamma = tl.load(gamma_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)
    coef = scale * gamma / tl.sqrt(scale * scale * var + eps)
    offsets = rm[:, None].to(tl.int64) * N + rn[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(out_ptr + offsets, to_store(centred * coef[None, :] + beta[None, :], out_ptr), mask=mask)
    if z_ptr is not None:
        if out_ptr.dtype.element_ty == tl.bfloat16:  # as column_partials stores a bfloat16 model's z
            centred = bfloat16_round(centred)
        tl.store(z_ptr + offsets, centred.to(z_ptr.dtype.element_ty), mask=mask)
        tl.store(shift_ptr + rn, tl.zeros_like(mean), mask=col_ok)
        tl.store(var_ptr + rn, var, mask=col_ok)
    if running_mean_ptr is not None:  # y = (z + b)·s: mean s·(μ + b), unbiased variance s²·σ²·n/(n − 1)
        bias = tl.load(bias_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)
        running_mean = tl.load(running_mean_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)
        running_var = tl.load(running_var_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)
        new_mean = running_mean + factor * (scale * (mean + bias) - running_mean)
        new_var = running_var + factor * (scale * scale * m2 / (rows - 1.0) - running_var)
        tl.store(running_mean_ptr + rn, new_mean.to(running_mean_ptr.dtype.element_ty), mask=col_ok)
        tl.store(running_var_ptr + rn, new_var.to(running_var_ptr.dtype.element_ty), mask=col_ok)
    if count_ptr is not None:
        if pid_n == 0:
            tl.store(count_ptr, tl.load(count_ptr) + 1)


@triton.jit
def bfloat16_model_z(acc, bias_ptr, scale_ptr, rn, col_ok):
    """A bfloat16 model's z: y2 = bfloat16(bfloat16(z + b)·s), where its reference stores linear's
    output and x·s, taken back to z's terms, y2/s − b, which the batch statistics and the output
    then see (a scale of 0 keeps z: its column's output is β either way). The float32-exact z is
    closer to float64 (0.030 against the reference's 0.065 at 16384 × 4096² on KernelBench's rand
    inputs, H100), but KernelBench's harness compares with the bfloat16 reference at atol = rtol =
    1e-2, which those two roundings, scaled up by BatchNorm's 1/σ (a column's mean is 3-5 times its
    spread there), put 0.0625 from the float32-exact output. The backward differentiates through
    them as the reference's autograd does, as if they were not there."""
    b = tl.load(bias_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)
    s = tl.load(scale_ptr + rn, mask=col_ok, other=1.0).to(tl.float32)
    # a reciprocal per column, not a division per element: y2·(1/s) is within a float32 step of y2/s
    inverse = tl.where(s != 0.0, 1.0 / s, 0.0)[None, :]
    b, s = b[None, :], s[None, :]
    y2 = bfloat16_round(bfloat16_round(acc + b) * s)
    return tl.where(s != 0.0, y2 * inverse - b, acc)


@triton.jit
def bn_finish(part_mean_ptr, part_m2_ptr, var_ptr, coef_ptr, bias_ptr, scale_ptr, gamma_ptr,
              running_mean_ptr, running_var_ptr, eps, factor, M, N, TILE_M, NUM_M,
              BLOCK_C: tl.constexpr, UPDATE: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = cols < N
    count = tl.zeros((BLOCK_C,), dtype=tl.float32)
    mean = tl.zeros((BLOCK_C,), dtype=tl.float32)
    m2 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for i in range(0, NUM_M):
        rows = tl.minimum(M - i * TILE_M, TILE_M).to(tl.float32)
        tile_mean = tl.load(part_mean_ptr + i * N + cols, mask=ok, other=0.0)
        tile_m2 = tl.load(part_m2_ptr + i * N + cols, mask=ok, other=0.0)
        total = count + rows
        delta = tile_mean - mean
        mean += delta * (rows / total)
        m2 += tile_m2 + delta * delta * (count * rows / total)
        count = total
    var = m2 / M
    scale = tl.load(scale_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    gamma = tl.load(gamma_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    for i in range(0, NUM_M):  # the tile means become the shifts of the stored z
        tile_mean = tl.load(part_mean_ptr + i * N + cols, mask=ok, other=0.0)
        tl.store(part_mean_ptr + i * N + cols, tile_mean - mean, mask=ok)
    tl.store(var_ptr + cols, var, mask=ok)
    tl.store(coef_ptr + cols, scale * gamma / tl.sqrt(scale * scale * var + eps), mask=ok)
    if UPDATE:  # y = (z + b)·s: mean s·(μ + b), unbiased variance s²·σ²·n/(n − 1)
        bias = tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        running_mean = tl.load(running_mean_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        running_var = tl.load(running_var_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        unbiased = scale * scale * m2 / (M - 1)
        new_mean = running_mean + factor * (scale * (mean + bias) - running_mean)
        new_var = running_var + factor * (unbiased - running_var)
        tl.store(running_mean_ptr + cols, new_mean.to(running_mean_ptr.dtype.element_ty), mask=ok)
        tl.store(running_var_ptr + cols, new_var.to(running_var_ptr.dtype.element_ty), mask=ok)


@triton.jit
def block_shift(shift_ptr, cols, col_ok, N, TILE_ROWS, BLOCK_R: tl.constexpr):
    """The shifts (z − μ = stored z + shift) of this program's block of rows, which lies in one row
    tile of TILE_ROWS rows: that tile's row of the (row tiles × N) shift matrix."""
    return tl.load(shift_ptr + (tl.program_id(0) * BLOCK_R // TILE_ROWS) * N + cols, mask=col_ok, other=0.0)


@triton.jit
def bn_normalize(z_ptr, out_ptr, shift_ptr, coef_ptr, beta_ptr, M, N, TILE_ROWS,
                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < N
    shift = block_shift(shift_ptr, cols, col_ok, N, TILE_ROWS, BLOCK_R)
    coef = tl.load(coef_ptr + cols, mask=col_ok, other=0.0)
    beta = tl.load(beta_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
    mask = (rows < M)[:, None] & col_ok[None, :]
    z = tl.load(z_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    out = (z + shift[None, :]) * coef[None, :] + beta[None, :]
    tl.store(out_ptr + offsets, to_store(out, out_ptr), mask=mask)


@triton.jit
def row_major_tile(M, N, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's BLOCK_R × BLOCK_C tile of a row-major M × N matrix: its rows, its columns,
    which columns lie inside, the tile's mask and its elements' offsets."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < N
    return rows, cols, col_ok, (rows < M)[:, None] & col_ok[None, :], rows[:, None].to(tl.int64) * N + cols[None, :]


@triton.jit
def column_grad_sums(grad_ptr, z_ptr, shift_ptr, part_g_ptr, part_gc_ptr, M, N, TILE_ROWS,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Per chunk of BLOCK_R rows: Σ g and Σ g·(z − μ) for BLOCK_C columns (the caller adds the
    chunks: deterministic, where atomics would add in any order)."""
    rows, cols, col_ok, mask, offsets = row_major_tile(M, N, BLOCK_R, BLOCK_C)
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    shift = block_shift(shift_ptr, cols, col_ok, N, TILE_ROWS, BLOCK_R)
    centred = tl.load(z_ptr + offsets, mask=mask, other=0.0).to(tl.float32) + shift[None, :]
    tl.store(part_g_ptr + tl.program_id(0) * N + cols, tl.sum(grad, axis=0), mask=col_ok)
    tl.store(part_gc_ptr + tl.program_id(0) * N + cols, tl.sum(tl.where(mask, grad * centred, 0.0), axis=0), mask=col_ok)


@triton.jit
def column_grad_stats(grad_ptr, z_ptr, part_g_ptr, part_gc_ptr, part_ref_ptr, part_m2_ptr, part_r_ptr, M, N,
                      CHUNK_ROWS, SUB_ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    """``column_grad_sums`` where the forward kept no statistics (cuBLAS's z): z's own taken in the
    same read. Per chunk of CHUNK_ROWS rows (a multiple of SUB_ROWS), read SUB_ROWS at a time
    and summed across rows once at the end (a sum across rows is a trip through shared memory),
    about a per-column reference k, the mean of the chunk's first SUB_ROWS rows as float32
    rounds it: Σ g, Σ g·(z − k), k, Σ(z − k)² and Σ(z − k) (not 0: k is not the chunk's exact
    mean), which ``merged_statistics`` merges exactly. k from the data's own rows keeps the sums
    of squares near the spread (a far outlier moves it by 1/SUB_ROWS of its distance), where
    z's magnitude alone would round them away."""
    start = tl.program_id(0) * CHUNK_ROWS
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < N
    rows = start + tl.arange(0, SUB_ROWS)
    mask = (rows < M)[:, None] & col_ok[None, :]
    offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    ref = tl.sum(z, axis=0) / tl.minimum(M - start, SUB_ROWS).to(tl.float32)  # rows past M load as 0
    d = tl.where(mask, z - ref[None, :], 0.0)
    sum_g, sum_gd, sum_d, sum_dd = grad, grad * d, d, d * d
    for offset in range(SUB_ROWS, CHUNK_ROWS, SUB_ROWS):
        rows = start + offset + tl.arange(0, SUB_ROWS)
        mask = (rows < M)[:, None] & col_ok[None, :]
        offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
        grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        d = tl.where(mask, tl.load(z_ptr + offsets, mask=mask, other=0.0).to(tl.float32) - ref[None, :], 0.0)
        sum_g += grad
        sum_gd += grad * d
        sum_d += d
        sum_dd += d * d
    chunk = tl.program_id(0) * N + cols
    tl.store(part_g_ptr + chunk, tl.sum(sum_g, axis=0), mask=col_ok)
    tl.store(part_gc_ptr + chunk, tl.sum(sum_gd, axis=0), mask=col_ok)
    tl.store(part_ref_ptr + chunk, ref, mask=col_ok)
    tl.store(part_m2_ptr + chunk, tl.sum(sum_dd, axis=0), mask=col_ok)
    tl.store(part_r_ptr + chunk, tl.sum(sum_d, axis=0), mask=col_ok)


@triton.jit
def chunk_block(start, cols, ok, M, N, CHUNKS, CHUNK_ROWS, BLOCK_P: tl.constexpr):
    """``chunk_tile``'s mask and offsets, and the chunks' rows (n_c: CHUNK_ROWS, fewer for the last
    chunk) as a column."""
    mask, offsets = chunk_tile(start, cols, ok, N, CHUNKS, BLOCK_P)
    chunks = start + tl.arange(0, BLOCK_P)
    return mask, offsets, tl.minimum(M - chunks * CHUNK_ROWS, CHUNK_ROWS).to(tl.float32)[:, None]


@triton.jit
def merged_statistics(part_g_ptr, part_gc_ptr, part_ref_ptr, part_m2_ptr, part_r_ptr, cols, ok, M, N, CHUNKS,
                      CHUNK_ROWS, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """(μ, σ² biased, C = Σ g·(z − μ)) per column from ``column_grad_stats``'s chunks (n_c rows
    each: CHUNK_ROWS but the last), exactly as the algebra merges sums about any reference k_c,
    so no rounding of k_c reaches σ²: with d_c = k_c − μ and R_c = Σ(z − k_c),
    Σ(z − μ)² = Σ_c M2_c + 2·d_c·R_c + n_c·d_c² and C = Σ_c C_c + d_c·S_c (Chan's update; never
    E[z²] − E[z]²). The references are taken about the first chunk's, so a large common offset of
    z cancels (k_c − k_0 is exact) before anything is summed: μ − k_0 = Σ_c (n_c·(k_c − k_0) + R_c) / n."""
    first = tl.load(part_ref_ptr + cols, mask=ok, other=0.0)
    total = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for start in range(0, CHUNKS, BLOCK_P):
        mask, offsets, count = chunk_block(start, cols, ok, M, N, CHUNKS, CHUNK_ROWS, BLOCK_P)
        d = tl.load(part_ref_ptr + offsets, mask=mask, other=0.0) - first[None, :]
        total += tl.sum(tl.where(mask, count * d + tl.load(part_r_ptr + offsets, mask=mask, other=0.0), 0.0), axis=0)
    mean_d = total / M  # μ − k_0
    m2 = tl.zeros((BLOCK_C,), dtype=tl.float32)
    sum_gc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for start in range(0, CHUNKS, BLOCK_P):
        mask, offsets, count = chunk_block(start, cols, ok, M, N, CHUNKS, CHUNK_ROWS, BLOCK_P)
        d = tl.load(part_ref_ptr + offsets, mask=mask, other=0.0) - first[None, :]
        d = tl.where(mask, d - mean_d[None, :], 0.0)  # k_c − μ
        residual = tl.load(part_r_ptr + offsets, mask=mask, other=0.0)
        m2 += tl.sum(tl.load(part_m2_ptr + offsets, mask=mask, other=0.0) + d * (2.0 * residual + count * d), axis=0)
        sum_gc += tl.sum(tl.load(part_gc_ptr + offsets, mask=mask, other=0.0)
                         + d * tl.load(part_g_ptr + offsets, mask=mask, other=0.0), axis=0)
    return first + mean_d, m2 / M, sum_gc


@triton.jit
def bn_grad_coefficients(part_g_ptr, part_gc_ptr, part_ref_ptr, part_m2_ptr, part_r_ptr, var_ptr, shift_ptr, scale_ptr,
                         gamma_ptr, coef_ptr, eps, M, N, CHUNKS, CHUNK_ROWS,
                         BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, STATS: tl.constexpr):
    """Per column, from ``column_grad_sums``'s chunks: S = Σ g and C = Σ g·(z − μ) (each a sum of
    BLOCK_P-chunk tree sums), r = 1/√(s²σ² + eps), and into coef's six rows: a = sγr,
    b = −a·S/n, c = −a·s²r²·C/n (``bn_backward``'s), then ds = γ·eps·r³·C, dγ = s·r·C and dβ = S:
    one launch where torch took a dozen small ones. With STATS, μ, σ² and C come from the chunks'
    statistics (``merged_statistics``), and σ² and the shift −μ are written to var_ptr and
    shift_ptr for ``bn_backward``; else σ² is read from var_ptr."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = cols < N
    sum_g, sum_gc = chunk_sums(part_g_ptr, part_gc_ptr, cols, ok, N, CHUNKS, BLOCK_P, BLOCK_C, STATS)
    if STATS:
        mean, var, sum_gc = merged_statistics(part_g_ptr, part_gc_ptr, part_ref_ptr, part_m2_ptr, part_r_ptr, cols, ok,
                                              M, N, CHUNKS, CHUNK_ROWS, BLOCK_P, BLOCK_C)
        tl.store(var_ptr + cols, var, mask=ok)
        tl.store(shift_ptr + cols, -mean, mask=ok)
    else:
        var = tl.load(var_ptr + cols, mask=ok, other=0.0)
    scale = tl.load(scale_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    gamma = tl.load(gamma_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(scale * scale * var + eps)
    inv_n = 1.0 / M
    a = scale * gamma * r
    tl.store(coef_ptr + cols, a, mask=ok)
    tl.store(coef_ptr + N + cols, -a * sum_g * inv_n, mask=ok)
    tl.store(coef_ptr + 2 * N + cols, -a * scale * scale * r * r * sum_gc * inv_n, mask=ok)
    tl.store(coef_ptr + 3 * N + cols, gamma * eps * r * r * r * sum_gc, mask=ok)
    tl.store(coef_ptr + 4 * N + cols, scale * r * sum_gc, mask=ok)
    tl.store(coef_ptr + 5 * N + cols, sum_g, mask=ok)


@triton.jit
def bn_backward(grad_ptr, z_ptr, shift_ptr, a_ptr, b_ptr, c_ptr, dy_ptr, dyt_ptr, part_ptr, M, N, TILE_ROWS,
                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                SUMS: tl.constexpr):
    """dz = a·g + b + c·(z − μ) per column (a = sγr, b = −sγr·S/n, c = −sγr·s²r²·C/n), stored as
    ``store_gradient`` says."""
    rows, cols, col_ok, mask, offsets = row_major_tile(M, N, BLOCK_R, BLOCK_C)
    a = tl.load(a_ptr + cols, mask=col_ok, other=0.0)[None, :]
    b = tl.load(b_ptr + cols, mask=col_ok, other=0.0)[None, :]
    c = tl.load(c_ptr + cols, mask=col_ok, other=0.0)[None, :]
    shift = block_shift(shift_ptr, cols, col_ok, N, TILE_ROWS, BLOCK_R)
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    store_gradient(a * grad + b + c * (z + shift[None, :]), rows, cols, M, N, dy_ptr, dyt_ptr, part_ptr, ROWS, COLS, SUMS)


@triton.jit
def eval_grad_sums(grad_ptr, z_ptr, k_ptr, dy_ptr, dyt_ptr, part_gz_ptr, part_g_ptr, M, N,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Eval mode's backward pass: dz = g·k stored as ``store_gradient`` says, and per chunk of
    BLOCK_R rows Σ g·z and Σ g (the caller adds the chunks)."""
    rows, cols, col_ok, mask, offsets = row_major_tile(M, N, BLOCK_R, BLOCK_C)
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + cols, mask=col_ok, other=0.0)
    store_gradient(grad * k[None, :], rows, cols, M, N, dy_ptr, dyt_ptr, part_g_ptr, ROWS, COLS, False)
    chunk = tl.program_id(0) * N + cols
    tl.store(part_gz_ptr + chunk, tl.sum(grad * z, axis=0), mask=col_ok)
    tl.store(part_g_ptr + chunk, tl.sum(grad, axis=0), mask=col_ok)


@triton.jit
def eval_terms(bias_ptr, scale_ptr, gamma_ptr, beta_ptr, mean_ptr, var_ptr, terms_ptr, eps, N,
               BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_GAMMA: tl.constexpr, HAS_BETA: tl.constexpr):
    """Eval mode's per-column k, shift and r into terms' three rows, in float32 (the operations of
    ``gradients.eval_affine``, in its order): one launch where torch took a dozen."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = cols < N
    r = 1.0 / tl.sqrt(tl.load(var_ptr + cols, mask=ok, other=1.0).to(tl.float32) + eps)
    inv_std = r * tl.load(gamma_ptr + cols, mask=ok, other=0.0).to(tl.float32) if HAS_GAMMA else r
    k = tl.load(scale_ptr + cols, mask=ok, other=0.0).to(tl.float32) * inv_std
    shift = -tl.load(mean_ptr + cols, mask=ok, other=0.0).to(tl.float32) * inv_std
    if HAS_BIAS:
        shift += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32) * k
    if HAS_BETA:
        shift += tl.load(beta_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(terms_ptr + cols, k, mask=ok)
    tl.store(terms_ptr + N + cols, shift, mask=ok)
    tl.store(terms_ptr + 2 * N + cols, r, mask=ok)


@triton.jit
def eval_apply(z_ptr, k_ptr, shift_ptr, out_ptr, M, N, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Eval mode's output from z (cuBLAS's, float32 or a bfloat16 model's): z·k + shift per column in
    float32, stored in out's dtype (``to_store``: a bfloat16 model's rounded once)."""
    rows, cols, col_ok, mask, offsets = row_major_tile(M, N, BLOCK_R, BLOCK_C)
    z = tl.load(z_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + cols, mask=col_ok, other=0.0)
    shift = tl.load(shift_ptr + cols, mask=col_ok, other=0.0)
    out = z * k[None, :] + shift[None, :]
    tl.store(out_ptr + offsets, to_store(out, out_ptr), mask=mask)


@triton.jit
def eval_param_grads(part_gz_ptr, part_g_ptr, k_ptr, r_ptr, bias_ptr, scale_ptr, gamma_ptr, mean_ptr, grads_ptr,
                     N, CHUNKS, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr,
                     HAS_GAMMA: tl.constexpr):
    """Eval mode's parameter gradients from ``eval_grad_sums``'s chunks, dk = Σ g·z and
    dshift = Σ g, into grads' four rows (db, ds, dγ, dβ; see gradients.py), in the parameters'
    dtype: one launch where torch took a dozen, and the casts autograd adds for a bfloat16 model's."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = cols < N
    dk, dshift = chunk_sums(part_gz_ptr, part_g_ptr, cols, ok, N, CHUNKS, BLOCK_P, BLOCK_C, False)
    k = tl.load(k_ptr + cols, mask=ok, other=0.0)
    r = tl.load(r_ptr + cols, mask=ok, other=0.0)
    scale = tl.load(scale_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    offset = -tl.load(mean_ptr + cols, mask=ok, other=0.0).to(tl.float32)  # b·s − running mean
    dk_biased = dk  # dk + b·dshift, ds's factor
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        offset += bias * scale
        dk_biased += bias * dshift
    gamma_r = r * tl.load(gamma_ptr + cols, mask=ok, other=0.0).to(tl.float32) if HAS_GAMMA else r
    store_row(grads_ptr, cols, ok, k * dshift)
    store_row(grads_ptr + N, cols, ok, gamma_r * dk_biased)
    store_row(grads_ptr + 2 * N, cols, ok, r * (scale * dk + offset * dshift))
    store_row(grads_ptr + 3 * N, cols, ok, dshift)


@triton.jit
def store_row(ptr, cols, ok, value):
    """``value`` (float32) stored at ``ptr`` + cols in ptr's dtype (``to_store``)."""
    tl.store(ptr + cols, to_store(value, ptr), mask=ok)
