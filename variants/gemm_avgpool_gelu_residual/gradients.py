"""Gradients of ``gemm_avgpool_gelu_residual`` for its fused variants (see ``autofuse.kernels.autograd``).

out = x.detach() + gelu(r)[:, None] with r = x·w̄ + c, w̄ = mean(W, 0), c = mean(b) − mean(subtract)
(the mean over out_features of the GEMM). With g = ∂L/∂out and dr = gelu'(r)·Σ_cols g (per row):
    dx = dr ⊗ w̄                               (the residual is detached: only the GEMV path)
    dW = (1/out) · 1 ⊗ (drᵀ·x)                 (every row of W alike: a GEMV, not a GEMM)
    db = (Σ dr / out)·1,  dsubtract = −db.
So the backward is two GEMVs and rank-one terms. Saved: x, w̄, c and r where the forward's
kernel computed it (else None, and r is recomputed by one GEMV). On CUDA two Triton passes do
all of it (triton_kernels.py): one reads g and x and leaves per-block partial sums of drᵀ·x
(and dx), the other merges them and writes dW, db and dsubtract, every row of them alike, as
fresh tensors autograd takes without a copy. Elsewhere (the CPU, float64) the torch formulas.
"""

from __future__ import annotations

import torch

from autofuse.kernels.autograd import FusedOp
from autofuse.kernels.triton.host import fused_kernels_apply, kernel_module

from ..matmul_gelu_softmax.gradients import gelu_grad

# row_gradients: rows per program, columns per step and warps; weight_gradient: columns per program,
# rows per store, and the programs per column tile (each writes out/OUT_SPLIT rows of dW).
# Chosen on an H100 at (2048, 8192, 8192) by timing each pass's block sizes, the first pass's, then
# the second's with the best first (fused_backward takes them as parameters for such a sweep). With
# bfloat16 x and g, both passes: 104.5 µs against 118.0 for (16, 1024, 8), 113.0 for (8, 1024, 8),
# 134.2 for (4, 1024, 8) and 130.5 for (8, 512, 4) (interleaved medians of ten configurations).
ROWS, ROW_BLOCK_K, ROW_WARPS = 8, 2048, 8
W_BLOCK_K, W_BLOCK_O, OUT_SPLIT = 64, 16, 4


def _kernels():
    """This problem's Triton kernels (triton_kernels.py), imported on first use: they import triton."""
    return kernel_module(".triton_kernels", __package__)


def backward(saved, grad, needs, n_out: int):
    """(dx, dW, db, dsubtract) per ``needs`` (inputs: x, weight, bias, subtract)."""
    x, w_mean, offset, r = saved
    if (x.shape[0] and fused_kernels_apply(w_mean, offset, *([] if r is None else [r]))
            and fused_kernels_apply(x, grad, dtypes=(torch.float32, torch.bfloat16))):  # a bfloat16 model's
        return fused_backward(x, w_mean, offset, r, grad, needs, n_out)
    return torch_backward(saved, grad, needs, n_out)


def torch_backward(saved, grad, needs, n_out: int):
    """``backward`` in torch operations, at w̄'s precision (float32, or float64 for float64 models);
    the parameters' gradients in x's dtype, as ``fused_backward`` gives them."""
    x, w_mean, offset, r = saved
    acc = w_mean.dtype
    r = torch.addmv(offset, x.to(acc), w_mean) if r is None else r.to(acc)
    dr = gelu_grad(r) * grad.to(acc).sum(dim=1)
    dx = (dr[:, None] * w_mean[None, :]).to(x.dtype) if needs[0] else None
    dw = (dr @ x.to(acc) / n_out).to(x.dtype).expand(n_out, -1) if needs[1] else None
    d_bias = (dr.sum() / n_out).to(x.dtype).expand(n_out) if needs[2] or needs[3] else None
    return dx, dw, (d_bias if needs[2] else None), (-d_bias if needs[3] else None)


def fused_backward(x, w_mean, offset, r, grad, needs, n_out: int, rows: int = ROWS, row_block_k: int = ROW_BLOCK_K,
                   row_warps: int = ROW_WARPS, w_block_k: int = W_BLOCK_K, w_block_o: int = W_BLOCK_O,
                   out_split: int = OUT_SPLIT):
    """``backward`` through the two Triton passes (contiguous; x and g float32 or bfloat16); the
    block sizes are parameters so that a sweep can time them (the defaults: ROWS and the others above)."""
    (m, k), device = x.shape, x.device
    kernels = _kernels()
    parts = -(-m // rows)
    dr = torch.empty(m, device=device)
    part = torch.empty(parts, k, device=device)
    dx = torch.empty_like(x) if needs[0] else None
    kernels.row_gradients[(parts,)](x, w_mean, offset, dr if r is None else r, grad, dr if dx is None else dx, dr,
                                    part, m, k, ROWS=rows, BLOCK_K=row_block_k, HAVE_R=r is not None,
                                    NEED_X=bool(needs[0]), num_warps=row_warps)
    # the parameters' dtype: x's (the variants take x in the weight's dtype)
    dw = torch.empty(n_out, k, device=device, dtype=x.dtype) if needs[1] else None
    db = torch.empty(n_out, device=device, dtype=x.dtype) if needs[2] else None
    ds = torch.empty(n_out, device=device, dtype=x.dtype) if needs[3] else None
    if dw is not None or db is not None or ds is not None:
        col_tiles = -(-k // w_block_k) if dw is not None else 1
        out_chunk = -(-n_out // out_split)
        spare = dr  # a pointer for the outputs not asked for (their stores are compiled out)
        kernels.weight_gradient[(col_tiles, -(-n_out // out_chunk))](
            part, dr, spare if dw is None else dw, spare if db is None else db, spare if ds is None else ds,
            parts, m, k, n_out, out_chunk, 1.0 / n_out, BLOCK_P=32, BLOCK_K=w_block_k, BLOCK_O=w_block_o,
            NEED_W=dw is not None, NEED_B=db is not None, NEED_S=ds is not None, num_warps=4)
    return dx, dw, db, ds


def fused_op(forward, precision: str, n_out: int) -> FusedOp:
    """The FusedOp of a forward ``(x, weight, bias, subtract, save)`` returning (out, (x, w̄, c, r or None))."""
    return FusedOp(forward, lambda saved, grad, needs: backward(saved, grad, needs, n_out), precision)
