"""Gradients of ``gemm_bn`` for its fused variants (see ``autofuse.kernels.autograd``).

Training (batch statistics). z = x·Wᵀ, μ and σ² its biased column statistics, y = (z + b)·s,
r = 1/√(s²σ² + eps), ŷ = s·(z − μ)·r, out = γ·ŷ + β. With g = ∂L/∂out and, per column,
S = Σ_rows g and C = Σ_rows g·(z − μ) (one reduction pass over g and z, which also takes μ and
σ² where the forward saved none; then one small kernel for the per-column coefficients,
``bn_coefficients``):
    ∂L/∂z = s·γ·r·(g − S/n − (z − μ)·s²·r²·C/n)     (BatchNorm's backward, chained through s)
    dγ = s·r·C,  dβ = S,  ds = γ·eps·r³·C,  db = 0
    dx = dz·W,  dW = dzᵀ·x.
db is exactly zero: the bias shifts every row of a column alike and the batch mean removes it.
ds comes from ∂ŷ/∂s = (z − μ)·eps·r³ (s cancels but for eps). The running statistics get no
gradient, as in PyTorch. Saved: x, the forward's GEMM weight operand, z (None where the forward
normalised it in place or never stored it: recomputed with one GEMM), its shift and σ² (None:
taken from z again, in the backward's first pass), s and γ.

z as saved need not be z itself: z − μ = z_saved + shift[row // tile_rows], the shift a
(row tiles × N) matrix (``centred``). A plain z has one row, −μ. The Triton forward stores each
element less its row tile's mean (the shift is then tile mean − μ), and under bf16 in bfloat16:
its rounding is then 2⁻⁹ of z's spread about the tile mean, never of a large common offset, which
the mean's subtraction would turn into a large error in ŷ.

Eval (running statistics). out = z·k + shift per column, with r = 1/√(running_var + eps),
k = s·γ·r and shift = (b·s − running_mean)·γ·r + β, computed from the parameters outside
autograd (``eval_op``, with ``eval_terms``: one launch; torch's formula recorded a dozen autograd
nodes a call, each host time before the GPU had the step). With dk = Σ_rows g·z and
dshift = Σ_rows g (one pass over g and z, which also writes dz = g·k: ``eval_grad_sums``; the
chunks' sums added by ``eval_param_grads``, one launch for the four vectors below):
    db = k·dshift,  ds = γ·r·(dk + b·dshift),  dγ = r·(s·dk + (b·s − running_mean)·dshift),
    dβ = dshift,  dx = dz·W,  dW = dzᵀ·x.
The running statistics get no gradient, as in PyTorch. Saved: x, the weight operand, z (None:
recomputed), and the vectors above.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from autofuse.core.precision import linear
from autofuse.kernels.autograd import (
    CUBLAS,
    CublasGemms,
    FusedOp,
    GemmGrad,
    GradBuffers,
    GradLayouts,
    fused_call,
    reduce_rows,
)
from autofuse.kernels.triton.host import fused_kernels_apply, kernel_module

# Rows × columns per program of the backward's two Triton passes (512-byte rows).
BACKWARD_BLOCK = (64, 128)
# column_grad_stats: rows per chunk (a multiple of the next), rows per read, columns, warps. With
# bn_grad_coefficients, for bfloat16 g and z (H100, interleaved medians of ten configurations): 28.2 µs
# at 1024×8192 and 134 at 16384×4096, against 44.9 and 260 for (128, 32, 128, 8), 30.6 and 143 for
# (512, 32, 128, 8), 94 and 497 for torch's var_mean and then the gradient sums.
STATS_BLOCK = (256, 32, 64, 4)
COEFFICIENT_BLOCK = (64, 128)  # chunks summed at once × columns per program of bn_grad_coefficients
# eval_param_grads: chunks summed at once, columns per program, warps. Narrow blocks, as it has few
# columns to spread: 12.4 µs at 16384×4096 (256 chunks, 256 programs) against 24.3 for
# COEFFICIENT_BLOCK's (32 programs), 5.8 against 6.2 at 1024×8192 (H100, interleaved medians).
PARAM_GRAD_BLOCK = (64, 16, 2)


def _kernels():
    """This problem's Triton kernels (triton_kernels.py), imported on first use: they import triton."""
    return kernel_module(".triton_kernels", __package__)


