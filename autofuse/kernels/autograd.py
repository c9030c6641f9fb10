"""Autograd for fused variants: the fused forward saves what its backward needs, nothing more.

Every fused variant (cuBLAS + epilogue, the CUDA families, the Triton family, 51's row
kernels) follows one pattern. Its forward is a function of the input and of the model tensors
that may need gradients (``inputs``); it returns the output and the tensors its problem's
backward needs (``saved``). ``fused_call`` runs it plainly when no gradient is needed (no
autograd node, nothing saved), and inside ``FusedFunction`` otherwise. The backward is the
problem's (``variants/<problem>/gradients.py``): the epilogue's backward fused into one pass,
which writes ∂L/∂y in the layouts the GEMMs after it want and the bias gradient's partial sums
(``GradLayouts``), then the GEMMs of the backward through the variant's ``gemms``: cuBLAS at
the forward's precision (``CublasGemms``), or, for a triton variant whose fp32 forward runs on
float16 parts, the same parts (``triton_backward.Fp16Gemms``). A forward that cannot cheaply
save an intermediate saves None in its place and the backward recomputes it (the SIMT CUDA
kernels never store the logits).

The backward runs when the caller's ``loss.backward()`` runs, outside the variant's
``math_mode``: precision is re-established here, so a tf32 forward has a tf32 backward and an
fp32 one never lets TF32 in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from autofuse.core.precision import linear, math_mode
from autofuse.kernels.triton.host import epilogue_kernels, fused_kernels_apply, transposed

Saved = Sequence[torch.Tensor | None]


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether a call with these tensors must record a backward: grad mode on and one requires grad."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


@dataclasses.dataclass(frozen=True)
class FusedOp:
    """A fused forward and the backward of its problem, at one precision.

    ``forward(*inputs, save)`` returns (out, saved); with ``save=False`` saved is ignored and
    the forward should store nothing extra. ``backward(saved, grad, needs)`` returns one
    gradient (or None) per input; ``needs[i]`` says whether input i needs one.
    """

    forward: Callable[..., tuple[torch.Tensor, Saved]]
    backward: Callable[[Saved, torch.Tensor, Sequence[bool]], Sequence[torch.Tensor | None]]
    precision: str


class FusedFunction(torch.autograd.Function):
    """Records the backward of a forward that already ran: ``result`` is its (out, saved)."""

    @staticmethod
    def forward(ctx, op: FusedOp, result: tuple[torch.Tensor, Saved], *inputs):
        out, saved = result
        ctx.op = op
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx, grad):
        op: FusedOp = ctx.op
        with math_mode(op.precision):
            grads = op.backward(ctx.saved_tensors, grad.contiguous(), ctx.needs_input_grad[2:])
        return (None, None, *grads)


def fused_call(op: FusedOp, *inputs: torch.Tensor | None) -> torch.Tensor:
    """``op``'s output for ``inputs``, differentiable with respect to each that requires grad.

    With a gradient needed the forward runs first (under no_grad, as inside an autograd
    Function) and its node is recorded after: the kernels are queued before ``Function.apply``'s
    host time (~30 µs), which then overlaps them instead of delaying them for a caller that
    synchronizes around each call (KernelBench's harness). The harness's grad/no-grad ratio
    stayed ~0.95 on 22 and 99 all the same: what is left is the GEMM storing the logits the
    backward needs (on an H100 at 1024×8192², fp32, 22's GEMM kernel took 1.285 ms with grad on and
    1.260 under no_grad; benchmarks/gpu/grad_forward.py measures the harness both ways)."""
    if needs_grad(*inputs):
        with torch.no_grad():
            result = op.forward(*inputs, save=True)
        return FusedFunction.apply(op, result, *inputs)
    out, _ = op.forward(*inputs, save=False)
    return out


@dataclasses.dataclass(frozen=True)
class GradLayouts:
    """What a fused epilogue backward writes of ∂L/∂y (y = x·Wᵀ + b), in its one pass over y.

    ``rows``: dy itself (batch × out), for dx = dy·W, and for dW where dyᵀ is not wanted.
    ``cols``: dyᵀ (out × batch, contiguous) for dW = dyᵀ·x under tf32. Hopper's tensor cores read
    TF32 operands K-major only, and dW contracts over the batch, the slow dimension of both dy and
    x: cuBLAS's kernel for that took 0.570 ms where the same product with dyᵀ given took 0.417
    (1024×8192×8192), 2.042 against 1.330 (16384×4096×4096; H100, cuBLAS through torch, interleaved).
    One K-major operand is enough (both: 0.401 and 1.291), and the backward kernel writes dyᵀ for
    the cost of writing dy, where a transpose pass took 0.027 and 0.188 ms.
    ``sums``: Σ_rows dy (the bias gradient), as float32 partial sums per block of rows.
    ``dtype``: of dy and dyᵀ: bfloat16 under bf16 (the backward GEMMs' operand dtype), else float32.
    """

    rows: bool
    cols: bool
    sums: bool
    dtype: torch.dtype = torch.float32


def grad_layouts(precision: str, need_x: bool, need_weight: bool, need_bias: bool) -> GradLayouts:
    """The layouts of ∂L/∂y that the backward GEMMs and the bias gradient of ``needs`` want."""
    cols = need_weight and precision == "tf32"
    return GradLayouts(rows=need_x or (need_weight and not cols), cols=cols, sums=need_bias,
                       dtype=torch.bfloat16 if precision == "bf16" else torch.float32)


@dataclasses.dataclass
class GemmGrad:
    """∂L/∂y as an epilogue backward wrote it (``GradLayouts``): dy, dyᵀ, Σ_rows dy (each or None)."""

    dy: torch.Tensor | None
    dy_t: torch.Tensor | None
    bias: torch.Tensor | None

    @classmethod
    def of(cls, dy: torch.Tensor, layouts: GradLayouts) -> GemmGrad:
        """From dy computed in full (a torch formula): dy in the layouts' dtype where it is float32
        (float64 stays, for gradcheck), its row sum, and no dyᵀ (``backward_gemms`` copies x instead)."""
        rows = dy.to(layouts.dtype) if dy.dtype == torch.float32 else dy
        return cls(rows, None, reduce_rows(dy) if layouts.sums else None)


class GradBuffers:
    """The outputs of a Triton epilogue backward for ``layouts`` at (M rows, N columns), whose
    programs take ``row_block`` rows each (the partial sums' blocks), and its launch arguments:
    ``dy_ptr``, ``dyt_ptr``, ``part_ptr`` (None where not written) and ROWS, COLS, SUMS."""

    def __init__(self, layouts: GradLayouts, m: int, n: int, row_block: int, device: torch.device):
        self.dy = torch.empty(m, n, device=device, dtype=layouts.dtype) if layouts.rows else None
        self.dy_t = torch.empty(n, m, device=device, dtype=layouts.dtype) if layouts.cols else None
        self.parts = torch.empty(-(-m // row_block), n, device=device) if layouts.sums else None
        self.args = {"dy_ptr": self.dy, "dyt_ptr": self.dy_t, "part_ptr": self.parts,
                     "ROWS": layouts.rows, "COLS": layouts.cols, "SUMS": layouts.sums}

    def result(self, bias_dtype: torch.dtype = torch.float32) -> GemmGrad:
        """What the kernel wrote, the bias's gradient (Σ of the partial sums) in ``bias_dtype``."""
        return GemmGrad(self.dy, self.dy_t, None if self.parts is None else sum_partials(self.parts, bias_dtype))


# column_sums: partial sums added at once, columns per program, warps. Narrow, for many programs:
# 4.0 µs at 16 × 8192 and 13.5 at 256 × 8192 against 5.1 and 27.3 for (16, 64, 2), 4.9 and 24.3 for
# (16, 128, 4); torch's sum and cast to bfloat16 9.6 and 16.3 (H100, interleaved medians).
PARTIAL_SUMS_BLOCK = (16, 32, 1)


def sum_partials(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Σ over the rows of an epilogue backward's partial sums (float32, blocks × N) in ``dtype``:
    one Triton launch (``column_sums``), rounded once, where a bfloat16 model's bias took torch's
    sum and then autograd's cast (22's step at 1024×8192²: 2.0 µs against 4.7 and 1.6, H100); else torch."""
    if not fused_kernels_apply(parts):
        return parts.sum(0).to(dtype)
    (p, n), (block_p, block_n, warps) = parts.shape, PARTIAL_SUMS_BLOCK
    out = torch.empty(n, device=parts.device, dtype=dtype)
    epilogue_kernels().column_sums[(-(-n // block_n),)](parts, out, p, n, BLOCK_P=block_p, BLOCK_N=block_n,
                                                         num_warps=warps)
    return out


class CublasGemms:
    """How a backward multiplies after its epilogue's backward: ``layouts`` says which forms of
    ∂L/∂y to write, the call returns (dx, dW). This one is cuBLAS at the forward's precision
    (``grad_layouts``, ``backward_gemms``), every fused variant's unless its forward multiplies
    otherwise: the triton variants on float16 parts use ``triton_backward.Fp16Gemms``."""

    def layouts(self, precision: str, need_x: bool, need_weight: bool, need_bias: bool) -> GradLayouts:
        return grad_layouts(precision, need_x, need_weight, need_bias)

    def __call__(self, grad: GemmGrad, x: torch.Tensor, weight: torch.Tensor, precision: str, need_x: bool,
                 need_weight: bool, out: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return backward_gemms(grad, x, weight, precision, need_x, need_weight, out)


CUBLAS = CublasGemms()


def backward_gemms(grad: GemmGrad, x: torch.Tensor, weight: torch.Tensor, precision: str, need_x: bool,
                   need_weight: bool, out: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dx, dW) of y = x·Wᵀ given ∂L/∂y: dx = dy·W and dW = dyᵀ·x through cuBLAS.

    At the forward's precision (the caller's ``math_mode``): float32 (TF32 per the mode), or
    under bf16 with bfloat16 operands and float32 accumulation, as the forward's GEMM, with
    results in ``out``, the model's dtype (the upstream gradient's). ``x`` and ``weight`` are the
    forward's GEMM operands (under bf16 their bfloat16 copies), so the backward reads the operands
    the forward used; their dtype is not the model's. Taking it from x's wrote a float32 model's
    dW in bfloat16 at cast_pass, rounded, and autograd converted it after: 0.21 ms of gemm_bn's
    1.13 ms bf16 training step at 2048×8192² (H100).

    A bfloat16 model's gradients (``out`` bfloat16) come from cuBLAS in
    bfloat16, rounded once from the float32 sums as eager's are. In float32, autograd converted
    them after a write twice the size: at 1024×8192², dW's GEMM took 0.221 ms and its conversion
    0.094, against 0.193 written in bfloat16 (H200); the triton training steps of a bfloat16
    model went from 0.626 to 0.504 ms (99) and from 0.588 to 0.464 (22; eager 0.590).
    """
    dy, dx, dw = grad.dy, None, None
    if not (need_x or need_weight):
        return None, None
    if precision == "bf16" and x.dtype in (torch.float32, torch.bfloat16):  # bfloat16: the forward's copy
        wb = weight.bfloat16()
        dyb = dy.bfloat16()  # written in bfloat16 by the fused kernels: no pass
        if need_x:
            dx = _bf16_mm(dyb, wb, out)
        if need_weight:
            dw = _bf16_weight_gradient(dyb, x.bfloat16(), out)
        return dx, dw
    if need_x:
        dx = dy.to(weight.dtype) @ weight
    if need_weight:
        dw = _weight_gradient(grad, x, precision)
    return dx, dw


def _weight_gradient(grad: GemmGrad, x: torch.Tensor, precision: str) -> torch.Tensor:
    """dW = dyᵀ·x, contracting over the batch: the slow dimension of both dy and x.

    Under tf32, from dyᵀ where the epilogue backward wrote it (``GradLayouts``), else on CUDA
    from a K-major copy of x made by a Triton transpose (``triton_variant.transposed``): with x
    copied the product took 0.381 and 1.305 ms (the shapes of ``GradLayouts``; torch's own copy
    of a transposed view runs at 0.9 TB/s, a third of the Triton one's). Under fp32 and bf16 the
    layouts cost nothing, so dW takes them as they are.
    """
    if precision == "tf32" and grad.dy_t is not None:
        return grad.dy_t.to(x.dtype) @ x
    dy = grad.dy.to(x.dtype)
    if precision == "tf32" and dy.is_cuda:
        return dy.t() @ transposed(x).t()
    return dy.t() @ x


def _bf16_weight_gradient(dy: torch.Tensor, x: torch.Tensor, out: torch.dtype) -> torch.Tensor:
    """dyᵀ·x for bfloat16 dy and x (``_bf16_mm``). A batch of one row gets a zero row appended to
    both: contracting two rows is the one row's outer product to the bit (p + 0·0). For a
    contraction of one, cuBLAS runs a CUTLASS sm75 kernel
    (``cutlass_75_tensorop_bf16_s1688gemm_bf16_64x64_nn_align1``): 107 µs for 8192² bfloat16 on an
    H100, where two rows take its sm90 kernel, 48 µs, and so 22's bfloat16-model training step at
    batch 1 went from 0.1840 to 0.1369 ms (``profile_step.py``; torch.compile's, which keeps the
    sm75 kernel, 0.1648). On an H200 the broadcast product ``dyᵀ * x`` took 133 µs (PyTorch's
    kernel for a broadcast is not vectorized) and the float32 GEMMs of one and two rows ran alike
    (103 and 98 µs), so only bf16 pads."""
    if x.shape[0] == 1:
        dy, x = F.pad(dy, (0, 0, 0, 1)), F.pad(x, (0, 0, 0, 1))
    return _bf16_mm(dy.t(), x, out)


def _bf16_mm(a: torch.Tensor, b: torch.Tensor, out: torch.dtype) -> torch.Tensor:
    """a·b with bfloat16 operands and float32 accumulation (as the forward's bf16 GEMM), the
    result in ``out``: float32 or bfloat16."""
    if not a.is_cuda:
        return (a.float() @ b.float()).to(out)  # the CPU: rounded operands, float32 sums
    if out == torch.bfloat16:
        return torch.mm(a, b)
    try:
        return torch.mm(a, b, out_dtype=torch.float32)
    except (TypeError, RuntimeError):  # a torch without out_dtype: one bf16 rounding more
        return torch.mm(a, b).float()


def saved_logits(x, weight, bias, y, y_bias, precision: str) -> torch.Tensor:
    """The forward's logits x·Wᵀ + b from what it saved: y itself, y plus the bias it left to its
    epilogue (bf16 cuBLAS), or (y None: the kernel never stored them) one GEMM again."""
    if y is None:
        return linear(x, weight, bias, precision)
    return y.float() + y_bias if y_bias is not None else y


def reduce_rows(t: torch.Tensor) -> torch.Tensor:
    """Σ over the batch in float32 (a bias gradient), whatever ``t``'s dtype."""
    return t.sum(0, dtype=torch.float32) if t.dtype != torch.float64 else t.sum(0)
