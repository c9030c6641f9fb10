"""Gradients of ``gemm_bn`` for its fused variants (see ``autofuse.autograd``).

Training (batch statistics). z = x·Wᵀ, μ and σ² its biased column statistics, y = (z + b)·s,
r = 1/√(s²σ² + eps), ŷ = s·(z − μ)·r, out = γ·ŷ + β. With g = ∂L/∂out and, per column,
S = Σ_rows g and C = Σ_rows g·(z − μ) (one reduction pass over g and z):
    ∂L/∂z = s·γ·r·(g − S/n − (z − μ)·s²·r²·C/n)     (BatchNorm's backward, chained through s)
    dγ = s·r·C,  dβ = S,  ds = γ·eps·r³·C,  db = 0
    dx = dz·W,  dW = dzᵀ·x.
db is exactly zero: the bias shifts every row of a column alike and the batch mean removes it.
ds comes from ∂ŷ/∂s = (z − μ)·eps·r³ (s cancels but for eps). The running statistics get no
gradient, as in PyTorch. Saved: x, the forward's GEMM weight operand, z (None where the forward
normalised it in place or never stored it: recomputed with one GEMM), μ and σ² (None: taken
from z again), s and γ.

Eval (running statistics). out = z·k + shift per column, with k = s·γ/√(running_var + eps) and
shift = (b·s − running_mean)·γ/√(running_var + eps) + β computed from the parameters by
``affine_coefficients`` in torch, so autograd carries dk and dshift on to s, γ, β and b:
    dz = g·k,  dk = Σ_rows g·z,  dshift = Σ_rows g.
Saved: x, the weight operand, z (None: recomputed) and k.
"""

from __future__ import annotations

import torch

from autofuse.autograd import FusedOp, backward_gemms, reduce_rows
from autofuse.precision import linear
from autofuse.triton_variant import fused_kernels_apply, problem_kernels


# Rows × columns per program of the backward's two Triton passes (512-byte rows).
BACKWARD_BLOCK = (64, 128)


def column_sums(grad: torch.Tensor, z: torch.Tensor, mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_rows g, Σ_rows g·(z − μ)) per column, accumulated in float32 or better: one pass of a
    Triton kernel over g and z where it can run (per-chunk sums, added here), else torch."""
    if fused_kernels_apply(grad, z, mean):
        rows, cols = BACKWARD_BLOCK
        chunks = -(-grad.shape[0] // rows)
        part_g = torch.empty(chunks, grad.shape[1], device=grad.device)
        part_gc = torch.empty_like(part_g)
        problem_kernels("gemm_bn").column_grad_sums[(chunks, -(-grad.shape[1] // cols))](
            grad, z, mean, part_g, part_gc, grad.shape[0], grad.shape[1], BLOCK_R=rows, BLOCK_C=cols)
        return part_g.sum(0), part_gc.sum(0)
    acc = torch.promote_types(grad.dtype, torch.float32)
    grad = grad.to(acc)
    return grad.sum(0), (grad * (z.to(acc) - mean)).sum(0)


def _bn_backward(grad, z, mean, a, b, c) -> torch.Tensor:
    """dz = a·g + b + c·(z − μ) with per-column a, b, c: one pass (a Triton kernel where it can run)."""
    if fused_kernels_apply(grad, z, mean, a, b, c):
        rows, cols = BACKWARD_BLOCK
        dz = torch.empty_like(grad)
        problem_kernels("gemm_bn").bn_backward[(-(-grad.shape[0] // rows), -(-grad.shape[1] // cols))](
            grad, z, mean, a, b, c, dz, grad.shape[0], grad.shape[1], BLOCK_R=rows, BLOCK_C=cols)
        return dz
    return a * grad + b + c * (z - mean)


def train_backward(saved, grad, needs, precision, eps: float):
    """(dx, dW, db, ds, dγ, dβ) per ``needs`` (inputs: x, weight, bias, scale, γ, β)."""
    x, weight, z, mean, var, scale, gamma = saved
    if z is None:
        z = linear(x, weight, None, precision)
    if mean is None:
        var, mean = torch.var_mean(z.to(torch.promote_types(z.dtype, torch.float32)), dim=0, correction=0)
    n = z.shape[0]
    r = torch.rsqrt(scale * scale * var + eps)
    gam = gamma if gamma is not None else torch.ones_like(r)
    sum_g, sum_gc = column_sums(grad, z, mean)
    a = scale * gam * r  # dz = a·(g − S/n − (z − μ)·s²r²·C/n), per column
    dz = _bn_backward(grad, z, mean, a, -a * sum_g / n, -a * scale * scale * r * r * sum_gc / n)
    dx, dw = backward_gemms(dz, x, weight, precision, needs[0], needs[1])
    db = torch.zeros_like(scale) if needs[2] else None
    ds = gam * eps * r ** 3 * sum_gc if needs[3] else None
    dgamma = scale * r * sum_gc if needs[4] else None
    dbeta = sum_g if needs[5] else None
    return dx, dw, db, ds, dgamma, dbeta


def eval_backward(saved, grad, needs, precision):
    """(dx, dW, dk, dshift) per ``needs`` (inputs: x, weight, k, shift)."""
    x, weight, z, k = saved
    if z is None:
        z = linear(x, weight, None, precision)
    dz = grad * k
    dx, dw = backward_gemms(dz, x, weight, precision, needs[0], needs[1])
    dk = reduce_rows(grad * z) if needs[2] else None
    dshift = reduce_rows(grad) if needs[3] else None
    return dx, dw, dk, dshift


def affine_coefficients(model) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, shift) of eval mode, out = z·k + shift, differentiable in the parameters (O(out) work)."""
    gemm, bn = model.gemm, model.bn
    inv_std = torch.rsqrt(bn.running_var + bn.eps)
    if bn.weight is not None:
        inv_std = inv_std * bn.weight
    k = model.scale * inv_std
    shift = -bn.running_mean * inv_std
    if gemm.bias is not None:
        shift = shift + gemm.bias * k
    if bn.bias is not None:
        shift = shift + bn.bias
    return k, shift


def train_op(forward, precision: str, eps: float) -> FusedOp:
    """The FusedOp of a training forward ``(x, weight, bias, scale, γ, β, save)`` returning
    (out, (x, weight operand, z or None, μ or None, σ² or None, scale, γ))."""
    return FusedOp(forward, lambda saved, grad, needs: train_backward(saved, grad, needs, precision, eps), precision)


def eval_op(forward, precision: str) -> FusedOp:
    """The FusedOp of an eval forward ``(x, weight, k, shift, save)`` returning
    (out, (x, weight operand, z or None, k))."""
    return FusedOp(forward, lambda saved, grad, needs: eval_backward(saved, grad, needs, precision), precision)


def torch_train_forward(precision, eps):
    """The training forward written in torch (no running-statistics update), for tests of the backward."""
    def forward(x, weight, bias, scale, gamma, beta, save):
        z = linear(x, weight, None, precision)
        var, mean = torch.var_mean(z, dim=0, correction=0)
        r = torch.rsqrt(scale * scale * var + eps)
        out = (z - mean) * (scale * r * (gamma if gamma is not None else 1.0))
        out = out + beta if beta is not None else out
        return out, (x, weight, z, mean, var, scale, gamma)
    return forward


def torch_eval_forward(precision):
    def forward(x, weight, k, shift, save):
        z = linear(x, weight, None, precision)
        return z * k + shift, (x, weight, z, k)
    return forward
