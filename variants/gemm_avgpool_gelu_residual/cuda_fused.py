"""``gemm_avgpool_gelu_residual``, CUDA kernels on the simplified algebra: naive, tiled, single pass.

The mean over out_features of x·Wᵀ + b − subtract is x·w̄ + c with w̄ = mean(W, 0) (length
in_features) and c = mean(b) − mean(subtract); logsumexp over a size-1 dimension is the
identity. So out = x + gelu(x·w̄ + c): one scalar per row added to the whole row, and the
(batch × out × in) GEMM is provably unnecessary. w̄ and c are computed with torch and cached
(``FoldCache``, keyed on weight, bias and subtract, as the simplified variant does); c stays
on the device, so no call synchronises. Memory floor: read x once, write out once
(128 MB at 2048×8192, ~30 µs at the H200's ~4.3 TB/s copy bandwidth).

- ``cuda_naive``: one thread per row sums the dot product sequentially, then one thread per
  output element writes x + gelu(z[row]) (csrc/rows_naive.cu).
- ``cuda_tiled``: one block per row, coalesced strided dot product, block reduction, GELU,
  then a second strided pass writes x + g re-reading x from L2 (csrc/rows_tiled.cu).
- ``single_pass`` (kind cuda_templated): one block per row reads the row once into
  registers and writes x + g from them (csrc/rows_single_pass.cu). It serves
  in_features ≤ 1024·4·16 = 65536 only; beyond that ``configs`` is empty and the tuner
  skips it. For 32768 < in_features ≤ 65536 its one configuration (1024 threads × 16
  float4) spills 88 bytes (64 registers per thread at 1024 threads); all others spill none.

Preconditions: float32 CUDA tensors (made contiguous), or for ``single_pass`` a bfloat16
model's (x and out bfloat16, w̄ and c folded in float32); the exact erf GELU; NaN in x
propagates (x + g). fp32 FMA only, so these run under every precision. Autograd: the backward
is two GEMVs and rank-one terms (gradients.py); the forward saves x, w̄, c and the row values
r = x·w̄ + c its kernel computed anyway (one float per row), so the backward need not read x
for them.
"""

import torch

from autofuse.core.variant import FoldCache
from autofuse.hookspecs import hookimpl
from autofuse.kernels.autograd import fused_call
from autofuse.kernels.cuda_variant import CudaVariant, input_operand, operand

from . import gradients
from .simplified import fold_column_mean

_PROBLEM = "gemm_avgpool_gelu_residual"


class FoldedRowsVariant(CudaVariant):
    """The common host side: input contracts, the cached (w̄, c) and the fresh output."""

    problem = _PROBLEM
    supports_autograd = True

    def __init__(self, precision="fp32", **params):
        super().__init__(precision, **params)
        self._folded = FoldCache()

    def folded(self, model, device):
        """(w̄, c) as float32 tensors on ``device``, shapes (in,) and (): recomputed when W, b or subtract change.

        The parameter contracts are checked inside the fold: any change of a parameter's
        dtype or device, or of the input's device, changes the cache key and re-checks them.
        """
        gemm, subtract = model.gemm, model.subtract
        tensors = [t for t in (gemm.weight, gemm.bias, subtract) if t is not None]
        return self._folded.get(tensors, lambda: self._fold(gemm, subtract, device, gemm.weight.dtype),
                                 extra=(device,))

    @staticmethod
    def _fold(gemm, subtract, device, dtype):
        n_out, n_in = gemm.out_features, gemm.in_features
        operand(gemm.weight, "gemm.weight", (n_out, n_in), device, dtype)
        if gemm.bias is not None:
            operand(gemm.bias, "gemm.bias", (n_out,), device, dtype)
        operand(subtract, "subtract", (n_out,), device, dtype)
        w_mean, offset = fold_column_mean(gemm, subtract, torch.float32)
        return w_mean.contiguous(), offset.reshape(()).contiguous()

    def forward(self, model, x):
        gemm = model.gemm
        op = gradients.fused_op(lambda x, *_, save: self._fused(model, x, save), self.precision, gemm.out_features)
        return fused_call(op, x, gemm.weight, gemm.bias, model.subtract)

    def _fused(self, model, x, save):
        x = input_operand(x, model.gemm.in_features, self.input_dtype(model))
        w_mean, offset = self.folded(model, x.device)  # cached also under autograd: the backward maps dw̄ to dW
        out = torch.empty_like(x)
        r = self.run(x, w_mean, offset, out, save)
        return out, ((x, w_mean, offset, r) if save else ())

    def input_dtype(self, model) -> torch.dtype:
        """The dtype of x and out: float32 (a variant that serves bfloat16 models says so)."""
        return torch.float32

    def run(self, x, w_mean, offset, out, save: bool) -> torch.Tensor | None:
        """Write out = x + gelu(r) and return r = x·w̄ + c (one float per row) if ``save``,
        or whenever the kernel keeps it anyway; None otherwise."""
        raise NotImplementedError


