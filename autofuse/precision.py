"""Precision classes, and the math modes that make them explicit.

``fp32`` (the default) is PyTorch's own default: float32 operands, float32
accumulation, TF32 off. ``tf32`` admits TensorFloat-32 matrix units for float32
matrix products. ``bf16`` admits bfloat16 operands (float32 accumulation).
A call always runs inside ``math_mode(precision)``, which sets TF32 on or off for
its duration whatever the global flags say, so TF32 never gets in silently.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from autofuse.errors import InputError

PRECISIONS = ("fp32", "tf32", "bf16")

# Input dtypes each precision admits: bf16 tensors only make sense when bf16 is allowed.
_DTYPES = {
    "fp32": (torch.float32,),
    "tf32": (torch.float32,),
    "bf16": (torch.float32, torch.bfloat16),
}


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise InputError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return precision


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


def _set_tf32(enabled: bool) -> tuple:
    matmul = torch.backends.cuda.matmul
    saved = (matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    return saved


@contextlib.contextmanager
def math_mode(precision: str):
    """Run the body with TF32 allowed exactly when ``precision == "tf32"``."""
    saved = _set_tf32(precision == "tf32")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, precision: str) -> torch.Tensor:
    """``x @ weight.T + bias`` with the operand precision that ``precision`` admits.

    Under bf16 the product takes bfloat16 operands (float32 accumulation inside
    cuBLAS/oneDNN) and the bias is added in the input dtype; otherwise it is F.linear.
    """
    if precision == "bf16" and x.dtype == torch.float32:
        y = F.linear(x.bfloat16(), weight.bfloat16()).to(x.dtype)
        return y if bias is None else y + bias.to(x.dtype)
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
