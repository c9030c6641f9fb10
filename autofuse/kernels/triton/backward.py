"""The backward's GEMMs on float16 tensor cores, for the triton variants whose fp32 forward runs there.

A triton variant on split_fp16 (fp32) multiplies x·Wᵀ on float16 hi and lo parts of rows scaled by
powers of two (``gemm.fp16_row_parts``; docs/precision.md). Its backward multiplies the
same way (``Fp16Gemms``), where cuBLAS fp32 took 5.44 ms for dx = dy·W and dW = dyᵀ·x at
1024×8192² on an H100 (the split: 1.52) and 21.53 at 16384×4096² (6.78), with 4-7x less
error (relative L2 against float64: 2.4e-7 and 1.5e-7 for dx and dW at 1024×8192², cuBLAS fp32
1.6e-6 and 5.7e-7). Each GEMM takes K-major operands
(``triton_gemm.tile_accumulator``) with scales outside the contraction, so the kernel undoes them
exactly:
- dx = dy·W: dy's rows as they are (K = out features), and W's columns, scaled per column and
  written transposed (``column_parts``), kept while the weight is unchanged (the forward's own
  parts of W are kept likewise);
- dW = dyᵀ·x: the columns of dy and of x (K = the batch), scaled per column, written transposed.
The accuracy bounds of the forward's operands hold per row of dy and per column of W, dy and x.
The tile configuration is the variant's own (its forward's tuned one); TMA where the
contraction's float16 rows are 16-byte aligned, pointer loads otherwise.

The tf32 variants (scaled_fp16: hi alone) keep cuBLAS's TF32. Their backward on float16 hi parts
was 15% faster at 1024×8192² and no faster at 16384×4096², and its 11-bit products put 1 to 5 of
gemm_bn's 780,000 eval weight-gradient elements at batch 37 past the tf32 gate's tolerance, where
cuBLAS (which multiplies so short a contraction in float32) passed (H100).
"""

from __future__ import annotations

from typing import Any

import torch

from autofuse.core.variant import FoldCache
from autofuse.kernels.autograd import CUBLAS, CublasGemms, GemmGrad, GradLayouts
from autofuse.kernels.triton.host import (
    Operand,
    fp16_parts,
    fused_kernels_apply,
    gemm_kernels,
    interpreting,
    launch_grid,
    loop_operands,
)

# Rows × columns of src per step of ``fp16_col_parts``: 32 columns make 128-byte row segments.
COLUMN_BLOCK = (64, 32)
# Rows per program of the column passes: at least 256, at most 64 chunks (their maxima are merged
# in one tile), so 16384×4096 takes 128 × 64 programs and 1024×8192 256 × 4.
MIN_CHUNK, MAX_CHUNKS = 256, 64


class Fp16Gemms(CublasGemms):
    """dx and dW on float16 hi and lo parts ("3xfp16"), in the main-loop configuration ``params``
    (a triton variant's). Where the kernels cannot take the tensors (float64 under gradcheck, the
    CPU without the interpreter) cuBLAS multiplies."""

    def __init__(self, params: dict[str, Any]):
        self.params = params
        self._columns = FoldCache()  # W's column parts

    def layouts(self, precision: str, need_x: bool, need_weight: bool, need_bias: bool) -> GradLayouts:
        # dy's rows serve both GEMMs: the column parts read them, so no dyᵀ.
        return GradLayouts(rows=need_x or need_weight, cols=False, sums=need_bias)

    def __call__(self, grad: GemmGrad, x: torch.Tensor, weight: torch.Tensor, precision: str, need_x: bool,
                 need_weight: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        dy = grad.dy
        if dy is None or not fused_kernels_apply(dy, x.detach(), weight.detach()):
            return CUBLAS(grad, x, weight, precision, need_x, need_weight)
        dx = self.matmul(fp16_parts(dy, True), self._weight_columns(weight.detach())) if need_x else None
        dw = self.matmul(column_parts(dy, True), column_parts(x.detach(), True)) if need_weight else None
        return dx, dw

    def matmul(self, a: Operand, b: Operand) -> torch.Tensor:
        """a·bᵀ in float32 for K-major float16 parts a (m × k) and b (n × k) with their rows' scales."""
        p = self.params
        (m, k), n = a[0].shape, b[0].shape[0]
        if m == 0 or n == 0 or k == 0:  # k = 0: an empty batch's dW, whose scales nobody wrote
            return torch.zeros(m, n, device=a[0].device)
        out = torch.empty(m, n, device=a[0].device)
        blocks = (p["block_m"], p["block_n"], p["block_k"]) if p["tma"] and k % 8 == 0 else None
        kernels = gemm_kernels()
        kernels.persistent_gemm[launch_grid(m, n, p["block_m"], p["block_n"], p["persistent"], out.device)](
            **loop_operands(a, b, True, blocks), M=m, N=n, K=k, epilogue_args=(out,), BLOCK_M=p["block_m"],
            BLOCK_N=p["block_n"], BLOCK_K=p["block_k"], GROUP_M=p["group_m"], MODE="3xfp16", TMA=blocks is not None,
            EVEN_K=k % p["block_k"] == 0, INTERPRET=interpreting(), EPILOGUE=kernels.epilogue("store_tile"),
            num_warps=p["warps"], num_stages=p["stages"])
        return out

    def _weight_columns(self, weight: torch.Tensor) -> Operand:
        """W's column parts (Wᵀ's rows: n_in × n_out), made again only when W changes."""
        return self._columns.get([weight], lambda: column_parts(weight, True))


def column_parts(t: torch.Tensor, split: bool) -> Operand:
    """(hi, lo, inverse scales) of tᵀ for a contiguous 2-D float32 ``t`` (rows × cols): float16
    (cols × rows), scaled per column of t (``triton_gemm.column_max``, then ``fp16_col_parts``);
    lo is hi unless ``split``."""
    rows, cols = t.shape
    hi = torch.empty(cols, rows, device=t.device, dtype=torch.float16)
    lo = torch.empty_like(hi) if split else hi
    inv_scale = torch.empty(cols, device=t.device)
    if cols and rows:  # no rows: an empty contraction (``Fp16Gemms.matmul``)
        block_r, block_c = COLUMN_BLOCK
        chunk = -(-max(MIN_CHUNK, -(-rows // MAX_CHUNKS)) // block_r) * block_r
        chunks = -(-rows // chunk)
        part_max = torch.empty(chunks, cols, device=t.device)
        grid = (-(-cols // block_c), chunks)
        kernels = gemm_kernels()
        kernels.column_max[grid](t, part_max, rows, cols, chunk, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)
        kernels.fp16_col_parts[grid](t, part_max, hi, lo, inv_scale, rows, cols, chunk, chunks, SPLIT=split,
                                     BLOCK_R=block_r, BLOCK_C=block_c, BLOCK_P=max(2, 1 << (chunks - 1).bit_length()),
                                     num_warps=4)
    return hi, lo, inv_scale
