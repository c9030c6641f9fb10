"""``matmul_clamp_lse_mish``, simplified: scale and residual folded into the weights.

``x * s`` followed by ``x + x`` is one multiply by t = 2s, and t·(x·Wᵀ + b) =
x·(t·W)ᵀ + t·b, so the GEMM produces the scaled logits directly (exact when t is a
power of two, as with KernelBench's s = 2). The folded weights are cached until W or
b changes (a change of ``scale_factor`` is seen too). Then an in-place clamp, a stable
logsumexp (row max subtracted) and z·mish(z) on the (batch, 1) result.
"""

import torch
import torch.nn.functional as F

from autofuse.core.precision import linear
from autofuse.core.variant import FoldCache, Variant
from autofuse.hookspecs import hookimpl


class SimplifiedMatmulClampLseMish(Variant):
    name = "simplified"
    problem = "matmul_clamp_lse_mish"
    kind = "simplified"
    description = "GEMM with 2·scale folded into W and b → clamp_ → logsumexp → z·mish(z)"
    supports_autograd = True
    capturable = True  # torch operations on the current stream, folded weights cached

    def __init__(self, precision="fp32", **params):
        super().__init__(precision, **params)
        self._folded = FoldCache()

    def forward(self, model, x):
        lin = model.matmul
        factor = 2.0 * float(model.scale_factor)
        tensors = [t for t in (lin.weight, lin.bias) if t is not None]
        weight, bias = self._folded.get(tensors, lambda: self._fold(lin, factor), extra=(factor,))
        # In place: addmm's backward does not need its output, so autograd allows it.
        y = linear(x, self.gemm_weight(weight), bias, self.precision).clamp_(model.clamp_min, model.clamp_max)
        z = torch.logsumexp(y, dim=1, keepdim=True)
        return z * F.mish(z)

    @staticmethod
    def _fold(lin, factor):
        return lin.weight * factor, None if lin.bias is None else lin.bias * factor


@hookimpl
def autofuse_register_variants():
    return [SimplifiedMatmulClampLseMish]
