"""``gemm_avgpool_gelu_residual``, simplified: the mean turns the GEMM into a GEMV.

The mean over out_features of x·Wᵀ + b − subtract is x·mean(W, 0) + mean(b − subtract):
one dot product per row with a cached column mean of W instead of a (batch × out × in)
GEMM. logsumexp over a dimension of size 1 is the identity. So
    out = x + gelu(x·w̄ + c)        (exact erf GELU; w̄ = mean(W, 0), c = mean(b − subtract))
The residual is ``x.detach()`` as in the reference, so the gradient reaches x only
through the GEMV. w̄ and c are cached until W, b or subtract changes. The GEMV and GELU
run in float32 also for bfloat16 inputs (more precise, and equally memory-bound).
"""

import torch
import torch.nn.functional as F

from autofuse.core.variant import FoldCache, Variant
from autofuse.hookspecs import hookimpl


class SimplifiedGemmAvgPoolGeluResidual(Variant):
    name = "simplified"
    problem = "gemm_avgpool_gelu_residual"
    kind = "simplified"
    description = "x + gelu(x·mean(W,0) + mean(b − subtract)): a GEMV, no GEMM"
    supports_autograd = True
    capturable = True  # torch operations on the current stream, folded weights cached

    def __init__(self, precision="fp32", **params):
        super().__init__(precision, **params)
        self._folded = FoldCache()

    def forward(self, model, x):
        gemm, subtract = model.gemm, model.subtract
        tensors = [t for t in (gemm.weight, gemm.bias, subtract) if t is not None]
        acc = torch.promote_types(x.dtype, torch.float32)  # float32, or float64 for float64 inputs
        w_mean, offset = self._folded.get(tensors, lambda: fold_column_mean(gemm, subtract, acc), extra=(acc,))
        z = torch.addmv(offset, x.to(acc), w_mean)
        return x.detach() + F.gelu(z).to(x.dtype)[:, None]


def fold_column_mean(gemm, subtract, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(w̄, c) = (mean(W, 0), mean(b) − mean(subtract)) in dtype ``acc``: the whole GEMM's
    contribution to the row mean. Shared with the CUDA variants, which take the same algebra."""
    w_mean = gemm.weight.to(acc).mean(dim=0)
    offset = -subtract.to(acc).mean()
    if gemm.bias is not None:
        offset = offset + gemm.bias.to(acc).mean()
    return w_mean, offset


@hookimpl
def autofuse_register_variants():
    return [SimplifiedGemmAvgPoolGeluResidual]