class CudaNaiveGeluResidual(FoldedRowsVariant):
    name = "cuda_naive"
    kind = "cuda_naive"
    description = "one thread per row: sequential dot with mean(W,0); one thread per element: x + gelu(z[row])"
    source = "csrc/rows_naive.cu"
    launchers = {"af_rows_naive": ("ptr",) * 5 + ("int", "int")}

    def run(self, x, w_mean, offset, out, save):
        z = torch.empty(x.shape[0], device=x.device)
        self.launch("af_rows_naive", x, w_mean, offset, z, out, x.shape[0], x.shape[1], device=x.device)
        return z


class CudaTiledGeluResidual(FoldedRowsVariant):
    name = "cuda_tiled"
    kind = "cuda_tiled"
    description = "one block per row: coalesced dot + block reduction + GELU, second pass writes x + g from L2"
    source = "csrc/rows_tiled.cu"
    launchers = {"af_rows_tiled": ("ptr",) * 5 + ("int", "int")}

    @classmethod
    def configs(cls, shape, device):
        return [{"block": b} for b in (256, 128, 512, 1024)]

    def run(self, x, w_mean, offset, out, save):
        r = torch.empty(x.shape[0], device=x.device) if save else None
        self.launch("af_rows_tiled", x, w_mean, offset, out, r, x.shape[0], x.shape[1], device=x.device)
        return r


BLOCKS = (128, 256, 512, 1024)
VECS = (1, 4)
ITEMS = (1, 2, 4, 8, 16)
MAX_FLOATS_PER_THREAD = 64  # ITEMS·VEC row floats held in registers; more would spill


def single_pass_configs(in_features: int) -> list[dict]:
    """Valid (block, vec, items) for a row of ``in_features``, the default first; [] if none fits.

    Valid: the row fits (block·vec·items ≥ in_features) without being more than 2x
    oversized (idle threads), unless it is the smallest capacity that fits; vec = 4 only if
    in_features % 4 == 0; items·vec ≤ 64. Default: the smallest block with vec = 4 and
    items ≤ 8 (at 8192: 256 threads × 8 float4, 61 registers, no spills), else any valid.
    """
    candidates = [
        {"block": b, "vec": v, "items": i}
        for b in BLOCKS for v in VECS for i in ITEMS
        if i * v <= MAX_FLOATS_PER_THREAD and (v == 1 or in_features % 4 == 0)
    ]  # fmt: skip
    fitting = [c for c in candidates if _capacity(c) >= in_features]
    if not fitting:
        return []
    smallest = min(_capacity(c) for c in fitting)
    valid = [c for c in fitting if _capacity(c) < 2 * in_features or _capacity(c) == smallest]
    return sorted(valid, key=lambda c: (c["vec"] != 4, c["items"] > 8, c["block"], c["items"]))


def _capacity(c: dict) -> int:
    return c["block"] * c["vec"] * c["items"]


class SinglePassGeluResidual(FoldedRowsVariant):
    name = "single_pass"
    kind = "cuda_templated"
    description = "one block per row, the row read once into registers (float4), dot + GELU, written from registers"
    source = "csrc/rows_single_pass.cu"
    launchers = {"af_rows_single_pass": ("ptr",) * 5 + ("int", "int"),
                 "af_rows_single_pass_bf16": ("ptr",) * 5 + ("int", "int")}
    # A bfloat16 model too (under bf16, the only precision a bfloat16 input has): x read and out
    # written in bfloat16, half the float32 kernel's bytes at the memory floor; w̄, c, r float32.
    dtypes = (torch.float32, torch.bfloat16)
    bfloat16_gradients = True  # its backward's Triton passes take bfloat16 x and g (gradients.py)

    @classmethod
    def configs(cls, shape, device):
        return single_pass_configs(shape["in_features"])

    def input_dtype(self, model) -> torch.dtype:
        return torch.bfloat16 if model.gemm.weight.dtype == torch.bfloat16 else torch.float32

    def run(self, x, w_mean, offset, out, save):
        # Vector loads need 4-element alignment: a contiguous view into a larger tensor may
        # start mid-vector, so copy it then (out and w̄ are fresh allocations, aligned).
        if self.params.get("vec", 4) == 4 and x.data_ptr() % (4 * x.element_size()):
            x = x.clone()
        r = torch.empty(x.shape[0], device=x.device) if save else None
        launcher = "af_rows_single_pass_bf16" if x.dtype == torch.bfloat16 else "af_rows_single_pass"
        self.launch(launcher, x, w_mean, offset, out, r, x.shape[0], x.shape[1], device=x.device)
        return r


@hookimpl
def autofuse_register_variants():
    return [CudaNaiveGeluResidual, CudaTiledGeluResidual, SinglePassGeluResidual]
