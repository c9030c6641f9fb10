"""Precision classes, and the math modes that make them explicit.

Strictest first:

* ``ieee``: IEEE float32 arithmetic in the GEMM itself (float32 FMA: cuBLAS fp32, SIMT kernels).
* ``fp32`` (the default): float32 *accuracy*, verified. Float32 inputs and outputs, and an
  error against the float64 reference within the problem's fp32 tolerance at every input
  distribution. Everything ``ieee`` admits, and error-compensated tensor-core GEMMs (a = hi + lo
  in TF32 or in float16 on power-of-two-scaled rows, three products accumulated in float32)
  that pass that gate.
* ``tf32``: matrix products of operands rounded to TF32's 11 significant bits: TensorFloat-32
  matrix units, or float16 ones on power-of-two-scaled rows (the same products within 2²⁸ of a
  row's largest value).
* ``bf16``: bfloat16 operands (float32 accumulation); bfloat16 inputs too.

A call always runs inside ``math_mode(precision)``, which sets TF32 on or off for
its duration whatever the global flags say, so TF32 never gets in silently. A variant
declares the precisions it may serve (``Variant.precisions``); a compensated one leaves
out ``ieee``. An entry tuned at a stricter precision may serve a looser request
(``serving_order``), never the reverse.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autofuse.errors import InputError

PRECISIONS = ("ieee", "fp32", "tf32", "bf16")  # strictest first
# Precisions a problem states a tolerance for; ``ieee`` is judged by the fp32 tolerance.
TOLERANCE_PRECISIONS = ("fp32", "tf32", "bf16")

# Input dtypes each precision admits: bf16 tensors only make sense when bf16 is allowed.
_DTYPES = {
    "ieee": (torch.float32,),
    "fp32": (torch.float32,),
    "tf32": (torch.float32,),
    "bf16": (torch.float32, torch.bfloat16),
}


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise InputError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return precision


def serving_order(precision: str) -> tuple[str, ...]:
    """The precisions whose tuned entries may serve a ``precision`` request, preferred first:
    itself, then each stricter one (an fp32 entry serves tf32 and bf16 calls; never the reverse)."""
    index = PRECISIONS.index(check_precision(precision))
    return PRECISIONS[index::-1]


def tolerance_precision(precision: str) -> str:
    """The precision whose tolerance judges ``precision``: ``ieee`` results are held to fp32's."""
    return "fp32" if check_precision(precision) == "ieee" else precision


def check_dtype(dtype: torch.dtype, precision: str) -> None:
    if dtype not in _DTYPES[precision]:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in _DTYPES[precision])
        raise InputError(
            f"precision={precision!r} admits input dtypes ({allowed}), got {str(dtype).removeprefix('torch.')}"
            + ("; bfloat16 inputs need precision='bf16'" if dtype == torch.bfloat16 else "")
        )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if name not in dtypes:
        raise InputError(f"dtype must be one of {sorted(dtypes)}, got {name!r}")
    return dtypes[name]


# torch's own flag accessors: the `torch.backends` properties in front of them cost 0.4-1 µs per
# read or write (CPU, torch 2.13) and every dispatched call enters math_mode. Where a torch
# lacks them, the properties.
def _flag_accessors():
    c = torch._C
    if all(hasattr(c, f"_{op}_{lib}_allow_tf32") for op in ("get", "set") for lib in ("cublas", "cudnn")):
        return c._get_cublas_allow_tf32, c._get_cudnn_allow_tf32, c._set_cublas_allow_tf32, c._set_cudnn_allow_tf32
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    return (lambda: matmul.allow_tf32, lambda: cudnn.allow_tf32,
            lambda on: setattr(matmul, "allow_tf32", on), lambda on: setattr(cudnn, "allow_tf32", on))


_GET_CUBLAS, _GET_CUDNN, _SET_CUBLAS, _SET_CUDNN = _flag_accessors()


