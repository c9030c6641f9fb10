"""``gemm_bn``, simplified: PyTorch with the BatchNorm algebra done.

Training mode. With z = x·Wᵀ (no bias) and y = (z + b)·s, the batch mean of y is
s·(mean(z) + b) and its biased variance s²·var(z): the bias cancels in y − mean(y),
and scale folds into one per-column factor, so
    out = (z − mean(z)) · s·γ/√(s²·var(z) + eps) + β
is one GEMM and one fused affine. The running statistics are updated exactly as
BatchNorm1d does: num_batches_tracked += 1, then a lerp by momentum (or by
1/num_batches_tracked when momentum is None) towards s·(mean(z) + b) and the unbiased
variance s²·var(z)·n/(n−1). Needs batch >= 2, like PyTorch. Under autograd the bias, absent
from the formula, still gets its gradient (exactly zero; PyTorch's is rounding noise): β + (b − b)
carries it, so an optimizer steps it as it would PyTorch's (weight decay included).

Eval mode. With k = γ/√(running_var + eps), the whole block is one linear layer,
    W' = W·(s·k)[:, None],   b' = b·s·k − running_mean·k + β,
folded once and cached until any parameter or running statistic changes.
"""

import torch

from autofuse.core.precision import linear
from autofuse.core.variant import FoldCache, Variant
from autofuse.errors import InputError
from autofuse.hookspecs import hookimpl

from .gradients import affine_coefficients


class SimplifiedGemmBn(Variant):
    name = "simplified"
    problem = "gemm_bn"
    kind = "simplified"
    description = "train: one GEMM + one affine from batch stats; eval: scale and BN folded into W, b"
    supports_autograd = True
    capturable = True  # torch operations on the current stream, folded weights cached

    def __init__(self, precision="fp32", **params):
        super().__init__(precision, **params)
        self._folded = FoldCache()

    def forward(self, model, x):
        bn = model.bn
        if bn.training or bn.running_mean is None:
            return self._train(model, x)
        return self._eval(model, x)

    def _train(self, model, x):
        gemm, bn, scale = model.gemm, model.bn, model.scale
        n = x.shape[0]
        if n < 2:
            raise InputError(f"Expected more than 1 value per channel when training, got input size {tuple(x.shape)}")
        z = linear(x, self.gemm_weight(gemm.weight), None, self.precision)
        var_z, mean_z = torch.var_mean(z, dim=0, correction=0)
        gamma = bn.weight if bn.weight is not None else 1.0
        beta = bn.bias if bn.bias is not None else torch.zeros_like(mean_z)
        if gemm.bias is not None and gemm.bias.requires_grad and torch.is_grad_enabled():
            beta = beta + (gemm.bias - gemm.bias)  # zero, and a zero gradient for b (module docstring)
        coef = scale * gamma * torch.rsqrt(scale * scale * var_z + bn.eps)
        out = torch.addcmul(beta, z - mean_z, coef)
        if bn.track_running_stats and bn.running_mean is not None:
            self._update_running_stats(bn, gemm.bias, scale, mean_z, var_z, n)
        return out

    @staticmethod
    @torch.no_grad()
    def _update_running_stats(bn, bias, scale, mean_z, var_z, n):
        bn.num_batches_tracked.add_(1)
        factor = bn.momentum if bn.momentum is not None else 1.0 / float(bn.num_batches_tracked)
        mean_y = scale * (mean_z + bias) if bias is not None else scale * mean_z
        var_y = scale * scale * var_z * (n / (n - 1))
        bn.running_mean.lerp_(mean_y.to(bn.running_mean.dtype), factor)
        bn.running_var.lerp_(var_y.to(bn.running_var.dtype), factor)

    def _eval(self, model, x):
        gemm, bn, scale = model.gemm, model.bn, model.scale
        tensors = [t for t in (gemm.weight, gemm.bias, scale, bn.weight, bn.bias, bn.running_mean, bn.running_var) if t is not None]
        weight, bias = self._folded.get(tensors, lambda: self._fold(model))
        return linear(x, self.gemm_weight(weight), bias, self.precision)

    @staticmethod
    def _fold(model):
        k, shift = affine_coefficients(model)  # out = z·k + shift per column
        return model.gemm.weight * k[:, None], shift


@hookimpl
def autofuse_register_variants():
    return [SimplifiedGemmBn]
