"""``matmul_gelu_softmax``, cuBLAS + one fused epilogue kernel.

y = x·Wᵀ + b is one cuBLAS call through torch (addmm: the bias rides in the GEMM; under
tf32 or bf16 the GEMM uses what that precision admits, see ``autofuse.core.precision.linear``).
Under bf16 the weight's bfloat16 copy is cached, y is cuBLAS's bfloat16 result (half the
bytes to read back) and the bias is added by the kernel below.
Then one kernel, one block of ``block`` threads per row, does everything after it: exact GELU
and a stable softmax. With ``items`` > 0 the row stays in registers (``items`` values a
thread, 16-byte loads): one read of y and one write of the result, so the time is the GEMM's
plus one pass over the (batch × out) logits. ``items`` = 0 streams the row twice (any length).
With a gradient needed the kernel writes a fresh output instead of overwriting y, which the
backward keeps (see gradients.py).

A bfloat16 model (under bf16): y = linear(x) as its reference computes it (cuBLAS's bfloat16
output, the bias in its epilogue), then the same kernel rounds gelu(y) to bfloat16, as the
reference stores it before the softmax reads it, and writes the softmax in bfloat16. The time
is the bfloat16 GEMM's plus one read and one write of the (batch × out) bfloat16 logits, where
the reference makes two of each. From 160 rows on, that rounded gelu comes from a table indexed
by y's 16 bits (the kernel was bound by issue slots; see the source). With a gradient needed the
backward keeps that bfloat16 y and the output (eager keeps y, gelu(y) and the output) and runs
in float32 from them (gradients.py); its GEMMs are cuBLAS's bfloat16 ones, as eager's.
Kernel: csrc/gelu_softmax_rows.cu.
"""

import torch

from autofuse.core.precision import gemm_input, linear_deferring_bias
from autofuse.hookspecs import hookimpl
from autofuse.kernels.autograd import needs_grad
from autofuse.kernels.cuda_variant import CudaVariant, bfloat16_model_linear, gemm_operands, linear_parameters

from . import gradients

BLOCKS = (256, 128, 512, 1024)
ITEMS = (8, 16, 24, 32)


def row_configs(n: int) -> list[dict]:
    """(block, items) that hold a row of ``n`` in registers, least idle capacity first (then
    blocks nearest 256), followed by the streaming kernel at every block size.

    Resident configurations more than twice the row are left out (idle threads) unless none
    is closer; so is 1024 threads × 32 items: 1024-thread blocks get at most 64 registers a
    thread, and 32 row values took 79 (ptxas, 256 threads)."""
    fits = [{"block": b, "items": i} for b in BLOCKS for i in ITEMS if b * i >= n and not (b == 1024 and i == 32)]
    fits.sort(key=lambda c: (c["block"] * c["items"], abs(c["block"] - 256)))
    resident = [c for c in fits if c["block"] * c["items"] < 2 * n] or fits[:1]
    return resident + [{"block": b, "items": 0} for b in BLOCKS]


class CublasEpilogueGeluSoftmax(gradients.FusedGeluSoftmax, CudaVariant):
    name = "cublas_epilogue"
    problem = "matmul_gelu_softmax"
    kind = "cublas_epilogue"
    description = "addmm through cuBLAS, then one row kernel: GELU + stable softmax, the row in registers"
    source = "csrc/gelu_softmax_rows.cu"
    launchers = {"af_gelu_softmax_rows": ("ptr", "int", "ptr", "ptr", "int", "int", "int"),
                 "af_gelu_bf16": ("ptr", "ptr", "int", "int")}  # the row kernel's table against erff, for tests
    supports_autograd = True
    dtypes = (torch.float32, torch.bfloat16)
    bfloat16_gradients = True

    @classmethod
    def configs(cls, shape, device):
        return row_configs(shape["out_features"])

    def forward(self, model, x):
        weight, bias = linear_parameters(model.linear)
        if weight.dtype is not torch.bfloat16 or needs_grad(x, weight, bias):
            return super().forward(model, x)  # through _fused, differentiably
        return self._bfloat16_model(x, weight, bias)[0]

    def _bfloat16_model(self, x, weight, bias):
        """(out, y) of a bfloat16 model: y is the reference's own bfloat16 logits."""
        y = bfloat16_model_linear(self, x, weight, bias, "linear")
        out = torch.empty_like(y)
        self.launch("af_gelu_softmax_rows", y, 1, None, out, 1, *y.shape, device=y.device)
        return out, y

    def _fused(self, x, weight, bias, save):
        if weight.dtype is torch.bfloat16:  # a bfloat16 model's call that needs a gradient
            out, y = self._bfloat16_model(x, weight, bias)
            return out, ((x, weight, bias, y, None, out) if save else ())
        x, w, b = gemm_operands(x, weight, bias, "linear")
        w = self.gemm_weight(weight) if self.precision == "bf16" else w  # the cached bf16 copy of the parameter
        x = gemm_input(x, self.precision)  # kept for dW as the GEMM read it: the backward casts nothing
        y, bias_left = linear_deferring_bias(x, w, b, self.precision)
        y = y.contiguous()
        out = y if y.dtype == torch.float32 and not save else torch.empty(y.shape, device=y.device)
        self.launch("af_gelu_softmax_rows", y, int(y.dtype == torch.bfloat16), bias_left, out, 0, x.shape[0],
                    w.shape[0], device=x.device)  # fmt: skip
        return out, ((x, w, b, y, bias_left, out) if save else ())


@hookimpl
def autofuse_register_variants():
    return [CublasEpilogueGeluSoftmax]
