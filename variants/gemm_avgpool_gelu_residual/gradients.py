"""Gradients of ``gemm_avgpool_gelu_residual`` for its fused variants (see ``autofuse.autograd``).

out = x.detach() + gelu(r)[:, None] with r = x·w̄ + c, w̄ = mean(W, 0), c = mean(b) − mean(subtract)
(the mean over out_features of the GEMM). With g = ∂L/∂out and dr = gelu'(r)·Σ_cols g (per row):
    dx = dr ⊗ w̄                               (the residual is detached: only the GEMV path)
    dW = (1/out) · 1 ⊗ (drᵀ·x)                 (every row of W alike: a GEMV, not a GEMM)
    db = (Σ dr / out)·1,  dsubtract = −db.
So the backward is two GEMVs and rank-one terms. Saved: x, w̄ and c (r is recomputed by one
GEMV, reading x once).
"""

from __future__ import annotations

import torch

from autofuse.autograd import FusedOp

from ..matmul_gelu_softmax.gradients import gelu_grad


def backward(saved, grad, needs, n_out: int):
    """(dx, dW, db, dsubtract) per ``needs`` (inputs: x, weight, bias, subtract)."""
    x, w_mean, offset = saved
    acc = w_mean.dtype
    r = torch.addmv(offset, x.to(acc), w_mean)
    dr = gelu_grad(r) * grad.to(acc).sum(dim=1)
    dx = (dr[:, None] * w_mean[None, :]).to(x.dtype) if needs[0] else None
    dw = (dr @ x.to(acc) / n_out).expand(n_out, -1) if needs[1] else None
    d_bias = (dr.sum() / n_out).expand(n_out) if needs[2] or needs[3] else None
    return dx, dw, (d_bias if needs[2] else None), (-d_bias if needs[3] else None)


def fused_op(forward, precision: str, n_out: int) -> FusedOp:
    """The FusedOp of a forward ``(x, weight, bias, subtract, save)`` returning (out, (x, w̄, c))."""
    return FusedOp(forward, lambda saved, grad, needs: backward(saved, grad, needs, n_out), precision)