class math_mode:  # noqa: N801 - used as ``with math_mode(precision):``, like a function
    """Run the body with TF32 allowed exactly when ``precision == "tf32"``.

    A class that sets the flags that differ through torch's C accessors, not a
    generator-based contextmanager setting both properties: every dispatched call enters it,
    and the generator version cost 4.4 µs per call against 0.77 µs for this one (best of 7 ×
    50,000, 2-core CPU, torch 2.13, flags at their defaults; 10 against 1.5 µs under load).
    """

    __slots__ = ("_allow", "_saved")

    def __init__(self, precision: str):
        self._allow = precision == "tf32"

    def __enter__(self) -> None:
        allow = self._allow
        self._saved = cublas, cudnn = _GET_CUBLAS(), _GET_CUDNN()
        if cublas is not allow:
            _SET_CUBLAS(allow)
        if cudnn is not allow:
            _SET_CUDNN(allow)

    def __exit__(self, *exc) -> None:
        cublas, cudnn = self._saved  # restored even if unchanged here: the body may have set them
        _SET_CUBLAS(cublas)
        _SET_CUDNN(cudnn)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, precision: str) -> torch.Tensor:
    """``x @ weight.T + bias`` with the operand precision that ``precision`` admits.

    Under bf16 the product takes bfloat16 operands (a weight already in bfloat16, e.g. cached
    by ``Variant.gemm_weight``, is used as it is), accumulates and returns float32, and the
    bias is added in float32; otherwise it is F.linear.
    """
    if precision == "bf16" and x.dtype == torch.float32:
        y = bf16_product(x, weight)
        return y if bias is None else y.add_(bias.to(y.dtype))
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


def gemm_input(x: torch.Tensor, precision: str) -> torch.Tensor:
    """A float32 model's input as its GEMM at ``precision`` reads it: under bf16 x's bfloat16
    copy, else x. A forward that keeps x for its backward's dW = dyᵀ·x keeps this copy, the operand
    it read, and the backward casts nothing (``backward_gemms`` reads x in bfloat16); kept in
    float32, x was cast again there. ``linear_deferring_bias`` and ``float32_model_product`` take
    it as they take x."""
    return x.bfloat16() if precision == "bf16" and x.dtype == torch.float32 else x


def float32_model_product(x: torch.Tensor, weight: torch.Tensor, precision: str) -> torch.Tensor:
    """x·Wᵀ of a float32 model at ``precision``, in float32: ``linear`` without a bias, where x may
    also be ``gemm_input``'s bfloat16 copy."""
    return bf16_product(x, weight) if precision == "bf16" else linear(x, weight, None, precision)


def linear_deferring_bias(x, weight, bias, precision) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y, the bias still to add) of a float32 model, for variants whose epilogue kernel reads y
    once anyway; x is the model's input or its ``gemm_input``.

    At fp32 and tf32 the bias rides in cuBLAS's GEMM (addmm cost the same as mm: 2.686 ms
    against 2.690, H100, 1024×8192×8192) and y is float32. Under bf16 y is the
    GEMM's own bfloat16 result, float32-accumulated and rounded once, and the bias is left to
    the epilogue, which adds it in float32: a bfloat16 result is half the bytes for the GEMM to
    write and the epilogue to read (the bf16 GEMM took 0.1725 ms with a bf16 result, 0.177 with
    a float32 one and 0.206 as addmm with a float32 result).
    """
    if precision == "bf16":
        xb, wb = x.bfloat16(), weight.bfloat16()
        if not x.is_cuda:  # the same arithmetic: rounded operands, float32 sums, one rounding
            return F.linear(xb.float(), wb.float()).bfloat16(), bias
        return F.linear(xb, wb), bias
    return linear(x, weight, bias, precision), None


def bf16_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x·Wᵀ with bfloat16 operands, float32 accumulation and a float32 result.

    On CUDA cuBLAS writes the float32 result directly (``out_dtype``): no bf16 rounding of the
    product and no conversion pass (0.177 ms against 0.173 + 0.017 for a bf16 result and
    ``.float()``, H100, 1024×8192×8192). That overload has no autograd formula, so on CUDA a
    call that needs gradients, or a torch without it, takes the bf16 result and converts it. On
    the CPU the rounded operands are multiplied in float32: the same arithmetic as cuBLAS's.
    """
    xb, wb = x.bfloat16(), weight.bfloat16()
    if not x.is_cuda:
        return F.linear(xb.float(), wb.float())
    needs_grad = torch.is_grad_enabled() and (xb.requires_grad or wb.requires_grad)
    if not needs_grad and _mm_out_dtype_works():
        return torch.mm(xb, wb.t(), out_dtype=torch.float32)
    return F.linear(xb, wb).float()


_MM_OUT_DTYPE: bool | None = None


def _mm_out_dtype_works() -> bool:
    global _MM_OUT_DTYPE
    if _MM_OUT_DTYPE is None:
        try:
            probe = torch.ones(1, 1, dtype=torch.bfloat16, device="cuda")
            _MM_OUT_DTYPE = torch.mm(probe, probe, out_dtype=torch.float32).dtype == torch.float32
        except (TypeError, RuntimeError):
            _MM_OUT_DTYPE = False
    return _MM_OUT_DTYPE