def _kernels_apply(grad, z, *rest) -> bool:
    """Whether the Triton passes take these (``fused_kernels_apply``): float32 or bfloat16, as the
    kernels convert what they load (z: training under bf16 keeps it so; g, s, γ: a bfloat16 model's)."""
    return fused_kernels_apply(grad, z, *rest, dtypes=(torch.float32, torch.bfloat16))


def centred(z: torch.Tensor, shift: torch.Tensor, tile_rows: int) -> torch.Tensor:
    """z − μ in float32 (float64 stays) from z as saved: z + shift[row // tile_rows]."""
    acc = torch.promote_types(z.dtype, torch.float32)
    tiles = torch.arange(z.shape[0], device=z.device) // tile_rows
    return z.to(acc) + shift.to(acc)[tiles]


def row_block(rows: int, shift: torch.Tensor, tile_rows: int) -> int:
    """Rows per program of a pass over z: a divisor of the row tile, so each program adds one
    row of the shift (with a one-row shift, any)."""
    return rows if shift.shape[0] == 1 else math.gcd(rows, tile_rows)


def bn_coefficients(grad, z, shift, tile_rows: int, var, scale, gamma, eps: float):
    """(coef, shift): per column (a, b, c, ds, dγ, dβ), the rows of a (6, N) tensor, with
    dz = a·g + b + c·(z − μ) and the gradients of s, γ and β; and z's shift (``centred``). Where
    Triton can run: one pass over g and z for S and C in chunks, then one small kernel for the
    rest; else torch. ``shift`` and ``var`` None (the forward kept no statistics): the pass
    takes them from z in the same read (chunk statistics merged with Chan's update), where
    torch's var_mean cost a float32 copy of z and a Welford pass (0.027 + 0.038 ms of a 0.49 ms
    training step of a bfloat16 model, 1024×8192², H100); the shift returned is then −μ."""
    gamma = gamma if gamma is not None else torch.ones_like(scale)
    if _kernels_apply(grad, z, scale, gamma, *(() if shift is None else (shift, var))):
        return _triton_coefficients(grad, z, shift, tile_rows, var, scale, gamma, eps)
    acc = torch.promote_types(grad.dtype, torch.float32)
    if shift is None:
        var, mean = torch.var_mean(z.to(acc), dim=0, correction=0)
        shift = -mean[None]
    g, scale, gamma = grad.to(acc), scale.to(acc), gamma.to(acc)  # a bfloat16 model's s and γ: float32 here too
    sum_g, sum_gc = g.sum(0), (g * centred(z, shift, tile_rows)).sum(0)
    m = z.shape[0]
    r = torch.rsqrt(scale * scale * var + eps)
    a = scale * gamma * r
    return torch.stack([a, -a * sum_g / m, -a * scale * scale * r * r * sum_gc / m,
                        gamma * eps * r ** 3 * sum_gc, scale * r * sum_gc, sum_g]), shift


