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
The accuracy bounds of the forward's operands hold per row of dy and per column of W, dy and x,
and the forward's range check (docs/precision.md) guards them: a row of dy or a column of W, dy
or x whose parts lose what its partners would carry is flagged (a negated inverse scale), and a
tile holding one is multiplied in float32 from dy, Wᵀ or xᵀ, read in place through their strides
(``triton_gemm.exact_tile``), with no host sync. dy's rows are judged as the forward's x (losses
weighted by W's row maxima, kept with W's column parts); W's columns as the forward's W (the count
rule, made once per W); the columns of dy and x by their losses weighted by the other's row maxima
(``dw_operands``). On ordinary inputs the check costs the column passes a load of the row weights,
(3 or 2) × chunks × columns floats written and read back by ``column_flags`` (one launch per operand),
a zeroed buffer of 2·(batch + 1) floats and atomics only where a row's running max grows.
The tile configuration is the variant's own (its forward's tuned one); TMA where the
contraction's float16 rows are 16-byte aligned, pointer loads otherwise.

The tf32 variants (scaled_fp16: hi alone) keep cuBLAS's TF32. Their backward on float16 hi parts
was 15% faster at 1024×8192² and no faster at 16384×4096², and its 11-bit products put 1 to 5 of
gemm_bn's 780,000 eval weight-gradient elements at batch 37 past the tf32 gate's tolerance, where
cuBLAS (which multiplies so short a contraction in float32) passed (H100).
"""

from __future__ import annotations

import dataclasses
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
    launch_main_loop,
    loop_operands,
)

# Rows × columns of src per step of ``fp16_col_parts``: 32 columns make 128-byte row segments.
COLUMN_BLOCK = (64, 32)
# Rows per program of the column passes: at least 256, at most 64 chunks (their maxima are merged
# in one tile), so 16384×4096 takes 128 × 64 programs and 1024×8192 256 × 4.
MIN_CHUNK, MAX_CHUNKS = 256, 64
TINY = torch.finfo(torch.float32).tiny


class Fp16Gemms(CublasGemms):
    """dx and dW on float16 hi and lo parts ("3xfp16"), in the main-loop configuration ``params``
    (a triton variant's), range-checked (``dx_operands``, ``dw_operands``). Where the kernels cannot
    take the tensors (float64 under gradcheck, the CPU without the interpreter) cuBLAS multiplies."""

    def __init__(self, params: dict[str, Any]):
        self.params = params
        self._columns = FoldCache()  # W's column parts, flagged, and the weights of dy's rows' check

    def layouts(self, precision: str, need_x: bool, need_weight: bool, need_bias: bool) -> GradLayouts:
        # dy's rows serve both GEMMs: the column parts read them, so no dyᵀ.
        return GradLayouts(rows=need_x or need_weight, cols=False, sums=need_bias)

    def __call__(self, grad: GemmGrad, x: torch.Tensor, weight: torch.Tensor, precision: str, need_x: bool,
                 need_weight: bool, out: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        dy, x, weight = grad.dy, x.detach(), weight.detach()
        if dy is None or not fused_kernels_apply(dy, x, weight):
            return CUBLAS(grad, x, weight, precision, need_x, need_weight, out)
        dx = self.matmul(*dx_operands(dy, self._weight_columns(weight))) if need_x else None
        dw = self.matmul(*dw_operands(dy, x)) if need_weight else None
        return dx, dw

    def matmul(self, a: Operand, b: Operand) -> torch.Tensor:
        """a·bᵀ in float32 for K-major float16 parts a (m × k) and b (n × k) with their rows' scales
        (negative where flagged) and float32 sources (a fourth element: any strides)."""
        p = self.params
        (m, k), n = a[0].shape, b[0].shape[0]
        if m == 0 or n == 0 or k == 0:  # k = 0: an empty batch's dW, whose scales nobody wrote
            return torch.zeros(m, n, device=a[0].device)
        out = torch.empty(m, n, device=a[0].device)
        blocks = (p["block_m"], p["block_n"], p["block_k"]) if p["tma"] and k % 8 == 0 else None
        kernels = gemm_kernels()
        launch_main_loop(
            launch_grid(m, n, p["block_m"], p["block_n"], p["persistent"], out.device), p["persistent"],
            **loop_operands(a, b, True, blocks), M=m, N=n, K=k, epilogue_args=(out,), BLOCK_M=p["block_m"],
            BLOCK_N=p["block_n"], BLOCK_K=p["block_k"], GROUP_M=p["group_m"], MODE="3xfp16", TMA=blocks is not None,
            EVEN_K=k % p["block_k"] == 0, INTERPRET=interpreting(), EPILOGUE=kernels.epilogue("store_tile"),
            num_warps=p["warps"], num_stages=p["stages"])
        return out

    def _weight_columns(self, weight: torch.Tensor) -> tuple[Operand, torch.Tensor]:
        """``weight_columns``, made again only when W changes."""
        return self._columns.get([weight], lambda: weight_columns(weight))


def weight_columns(w: torch.Tensor) -> tuple[Operand, torch.Tensor]:
    """W's column parts (Wᵀ's rows: n_in × n_out) with Wᵀ (a view) for the exact path, its columns
    flagged by the count rule of the forward's W (``fp16_row_parts``' STATS: W is cached, so the
    flag cannot depend on dy); and W's row maxima over their max: how far a loss in dy's row reaches
    (dy·W multiplies dy[:, i] by W's row i), the weights of dy's rows' check. One pass for all three
    beyond the parts' own (atomics for the row maxima)."""
    n_out = w.shape[0]
    row_max = torch.zeros(n_out + 1, device=w.device)
    hi, lo, inv_scale = column_parts(w, True, maxima=column_maxima(w, row_max), stats=True)
    return (hi, lo, inv_scale, w.t()), row_max[:n_out] / row_max[n_out].clamp_min(TINY)


def dx_operands(dy: torch.Tensor, columns: tuple[Operand, torch.Tensor]) -> tuple[Operand, Operand]:
    """dx = dy·W's operands: dy's rows (K = out features), flagged by their losses weighted by W's
    row maxima (``fp16_row_parts``' FLAG, as the forward's x), and W's cached columns."""
    w_columns, dy_weight = columns
    hi, lo, inv_scale = fp16_parts(dy, True, col_weight_ptr=dy_weight, FLAG=True)
    return (hi, lo, inv_scale, dy), w_columns


def dw_operands(dy: torch.Tensor, x: torch.Tensor) -> tuple[Operand, Operand]:
    """dW = dyᵀ·x's operands: the columns of dy and of x (K = the batch), each flagged by its losses
    weighted by the other's row maxima (dW[i, j] multiplies dy[r, i] by x[r, j]), which the column
    maxima's pass finds (``column_max``); dyᵀ and xᵀ as views for the exact path."""
    batch = dy.shape[0]
    row_max = torch.zeros(2, batch + 1, device=dy.device)  # dy's, then x's: one zeroing launch
    dy_max, x_max = column_maxima(dy, row_max[0]), column_maxima(x, row_max[1])
    dy_cols = column_parts(dy, True, maxima=dy_max, row_weight=row_max[1])
    x_cols = column_parts(x, True, maxima=x_max, row_weight=row_max[0])
    return (*dy_cols, dy.t()), (*x_cols, x.t())


@dataclasses.dataclass(frozen=True)
class ColumnMaxima:
    """``column_max``'s result for a 2-D float32 t: rows per chunk, chunk count, and the chunks'
    column maxima (chunks × cols)."""

    chunk: int
    chunks: int
    part_max: torch.Tensor


def column_maxima(t: torch.Tensor, row_max: torch.Tensor | None = None) -> ColumnMaxima | None:
    """Each chunk of rows' column maxima of ``t`` (``triton_gemm.column_max``), and with ``row_max``
    (rows + 1 floats, zeroed) the row maxima and t's max into it; None for an empty t."""
    rows, cols = t.shape
    if not (rows and cols):
        return None
    block_r, block_c = COLUMN_BLOCK
    chunk = -(-max(MIN_CHUNK, -(-rows // MAX_CHUNKS)) // block_r) * block_r
    chunks = -(-rows // chunk)
    part_max = torch.empty(chunks, cols, device=t.device)
    gemm_kernels().column_max[(-(-cols // block_c), chunks)](t, part_max, rows, cols, chunk, BLOCK_R=block_r,
                                                             BLOCK_C=block_c, row_max_ptr=row_max, num_warps=4)
    return ColumnMaxima(chunk, chunks, part_max)


def column_parts(t: torch.Tensor, split: bool, maxima: ColumnMaxima | None = None,
                 row_weight: torch.Tensor | None = None, stats: bool = False) -> Operand:
    """(hi, lo, inverse scales) of tᵀ for a contiguous 2-D float32 ``t`` (rows × cols): float16
    (cols × rows), scaled per column of t (``maxima``, made here if not given, then
    ``fp16_col_parts``); lo is hi unless ``split``. Range-checked with ``row_weight`` (FLAG: the
    other operand's row maxima, their max last) or ``stats`` (the count rule): a flagged column's
    inverse scale is negated (``column_flags``)."""
    rows, cols = t.shape
    hi = torch.empty(cols, rows, device=t.device, dtype=torch.float16)
    lo = torch.empty_like(hi) if split else hi
    inv_scale = torch.empty(cols, device=t.device)
    maxima = column_maxima(t) if maxima is None else maxima
    if maxima is None:  # no rows: an empty contraction (``Fp16Gemms.matmul``)
        return hi, lo, inv_scale
    block_r, block_c = COLUMN_BLOCK
    check = row_weight is not None or stats
    # losses (or counts of losing elements), counts of terms (``few_terms``), FLAG's budgets
    losses = torch.empty(3 if row_weight is not None else 2, maxima.chunks, cols, device=t.device) if check else None
    block_p = max(2, 1 << (maxima.chunks - 1).bit_length())
    kernels = gemm_kernels()
    kernels.fp16_col_parts[(-(-cols // block_c), maxima.chunks)](
        t, maxima.part_max, hi, lo, inv_scale, rows, cols, maxima.chunk, maxima.chunks, SPLIT=split, BLOCK_R=block_r,
        BLOCK_C=block_c, BLOCK_P=block_p, row_weight_ptr=row_weight, loss_ptr=losses, FLAG=row_weight is not None,
        STATS=stats and row_weight is None, num_warps=4)
    if check:
        kernels.column_flags[(-(-cols // block_c),)](losses, inv_scale, rows, cols, maxima.chunks, SPLIT=split,
                                                     FLAG=row_weight is not None, BLOCK_C=block_c, BLOCK_P=block_p,
                                                     num_warps=4)
    return hi, lo, inv_scale
