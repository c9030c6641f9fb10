"""Gradients of ``matmul_gelu_softmax`` for its fused variants (see ``autofuse.kernels.autograd``).

out = softmax(a), a = gelu(y), y = x·Wᵀ + b. With g = ∂L/∂out:
    ∂L/∂a = out ⊙ (g − Σ_j g_j·out_j)                     (softmax, per row; computed without
                                                           cancellation: epilogue_backward)
    ∂L/∂y = ∂L/∂a ⊙ gelu'(y),   gelu'(y) = Φ(y) + y·φ(y)   (the exact erf GELU)
    dx = dy·W,  dW = dyᵀ·x,  db = Σ_rows dy.
Saved: x, the forward's GEMM weight operand, b, y (None where the forward never stored it:
recomputed with one GEMM, and out with it; a bfloat16 model's cuBLAS y is bfloat16), the bias
still to add to y (under bf16 cuBLAS's y leaves it to the epilogue) and out. Eager autograd
keeps y, gelu(y) and out; this keeps y and out. The elementwise part is two Triton kernels
(``epilogue_backward``), which write dy in the layouts the GEMMs want (``autograd.GradLayouts``);
the GEMMs go through cuBLAS at the forward's precision.
"""

from __future__ import annotations

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
)
from autofuse.kernels.triton.host import fused_kernels_apply, kernel_module

INV_SQRT2 = 1.0 / math.sqrt(2.0)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _kernels():
    """This problem's Triton kernels (triton_kernels.py), imported on first use: they import triton."""
    return kernel_module(".triton_kernels", __package__)


def gelu_grad(y: torch.Tensor) -> torch.Tensor:
    """d gelu(y)/dy for the exact erf GELU: Φ(y) + y·φ(y)."""
    return 0.5 * (1.0 + torch.erf(y * INV_SQRT2)) + y * torch.exp(-0.5 * y * y) * INV_SQRT_2PI


# Rows × columns per program of the tiled pass: the dyᵀ it writes under tf32 is 256-byte runs.
BACKWARD_BLOCK = (64, 64)


def epilogue_backward(y: torch.Tensor, out: torch.Tensor, grad: torch.Tensor, layouts: GradLayouts,
                      y_bias: torch.Tensor | None = None) -> GemmGrad:
    """∂L/∂y from the saved logits y, the softmax output and ∂L/∂out, in float32 (float64 stays;
    each of the three may be bfloat16, a bfloat16 model's), in ``layouts``: where Triton can run,
    a row kernel for each row's sums (two passes over out and g), then a tiled one for dy; else torch.
    ``y_bias``: the float32 bias the forward's epilogue added to y (bf16 cuBLAS left it), added
    here as there. The tiled kernel adds it as it reads y, where the logits in float32 first took
    a conversion and an add, 59 µs of cublas_epilogue's 0.600 ms bf16 step at 1024×8192² (H100).

    The softmax's ∂L/∂a_j = out_j·(g_j − Σ g·out) cancels at the row's largest output when the
    row is nearly one-hot (logits in the hundreds: out_top = 1 − ε with ε below float32's
    resolution), leaving rounding noise of |g|·2⁻²⁴ where the true value is ε-small (100x
    float64's error in tests/test_fused_gradients.py). Since Σ out = 1, g_top − Σ g·out = Σ_k out_k·(g_top − g_k) exactly, a sum of small terms with
    no cancellation: it gives the top entry, and Σ g·out = g_top − it gives the others."""
    if fused_kernels_apply(y, out, grad, dtypes=(torch.float32, torch.bfloat16)) and (
            y_bias is None or fused_kernels_apply(y_bias)):
        kernels = _kernels()
        (m, n), (rows, cols) = out.shape, BACKWARD_BLOCK
        top = torch.empty(m, device=out.device, dtype=torch.int32)
        rest, total = torch.empty(2, m, device=out.device)
        kernels.softmax_grad_rows[(m,)](out, grad, top, rest, total, n, BLOCK_N=kernels.row_block(n))
        buffers = GradBuffers(layouts, m, n, rows, out.device)
        kernels.gelu_softmax_backward[(-(-m // rows), -(-n // cols))](
            y, y_bias, out, grad, top, rest, total, **buffers.args, M=m, N=n, BIAS=y_bias is not None, BLOCK_R=rows,
            BLOCK_C=cols)
        return buffers.result(grad.dtype)  # the bias's: the model's dtype, as out's
    acc = torch.promote_types(out.dtype, torch.float32)
    out, grad = out.to(acc), grad.to(acc)
    top = out.argmax(dim=1, keepdim=True)
    top_grad = grad.gather(1, top)
    rest = (out * (top_grad - grad)).sum(dim=1, keepdim=True)
    da = out * (grad - (top_grad - rest))
    da.scatter_(1, top, out.gather(1, top) * rest)
    y = y.to(acc) if y_bias is None else y.to(acc) + y_bias
    return GemmGrad.of(da * gelu_grad(y), layouts)


def backward(saved, grad, needs, precision, gemms: CublasGemms = CUBLAS):
    """(dx, dW, db) per ``needs`` (inputs: x, weight, bias); ``gemms`` multiplies dx and dW."""
    x, weight, bias, y, y_bias, out = saved
    if y is None:
        # The logits again from cuBLAS, and the softmax from them too: the forward's out came
        # from another GEMM's rounding, and mixing the two put the SIMT kernels' weight gradient
        # at 4.04x eager's error on large inputs (64×256×192, H100), past the gate's 4x.
        y, y_bias = linear(x, weight, bias, precision), None
        out = torch.softmax(torch.nn.functional.gelu(y), dim=1)
    dy = epilogue_backward(y, out, grad, gemms.layouts(precision, *needs), y_bias)
    dx, dw = gemms(dy, x, weight, precision, needs[0], needs[1], grad.dtype)
    return dx, dw, dy.bias


def fused_op(forward, precision: str, gemms: CublasGemms = CUBLAS) -> FusedOp:
    """The FusedOp of a variant whose ``forward(x, weight, bias, save)`` returns
    (out, (x, weight operand, bias, y or None, bias still to add to y or None, out))."""
    return FusedOp(forward, lambda saved, grad, needs: backward(saved, grad, needs, precision, gemms), precision)


class FusedGeluSoftmax:
    """Mixin of this problem's fused variants (before the Variant base in the bases): ``forward``
    runs the variant's ``_fused(x, weight, bias, save)``, returning (out, saved) as ``fused_op``
    says, differentiably through this problem's backward, with one FusedOp per instance, whose
    GEMMs ``gemms`` multiplies (a triton variant on float16 parts sets its own in its __init__)."""

    gemms: CublasGemms = CUBLAS

    def __init__(self, precision="fp32", **params):
        super().__init__(precision, **params)
        self._op = fused_op(self._fused, precision, self.gemms)

    def forward(self, model, x):
        return fused_call(self._op, x, model.linear.weight, model.linear.bias)


def torch_forward(precision):
    """The fused forward written in torch (saving y), for tests of the backward on any device."""
    def forward(x, weight, bias, save):
        y = linear(x, weight, bias, precision)
        out = torch.softmax(torch.nn.functional.gelu(y), dim=1)
        return out, (x, weight, bias, y, None, out)
    return forward
