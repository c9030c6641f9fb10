"""``matmul_clamp_lse_mish``, CUDA GEMM with the epilogue fused: naive, tiled and templated.

``x * s`` then ``x + x`` is one multiply by t = 2s, and doubling is exact, so
clamp(t·(x·Wᵀ + b), lo, hi) rounds as the reference's clamp((y·s) + (y·s)) does. logsumexp
needs every logit of a row, so the GEMM's epilogue adds the bias, scales, clamps and leaves one
(max, Σ exp(v − max)) pair per row and block of columns, never storing the logits; a second
kernel, one warp per row, merges a row's pairs with the max subtracted (no overflow at any
clamp bound) and writes z·mish(z). NaN propagates as in torch.clamp and torch.logsumexp.
s, lo and hi are read from the model at every call and passed as float32, as PyTorch casts them.
fp32 FMA only: these run under every precision. Preconditions: float32 CUDA tensors (made
contiguous), a bias; any sizes (no tile divisibility assumed). Kernel: csrc/gemm_clamp_lse_mish.cu.
Autograd: the logits never reach memory, so the backward recomputes them with one cuBLAS GEMM
(gradients.py): three GEMMs in the backward instead of two, nothing extra saved.
"""

import math

import torch

from autofuse.errors import InputError
from autofuse.hookspecs import hookimpl
from autofuse.kernels.autograd import fused_call
from autofuse.kernels.cuda_variant import GemmKernelVariant, gemm_operands

from . import gradients

_PTR6 = ("ptr",) * 6


def clamp_lse_scalars(model) -> tuple[float, float, float]:
    """(t, lo, hi) = (2·scale_factor, clamp_min, clamp_max) as floats; a None bound is unbounded."""
    lo, hi = model.clamp_min, model.clamp_max
    if lo is None and hi is None:  # torch.clamp refuses this too
        raise InputError("clamp_min and clamp_max: expected at least one float, got None for both")
    lo = -math.inf if lo is None else float(lo)
    hi = math.inf if hi is None else float(hi)
    return 2.0 * float(model.scale_factor), lo, hi


class GemmClampLseMish(GemmKernelVariant):
    problem = "matmul_clamp_lse_mish"
    source = "csrc/gemm_clamp_lse_mish.cu"
    launchers = {"af_gemm_clamp_lse_mish": _PTR6 + ("float", "float", "float", "int", "int", "int")}

    supports_autograd = True

    def forward(self, model, x):
        scalars = clamp_lse_scalars(model)
        op = gradients.fused_op(lambda *a, save: self._fused(*a, scalars, save=save), self.precision, scalars)
        return fused_call(op, x, model.matmul.weight, model.matmul.bias)

    def _fused(self, x, weight, bias, scalars, save):
        x, w, b = gemm_operands(x, weight, bias, "matmul")
        (batch, n_in), n_out = x.shape, w.shape[0]
        parts = self.library(x.device).af_parts(n_out)
        out = torch.empty(batch, 1, device=x.device)
        part_max = torch.empty(batch, parts, device=x.device)
        part_sum = torch.empty(batch, parts, device=x.device)
        args = (x, w, b, out, part_max, part_sum, *scalars, batch, n_out, n_in)
        self.launch("af_gemm_clamp_lse_mish", *args, device=x.device)
        return out, ((x, w, b, None, None, None) if save else ())


class CudaNaiveClampLseMish(GemmClampLseMish):
    name = "cuda_naive"
    kind = "cuda_naive"
    description = "one thread per logit (dot product from global memory) + clamp + row partials; lse·mish finish"


class CudaTiledClampLseMish(GemmClampLseMish):
    name = "cuda_tiled"
    kind = "cuda_tiled"
    description = "shared-memory tiled GEMM (16 or 32 square tiles), clamp + row partials fused; lse·mish finish"


class CudaTemplatedClampLseMish(GemmClampLseMish):
    name = "cuda_templated"
    kind = "cuda_templated"
    description = "register-blocked GEMM (tiles, vector width, stages searched), clamp + row partials fused"


@hookimpl
def autofuse_register_variants():
    return [CudaNaiveClampLseMish, CudaTiledClampLseMish, CudaTemplatedClampLseMish]
