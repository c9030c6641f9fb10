"""Gradients of ``matmul_clamp_lse_mish`` for its fused variants (see ``autofuse.kernels.autograd``).

y = x·Wᵀ + b, v = t·y (t = 2s), c = clamp(v, lo, hi), z = logsumexp(c) per row, out = z·mish(z).
With g = ∂L/∂out (one value per row):
    h(z) = z·mish(z) = z²·tanh(sp(z)),  h'(z) = 2z·tanh(sp) + z²·(1 − tanh²(sp))·σ(z)
    ∂L/∂y = g·h'(z) · exp(c − z) · [lo ≤ v ≤ hi] · t      (softmax of the clamped row; clamp
                                                           passes the gradient where torch.clamp does)
    dx = dy·W,  dW = dyᵀ·x,  db = Σ_rows dy.
Saved: x, the forward's GEMM weight operand, b, y (None where the forward never stored the
logits: recomputed with one GEMM; the Triton kernel stores them only when a gradient is
needed), the bias still to add to y, and z (None: one more read of y in the backward, for
kernels that output z·mish(z) only). Eager autograd keeps the logits, their scaled and
clamped copies and the logsumexp; this keeps the logits and z.

Under bf16 the Triton forward saves, in place of y, what ∂L/∂y needs of it (``SoftmaxParts``):
q = exp(c − m)·[lo ≤ v ≤ hi] in bfloat16, m being the row's max over its forward tile of
columns (the epilogue computes both anyway), so exp(c − z)·[inside] = q·exp(m − z). That is half
the bytes of the float32 logits, stored by the forward's GEMM and read by the backward; q is in
(0, 1], so bfloat16 costs it 2⁻⁹ relative, the rounding the bf16 backward gives dy itself.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from autofuse.core.precision import linear
from autofuse.kernels.autograd import CUBLAS, CublasGemms, FusedOp, GemmGrad, GradBuffers, GradLayouts, saved_logits
from autofuse.kernels.triton.host import fused_kernels_apply, kernel_module


def _kernels():
    """This problem's Triton kernels (triton_kernels.py), imported on first use: they import triton."""
    return kernel_module(".triton_kernels", __package__)


def output_grad(z: torch.Tensor) -> torch.Tensor:
    """h'(z) for h(z) = z·mish(z)."""
    th = torch.tanh(F.softplus(z))
    return 2.0 * z * th + z * z * (1.0 - th * th) * torch.sigmoid(z)


# ∂L/∂out as the kernels take it: a bfloat16 model's is bfloat16 (they load it as float32).
GRAD_DTYPES = (torch.float32, torch.bfloat16)
# Rows × columns per program of the epilogue backward: the dyᵀ it writes under tf32 is 256-byte runs.
BACKWARD_BLOCK = (64, 64)


# Rows × columns per program and step of ``clamp_lse_rows``, and its warps: two rows, so at batch 1
# the rows' mask stays (Triton makes M = 1 a constant; see the finish inside's INSIDE_ROWS_BF16).
# H100, bfloat16 logits, interleaved medians of nine configurations: 16.8 µs at 1024×8192 against
# 19.2 for (2, 1024, 4 warps), 10.5 against 13.7 at 8 rows, 159 against 158 at 16384.
LSE_BLOCK = (2, 4096, 8)


