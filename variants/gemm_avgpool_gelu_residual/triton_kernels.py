"""Triton kernels of ``gemm_avgpool_gelu_residual``'s backward (the forwards are CUDA: cuda_fused.py).

The backward is memory-bound: read x and g once, write dW (out × in, every row alike), and dx
if x needs it (gradients.py has the algebra). Two passes:

``row_gradients``: one program per ``ROWS`` rows. First over the rows' columns: Σ g, and r = x·w̄ + c
unless the forward saved r (HAVE_R), so dr = gelu'(r)·Σ g per row; then over them again the rows'
share of drᵀ·x into one row of partial sums, and dx = dr ⊗ w̄ where x needs it. With r saved, x
is read once from memory; without it x is read twice, and the second read misses L2 at the
default shape (every resident program's rows together outgrow it): 0.082 ms against 0.057 with r
saved, on an H100 at (2048, 8192, 8192).

``weight_gradient``: per column tile, the partial sums merged (v = drᵀ·x / out), then v written
to its share of dW's rows; the programs of the first column tile also write db = Σ dr / out
(and dsubtract = −db) for the same rows. Each program merges the partials again, from L2: a
sixteenth of what it writes at the default blocks, against a third pass and launch.

A bfloat16 model's x and g are loaded as float32 and its dx stored in bfloat16; every sum, dr and
the partials are float32, and dW, db, dsubtract are stored in the parameters' dtype, rounded to
bfloat16 for a bfloat16 model's (``to_store``). Stored in float32, autograd cast them after: at
(2048, 8192, 8192) a 402 MB copy of dW, 0.138 ms of a 0.319 ms step, with dW's float32 writes
twice the bytes (H100).
"""

import triton
import triton.language as tl

from autofuse.kernels.triton.epilogue import chunk_sums, gelu_grad, to_store


@triton.jit
def row_gradients(x_ptr, w_mean_ptr, offset_ptr, r_ptr, grad_ptr, dx_ptr, dr_ptr, part_ptr, M, K,
                  ROWS: tl.constexpr, BLOCK_K: tl.constexpr, HAVE_R: tl.constexpr, NEED_X: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    row_ok = rows < M
    base = rows.to(tl.int64)[:, None] * K
    r = tl.zeros((ROWS,), dtype=tl.float32)
    g_sum = tl.zeros((ROWS,), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols < K)[None, :]
        g = tl.load(grad_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g_sum += tl.sum(g, axis=1)
        if not HAVE_R:
            x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_mean_ptr + cols, mask=cols < K, other=0.0)
            r += tl.sum(x * w[None, :], axis=1)
    if HAVE_R:
        r = tl.load(r_ptr + rows, mask=row_ok, other=0.0)
    else:
        r += tl.load(offset_ptr)
    dr = tl.where(row_ok, gelu_grad(r) * g_sum, 0.0)  # rows past M add nothing below
    tl.store(dr_ptr + rows, dr, mask=row_ok)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(part_ptr + pid.to(tl.int64) * K + cols, tl.sum(dr[:, None] * x, axis=0), mask=cols < K)
        if NEED_X:
            w = tl.load(w_mean_ptr + cols, mask=cols < K, other=0.0)
            tl.store(dx_ptr + base + cols[None, :], (dr[:, None] * w[None, :]).to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def weight_gradient(part_ptr, dr_ptr, dw_ptr, db_ptr, ds_ptr, PARTS, M, K, N_OUT, OUT_CHUNK, inv_n,
                    BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_O: tl.constexpr,
                    NEED_W: tl.constexpr, NEED_B: tl.constexpr, NEED_S: tl.constexpr):
    pid_k = tl.program_id(0)
    first = tl.program_id(1) * OUT_CHUNK
    last = tl.minimum(first + OUT_CHUNK, N_OUT)
    if NEED_W:
        cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        v, _ = chunk_sums(part_ptr, part_ptr, cols, cols < K, K, PARTS, BLOCK_P, BLOCK_K, True)
        tile = to_store(tl.zeros((BLOCK_O, BLOCK_K), dtype=tl.float32) + (v * inv_n)[None, :], dw_ptr)
        for o0 in range(first, last, BLOCK_O):
            o = o0 + tl.arange(0, BLOCK_O)
            mask = (o < last)[:, None] & (cols < K)[None, :]
            tl.store(dw_ptr + o.to(tl.int64)[:, None] * K + cols[None, :], tile, mask=mask)
    if (NEED_B or NEED_S) and pid_k == 0:
        total = tl.zeros((BLOCK_P,), dtype=tl.float32)
        for m0 in range(0, M, BLOCK_P):
            m = m0 + tl.arange(0, BLOCK_P)
            total += tl.load(dr_ptr + m, mask=m < M, other=0.0)
        db = tl.sum(total, axis=0) * inv_n  # −db rounds as db: round to nearest even is symmetric
        for o0 in range(first, last, BLOCK_P):
            o = o0 + tl.arange(0, BLOCK_P)
            if NEED_B:
                tl.store(db_ptr + o, to_store(tl.zeros((BLOCK_P,), dtype=tl.float32) + db, db_ptr), mask=o < last)
            if NEED_S:
                tl.store(ds_ptr + o, to_store(tl.zeros((BLOCK_P,), dtype=tl.float32) - db, ds_ptr), mask=o < last)