def _triton_coefficients(grad, z, shift, tile_rows: int, var, scale, gamma, eps: float):
    """``bn_coefficients``'s two launches: the pass over g and z in chunks of rows, then the
    per-column kernel that adds the chunks."""
    kernels, (m, n), stats = _kernels(), grad.shape, shift is None
    if stats:  # per chunk: Σ g, Σ g·(z − k), the reference k, Σ(z − k)², Σ(z − k)
        rows, sub_rows, cols, warps = STATS_BLOCK
        rows = min(rows, -(-m // sub_rows) * sub_rows)
        chunks = -(-m // rows)
        parts = torch.empty(5, chunks, n, device=grad.device)
        var, shift = torch.empty(n, device=grad.device), torch.empty(1, n, device=grad.device)
        kernels.column_grad_stats[(chunks, -(-n // cols))](grad, z, *parts, m, n, rows, SUB_ROWS=sub_rows,
                                                           BLOCK_C=cols, num_warps=warps)
    else:  # per chunk: Σ g, Σ g·(z − μ)
        rows, cols = BACKWARD_BLOCK
        rows = row_block(rows, shift, tile_rows)
        chunks = -(-m // rows)
        parts = torch.empty(2, chunks, n, device=grad.device)
        kernels.column_grad_sums[(chunks, -(-n // cols))](grad, z, shift, *parts, m, n, tile_rows,
                                                          BLOCK_R=rows, BLOCK_C=cols)
        parts = (*parts, parts[0], parts[0], parts[0])  # the statistics' pointers go unused
    coef = torch.empty(6, n, device=grad.device)
    block_p, block_c = COEFFICIENT_BLOCK
    kernels.bn_grad_coefficients[(-(-n // block_c),)](*parts, var, shift, scale, gamma, coef, eps, m, n, chunks, rows,
                                                      BLOCK_P=block_p, BLOCK_C=block_c, STATS=stats)
    return coef, shift


def _bn_backward(grad, z, shift, tile_rows: int, a, b, c, layouts: GradLayouts) -> GemmGrad:
    """dz = a·g + b + c·(z − μ) with per-column a, b, c in ``layouts``: one pass (a Triton kernel
    where it can run), else torch."""
    if _kernels_apply(grad, z, shift, a, b, c):
        (m, n), (rows, cols) = grad.shape, BACKWARD_BLOCK
        rows = row_block(rows, shift, tile_rows)
        buffers = GradBuffers(layouts, m, n, rows, grad.device)
        _kernels().bn_backward[(-(-m // rows), -(-n // cols))](
            grad, z, shift, a, b, c, **buffers.args, M=m, N=n, TILE_ROWS=tile_rows, BLOCK_R=rows, BLOCK_C=cols)
        return buffers.result()
    return GemmGrad.of(a * grad + b + c * centred(z, shift, tile_rows), layouts)


def train_backward(saved, grad, needs, precision, eps: float, tile_rows: int | None, gemms: CublasGemms = CUBLAS):
    """(dx, dW, db, ds, dγ, dβ) per ``needs`` (inputs: x, weight, bias, scale, γ, β); ``gemms``
    multiplies dx and dW."""
    x, weight, z, shift, var, scale, gamma = saved
    if z is None:
        z = linear(x, weight, None, precision)
    tile_rows = tile_rows if shift is not None and shift.shape[0] > 1 else max(z.shape[0], 1)
    (a, b, c, ds, dgamma, dbeta), shift = bn_coefficients(grad, z, shift, tile_rows, var, scale, gamma, eps)
    dz = _bn_backward(grad, z, shift, tile_rows, a, b, c, gemms.layouts(precision, needs[0], needs[1], False))
    dx, dw = gemms(dz, x, weight, precision, needs[0], needs[1], grad.dtype)
    db = torch.zeros_like(scale) if needs[2] else None
    return dx, dw, db, ds if needs[3] else None, dgamma if needs[4] else None, dbeta if needs[5] else None


def eval_grad_sums(grad, z, k, layouts: GradLayouts) -> tuple[GemmGrad, torch.Tensor]:
    """(dz = g·k in ``layouts``, parts): parts[0] and parts[1] hold Σ g·z and Σ g over rows per
    chunk of rows, float32, (2, chunks, N), summed by ``eval_param_grads``. One pass over g and z
    (a Triton kernel where it can run), where torch took one per operation (g and z to float32,
    the products, dz's rounding, each sum); torch's parts are one chunk."""
    if _kernels_apply(grad, z, k):
        (m, n), (rows, cols) = grad.shape, BACKWARD_BLOCK
        chunks = -(-m // rows)
        buffers = GradBuffers(dataclasses.replace(layouts, sums=False), m, n, rows, grad.device)
        parts = torch.empty(2, chunks, n, device=grad.device)
        _kernels().eval_grad_sums[(chunks, -(-n // cols))](grad, z, k, buffers.dy, buffers.dy_t, *parts, m, n,
                                                           BLOCK_R=rows, BLOCK_C=cols, ROWS=layouts.rows,
                                                           COLS=layouts.cols)
        return buffers.result(), parts
    acc = torch.promote_types(z.dtype, torch.float32)  # a bfloat16 model's g and z: products in float32
    g = grad.to(acc)
    return GemmGrad.of(g * k, layouts), torch.stack([reduce_rows(g * z.to(acc)), reduce_rows(g)])[:, None]


def eval_param_grads(parts, k, r, bias, scale, gamma, mean) -> torch.Tensor:
    """(db, ds, dγ, dβ) as the rows of a (4, N) tensor in the parameters' dtype, from
    ``eval_grad_sums``'s parts (dk = Σ g·z, dshift = Σ g) by the chain rule of the module's
    docstring: one Triton launch where it can run, else torch."""
    present = [t for t in (bias, gamma) if t is not None]
    if _kernels_apply(parts, k, r, scale, mean, *present):
        n, (block_p, block_c, warps) = k.shape[0], PARAM_GRAD_BLOCK
        grads = torch.empty(4, n, device=k.device, dtype=scale.dtype)
        _kernels().eval_param_grads[(-(-n // block_c),)](
            *parts, k, r, bias if bias is not None else scale, scale, gamma if gamma is not None else scale, mean,
            grads, n, parts.shape[1], BLOCK_P=block_p, BLOCK_C=block_c, HAS_BIAS=bias is not None,
            HAS_GAMMA=gamma is not None, num_warps=warps)  # fmt: skip
        return grads
    dk, dshift = parts.sum(1)
    acc, dtype = k.dtype, scale.dtype
    scale = scale.to(acc)
    gamma_r = r * gamma.to(acc) if gamma is not None else r
    offset = bias.to(acc) * scale - mean.to(acc) if bias is not None else -mean.to(acc)  # b·s − running mean
    ds = gamma_r * (dk + bias.to(acc) * dshift if bias is not None else dk)
    return torch.stack([k * dshift, ds, r * (scale * dk + offset * dshift), dshift]).to(dtype)


def eval_backward(saved, grad, needs, precision, gemms: CublasGemms = CUBLAS):
    """(dx, dW, db, ds, dγ, dβ) per ``needs`` (inputs: x, weight, bias, scale, γ, β); ``gemms``
    multiplies dx and dW."""
    x, weight, z, k, r, bias, scale, gamma, mean = saved
    if z is None:
        z = linear(x, weight, None, precision)
    dz, parts = eval_grad_sums(grad, z, k, gemms.layouts(precision, needs[0], needs[1], False))
    params = eval_param_grads(parts, k, r, bias, scale, gamma, mean)
    dx, dw = gemms(dz, x, weight, precision, needs[0], needs[1], grad.dtype)
    return dx, dw, *(value if need else None for value, need in zip(params, needs[2:], strict=True))


def eval_terms(bias, scale, gamma, beta, mean, var, eps: float, dtype: torch.dtype | None = None):
    """``eval_affine``'s (k, shift, r) outside autograd: one Triton launch (float32) where it can
    run, where torch took a dozen kernels of 1-2 µs each, else ``eval_affine``."""
    present = [t for t in (bias, gamma, beta) if t is not None]
    if (dtype or scale.dtype) == torch.float32 and _kernels_apply(scale, mean, var, *present):
        n = scale.shape[0]
        terms = torch.empty(3, n, device=scale.device)
        _kernels().eval_terms[(-(-n // 1024),)](
            *(t if t is not None else scale for t in (bias, scale, gamma, beta)), mean, var, terms, eps, n,
            BLOCK_C=1024, HAS_BIAS=bias is not None, HAS_GAMMA=gamma is not None, HAS_BETA=beta is not None)
        return terms.unbind(0)
    return eval_affine(bias, scale, gamma, beta, mean, var, eps, dtype)


def eval_apply(z, k, shift, dtype: torch.dtype) -> torch.Tensor:
    """Eval mode's output z·k + shift (float32 k and shift), computed in float32 and stored in
    ``dtype``: one Triton pass where it can run; torch took three for a bfloat16 model's z
    (to float32, addcmul, to bfloat16: 0.10 ms of a 0.52 ms step at 1024×8192², H100)."""
    if _kernels_apply(z, k, shift) and k.dtype == torch.float32:
        (m, n), (rows, cols) = z.shape, BACKWARD_BLOCK
        out = torch.empty(m, n, device=z.device, dtype=dtype)
        _kernels().eval_apply[(-(-m // rows), -(-n // cols))](z, k, shift, out, m, n, BLOCK_R=rows, BLOCK_C=cols)
        return out
    return torch.addcmul(shift, z, k).to(dtype)


def eval_affine(bias, scale, gamma, beta, mean, var, eps: float, dtype: torch.dtype | None = None):
    """(k, shift, r) of eval mode (the module's docstring) from the parameters and running statistics,
    in ``dtype`` where given (a bfloat16 model's in float32, as its BatchNorm computes), else in
    the parameters' own; differentiable where called with grad enabled."""
    def cast(t):
        return t if dtype is None else t.to(dtype)

    r = torch.rsqrt(cast(var) + eps)
    inv_std = r * cast(gamma) if gamma is not None else r
    k = cast(scale) * inv_std
    shift = -cast(mean) * inv_std
    if bias is not None:
        shift = shift + cast(bias) * k
    if beta is not None:
        shift = shift + cast(beta)
    return k, shift, r


def affine_coefficients(model, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, shift) of eval mode, out = z·k + shift, from the model (``eval_affine``)."""
    gemm, bn = model.gemm, model.bn
    k, shift, _ = eval_affine(gemm.bias, model.scale, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.eps,
                              dtype)
    return k, shift


def train_op(forward, precision: str, eps: float, tile_rows: int | None = None,
             gemms: CublasGemms = CUBLAS) -> FusedOp:
    """The FusedOp of a training forward ``(x, weight, bias, scale, γ, β, save)`` returning
    (out, (x, weight operand, z or None, shift or None, σ² or None, scale, γ)), z's shift with
    one row or one per ``tile_rows`` rows (see the module's docstring)."""
    return FusedOp(forward, lambda saved, grad, needs: train_backward(saved, grad, needs, precision, eps, tile_rows,
                                                                      gemms), precision)


def eval_op(forward, precision: str, running_mean, running_var, eps: float, gemms: CublasGemms = CUBLAS) -> FusedOp:
    """The FusedOp of eval mode on the parameters themselves, inputs (x, weight, bias, scale, γ, β)
    (bias, γ, β may be None): (k, shift) from them and the running statistics, in float32 for a
    bfloat16 model, outside autograd, then ``forward(x, weight, k, shift, save)`` returning
    (out, (x, weight operand, z or None, k))."""
    def op_forward(x, weight, bias, scale, gamma, beta, save):
        dtype = torch.float32 if scale.dtype == torch.bfloat16 else None
        k, shift, r = eval_terms(bias, scale, gamma, beta, running_mean, running_var, eps, dtype)
        out, saved = forward(x, weight, k, shift, save)
        return out, ((*saved[:3], k, r, bias, scale, gamma, running_mean) if save else ())

    return FusedOp(op_forward, lambda saved, grad, needs: eval_backward(saved, grad, needs, precision, gemms),
                   precision)


def eval_call(forward, precision: str, model, x, gemms: CublasGemms = CUBLAS) -> torch.Tensor:
    """``model`` in eval mode with a gradient needed, through ``forward`` (``eval_op``)."""
    gemm, bn = model.gemm, model.bn
    op = eval_op(forward, precision, bn.running_mean, bn.running_var, bn.eps, gemms)
    return fused_call(op, x, gemm.weight, gemm.bias, model.scale, bn.weight, bn.bias)


def torch_train_forward(precision, eps, tile_rows: int | None = None):
    """The training forward written in torch (no running-statistics update), for tests of the
    backward; with ``tile_rows``, z saved less each row tile's mean, as the Triton forward saves it."""
    def forward(x, weight, bias, scale, gamma, beta, save):
        z = linear(x, weight, None, precision)
        var, mean = torch.var_mean(z, dim=0, correction=0)
        r = torch.rsqrt(scale * scale * var + eps)
        out = (z - mean) * (scale * r * (gamma if gamma is not None else 1.0))
        out = out + beta if beta is not None else out
        if tile_rows is None:
            return out, (x, weight, z, -mean[None], var, scale, gamma)
        tile_means = torch.stack([tile.mean(0) for tile in z.split(tile_rows)])
        tiles = torch.arange(z.shape[0]) // tile_rows
        return out, (x, weight, z - tile_means[tiles], tile_means - mean, var, scale, gamma)
    return forward


def torch_eval_forward(precision):
    def forward(x, weight, k, shift, save):
        z = linear(x, weight, None, precision)
        return z * k + shift, (x, weight, z, k)
    return forward