def clamped_logsumexp(y, t: float, lo: float, hi: float) -> torch.Tensor:
    """z = logsumexp(clamp(t·y, lo, hi)) per row, (batch, 1) in float32 (float64 stays), from the
    logits y (bias included; a bfloat16 model's are bfloat16): the backward's z where the forward
    kept none. One read of y by a Triton kernel where it can run (``clamp_lse_rows``); torch's
    chain of a cast, a product, a clamp and logsumexp's passes reads and writes it about ten times."""
    if fused_kernels_apply(y, dtypes=(torch.float32, torch.bfloat16)):
        rows, cols, warps = LSE_BLOCK
        z = torch.empty(y.shape[0], 1, device=y.device)
        _kernels().clamp_lse_rows[(-(-y.shape[0] // rows),)](y, z, t, lo, hi, *y.shape, BLOCK_R=rows, BLOCK_C=cols,
                                                              num_warps=warps)
        return z
    return torch.logsumexp((y.to(torch.promote_types(y.dtype, torch.float32)) * t).clamp(lo, hi), dim=1, keepdim=True)


def epilogue_backward(y, z, grad, t: float, lo: float, hi: float, layouts: GradLayouts) -> GemmGrad:
    """∂L/∂y from the logits y (bias included; float32, or a bfloat16 model's bfloat16), z (batch,
    1) and ∂L/∂out (batch, 1), in ``layouts``: one pass of a Triton kernel where it can run (h'(z)
    included), else torch."""
    if (fused_kernels_apply(y, dtypes=(torch.float32, torch.bfloat16)) and fused_kernels_apply(z)
            and fused_kernels_apply(grad, dtypes=GRAD_DTYPES)):
        rows, cols = BACKWARD_BLOCK
        buffers = GradBuffers(layouts, y.shape[0], y.shape[1], rows, y.device)
        _kernels().clamp_lse_backward[(-(-y.shape[0] // rows), -(-y.shape[1] // cols))](
            y, z, grad, **buffers.args, t=t, lo=lo, hi=hi, M=y.shape[0], N=y.shape[1], BLOCK_R=rows, BLOCK_C=cols)
        return buffers.result(grad.dtype)  # the bias's: the model's dtype, as out's
    acc = torch.promote_types(z.dtype, torch.float32)
    gz = grad.to(acc) * output_grad(z.to(acc))
    v = y.to(acc) * t
    inside = (v >= lo) & (v <= hi)
    dy = torch.where(inside, torch.exp(v.clamp(lo, hi) - z) * (gz * t), torch.zeros((), dtype=acc, device=y.device))
    return GemmGrad.of(dy, layouts)


@dataclasses.dataclass(frozen=True)
class SoftmaxParts:
    """How a forward saved q = exp(c − m)·[inside] in place of the logits (module docstring):
    ``tile_n`` columns share each of a row's maxima m (``part_max``, batch × ⌈N / tile_n⌉)."""

    tile_n: int


def epilogue_backward_from_q(q, part_max, z, grad, t: float, tile_n: int, layouts: GradLayouts) -> GemmGrad:
    """``epilogue_backward`` from q and its tile maxima (``SoftmaxParts``) instead of the logits."""
    rows, cols = BACKWARD_BLOCK[0], min(BACKWARD_BLOCK[1], tile_n)  # columns within one forward tile
    if (tile_n % cols == 0 and fused_kernels_apply(q, dtypes=(torch.bfloat16, torch.float32))
            and fused_kernels_apply(part_max, z) and fused_kernels_apply(grad, dtypes=GRAD_DTYPES)):
        buffers = GradBuffers(layouts, q.shape[0], q.shape[1], rows, q.device)
        grid = (-(-q.shape[0] // rows), -(-q.shape[1] // cols))
        _kernels().clamp_lse_backward_from_q[grid](
            q, part_max, z, grad, **buffers.args, t=t, M=q.shape[0], N=q.shape[1], PARTS=part_max.shape[1],
            TILE_N=tile_n, BLOCK_R=rows, BLOCK_C=cols)
        return buffers.result(grad.dtype)  # the bias's: the model's dtype, as out's
    acc = torch.promote_types(z.dtype, torch.float32)
    m = part_max.to(acc).repeat_interleave(tile_n, dim=1)[:, :q.shape[1]]
    q = q.to(acc)
    dy = torch.where(q != 0, q * torch.exp(m - z.to(acc)) * (grad.to(acc) * output_grad(z.to(acc)) * t), 0.0)
    return GemmGrad.of(dy, layouts)


def backward(saved, grad, needs, precision, scalars, parts: SoftmaxParts | None = None, gemms: CublasGemms = CUBLAS):
    """(dx, dW, db) per ``needs`` (inputs: x, weight, bias); ``scalars`` = (t, lo, hi). With
    ``parts`` the saved (y, bias still to add) are (q, part_max) instead (``SoftmaxParts``).
    ``gemms``: how dx and dW are multiplied (``autograd.CublasGemms``)."""
    x, weight, bias, y, y_bias, z = saved
    layouts = gemms.layouts(precision, *needs)
    if parts is not None:
        dy = epilogue_backward_from_q(y, y_bias, z, grad, scalars[0], parts.tile_n, layouts)
    else:
        y = saved_logits(x, weight, bias, y, y_bias, precision)
        if z is None:
            z = clamped_logsumexp(y, *scalars)
        dy = epilogue_backward(y, z, grad, *scalars, layouts)
    dx, dw = gemms(dy, x, weight, precision, needs[0], needs[1], grad.dtype)
    return dx, dw, dy.bias


def fused_op(forward, precision: str, scalars: tuple[float, float, float],
             parts: SoftmaxParts | None = None, gemms: CublasGemms = CUBLAS) -> FusedOp:
    """The FusedOp of a variant whose ``forward(x, weight, bias, save)`` returns
    (out, (x, weight operand, bias, y or None, bias still to add to y or None, z)), or with
    ``parts`` (out, (x, weight operand, bias, q, part_max, z))."""
    return FusedOp(forward, lambda saved, grad, needs: backward(saved, grad, needs, precision, scalars, parts, gemms),
                   precision)


def softmax_parts(y, t: float, lo: float, hi: float, tile_n: int):
    """(q, part_max, z) from the logits y, in y's dtype, as the bf16 Triton forward saves them
    (``SoftmaxParts``; q rounded there): the torch statement of what the kernel stores, for tests."""
    c = (y * t).clamp(lo, hi)
    part_max = torch.stack([tile.amax(dim=1) for tile in c.split(tile_n, dim=1)], dim=1).contiguous()
    inside = ((y * t) >= lo) & ((y * t) <= hi)
    q = torch.where(inside, torch.exp(c - part_max.repeat_interleave(tile_n, dim=1)[:, :y.shape[1]]), 0.0)
    return q, part_max, torch.logsumexp(c, dim=1, keepdim=True)


def torch_forward(precision, scalars, parts: SoftmaxParts | None = None):
    """The fused forward written in torch (saving y, or with ``parts`` q and the tile maxima as the
    bf16 Triton forward does), for tests of the backward on any device."""
    t, lo, hi = scalars

    def forward(x, weight, bias, save):
        y = linear(x, weight, bias, precision)
        if parts is None:
            z = torch.logsumexp((y * t).clamp(lo, hi), dim=1, keepdim=True)
            return z * F.mish(z), (x, weight, bias, y, None, z)
        q, part_max, z = softmax_parts(y, t, lo, hi, parts.tile_n)
        return z * F.mish(z), (x, weight, bias, q.to(torch.bfloat16 if precision == "bf16" else y.dtype), part_max, z)
    return forward
