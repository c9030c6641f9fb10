"""``matmul_gelu_softmax``, CUDA GEMM with the epilogue fused: naive, tiled and templated.

softmax(gelu(x·Wᵀ + b)) needs every logit of a row before any output is final, so the GEMM's
epilogue adds the bias, applies the exact erf GELU, stores the row and leaves one
(max, Σ exp(v − max)) pair per row and block of columns; a second kernel merges a row's pairs
with the max subtracted (no overflow at any magnitude) and rescales the row in place.
fp32 FMA only: these run under every precision. Preconditions: float32 CUDA tensors (made
contiguous); any sizes (no tile divisibility assumed). Kernel: csrc/gemm_gelu_softmax.cu.
Autograd: the kernels never keep the pre-GELU logits, so the backward recomputes them with one
cuBLAS GEMM (gradients.py): three GEMMs in the backward instead of two, nothing extra saved.
"""

import torch

from autofuse.hookspecs import hookimpl
from autofuse.kernels.cuda_variant import GemmKernelVariant, gemm_operands

from . import gradients

_PTR6 = ("ptr",) * 6


class GemmGeluSoftmax(gradients.FusedGeluSoftmax, GemmKernelVariant):
    problem = "matmul_gelu_softmax"
    source = "csrc/gemm_gelu_softmax.cu"
    launchers = {"af_gemm_gelu_softmax": _PTR6 + ("int", "int", "int")}

    supports_autograd = True

    def _fused(self, x, weight, bias, save):
        x, w, b = gemm_operands(x, weight, bias, "linear")
        (batch, n_in), n_out = x.shape, w.shape[0]
        parts = self.library(x.device).af_parts(n_out)
        y = torch.empty(batch, n_out, device=x.device)
        part_max = torch.empty(batch, parts, device=x.device)
        part_sum = torch.empty(batch, parts, device=x.device)
        self.launch("af_gemm_gelu_softmax", x, w, b, y, part_max, part_sum, batch, n_out, n_in, device=x.device)
        return y, ((x, w, b, None, None, y) if save else ())


class CudaNaiveGeluSoftmax(GemmGeluSoftmax):
    name = "cuda_naive"
    kind = "cuda_naive"
    description = "one thread per logit (dot product from global memory) + GELU + row partials; softmax finish kernel"


class CudaTiledGeluSoftmax(GemmGeluSoftmax):
    name = "cuda_tiled"
    kind = "cuda_tiled"
    description = "shared-memory tiled GEMM (16 or 32 square tiles), GELU + row partials fused; softmax finish kernel"


class CudaTemplatedGeluSoftmax(GemmGeluSoftmax):
    name = "cuda_templated"
    kind = "cuda_templated"
    description = "register-blocked GEMM (tile, k-slice, per-thread block, vector width, stages searched), epilogue fused"


@hookimpl
def autofuse_register_variants():
    return [CudaNaiveGeluSoftmax, CudaTiledGeluSoftmax, CudaTemplatedGeluSoftmax]
