"""Base classes of variants whose work is a CUDA library built by ``autofuse.kernels.build``.

A CUDA variant names its kernel source (``variants/<problem>/csrc/*.cu``, no torch headers),
maps its parameters to compile-time defines, and calls ``extern "C"`` launchers with raw
pointers on torch's current stream. Every launch's status is checked. Host entry points
check their input contracts first and fail naming expected and got.
"""

from __future__ import annotations

import ctypes
import hashlib
import inspect
import pathlib
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from autofuse.core.variant import Variant
from autofuse.errors import InputError
from autofuse.kernels import build as builder
from autofuse.kernels.autograd import needs_grad
from autofuse.kernels.gemm_space import blocked_gemm_configs

_ARG_TYPES = {"ptr": ctypes.c_void_p, "int": ctypes.c_int, "float": ctypes.c_float, "stream": ctypes.c_void_p}


class CudaVariant(Variant):
    devices = ("cuda",)
    capturable = True  # launches on torch's current stream, checks status without a synchronize
    dtypes = (torch.float32,)
    source: ClassVar[str]  # the kernel source, relative to the variant module's directory
    # launcher name -> argument kinds ("ptr", "int", "float"); the stream is appended.
    launchers: ClassVar[dict[str, tuple[str, ...]]] = {}

    @classmethod
    def source_path(cls) -> pathlib.Path:
        return pathlib.Path(inspect.getfile(cls)).parent / cls.source

    @classmethod
    def source_hash(cls) -> str:
        """The Python code's hash (``Variant.source_hash``), the .cu file's and every header's that it may include."""
        digest = hashlib.sha256(super().source_hash().encode())
        digest.update(cls.source_path().read_bytes())
        for header in sorted(builder.CSRC_DIR.glob("*.cuh")) + sorted(cls.source_path().parent.glob("*.cuh")):
            digest.update(header.read_bytes())
        return digest.hexdigest()[:16]

    # Whether the backward takes a bfloat16 model's tensors too (the cuBLAS + epilogue variants,
    # 51's single_pass); where not, a bfloat16 model's autograd keys are the others'.
    bfloat16_gradients: ClassVar[bool] = False

    @classmethod
    def admits(cls, device, dtype, precision, autograd):
        if dtype not in cls.dtypes:
            return (f"its kernels take float32 tensors, not {str(dtype).removeprefix('torch.')} "
                    "(`autofuse list` shows the variants that serve a bfloat16 model)")
        if dtype == torch.bfloat16 and precision != "bf16":
            return f"a bfloat16 model runs on bfloat16 operands: precision bf16 only, not {precision}"
        if dtype == torch.bfloat16 and autograd and not cls.bfloat16_gradients:
            return "a bfloat16 model's gradients are the triton variant's (this backward takes float32 tensors)"
        return super().admits(device, dtype, precision, autograd)

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        reason = super().unavailable_reason(device)
        if reason is None and builder.find_nvcc() is None:
            reason = "nvcc not found (set AUTOFUSE_NVCC or CUDA_HOME)"
        return reason

    def defines(self) -> dict[str, Any]:
        """Compile-time defines of this configuration: parameter ``bm`` becomes ``AF_BM``."""
        return {f"AF_{key.upper()}": value for key, value in self.params.items()}

    def kernel_build(self, device) -> builder.KernelBuild:
        return builder.KernelBuild.create(self.source_path(), self.defines(), arch=builder.cuda_arch(device))

    def kernel_builds(self, device: str) -> list[builder.KernelBuild]:
        return [self.kernel_build(device)]

    def build(self, device: str) -> None:
        self._lib = builder.load_library(builder.build(self.kernel_build(device)))
        for name, kinds in self.launchers.items():
            fn = getattr(self._lib, name)
            fn.argtypes = [_ARG_TYPES[k] for k in kinds] + [ctypes.c_void_p]
            fn.restype = ctypes.c_int

    def library(self, device: torch.device):
        """The loaded library (built on first use), for launches and plain int queries such as
        ``af_parts(N)``: how many partial results this configuration's tiling produces."""
        if not hasattr(self, "_lib"):
            self.build(str(device))
        return self._lib

    def launch(self, name: str, *args, device: torch.device) -> None:
        """Call launcher ``name`` on ``device``'s current stream and check its status.

        ``device`` is made current only when it is not: entering ``torch.cuda.device`` and
        building a ``Stream`` to read its handle were host time on every call of every CUDA
        variant, and 51's kernel (0.048 ms) is shorter than its host path.
        """
        launcher = getattr(self.library(device), name)
        converted = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
        current = torch.cuda.current_device()
        index = current if device.index is None else device.index
        if index == current:
            status = launcher(*converted, builder.stream_handle(index))
        else:
            with torch.cuda.device(index):
                status = launcher(*converted, builder.stream_handle(index))
        if status:
            builder.check_status(self._lib, status, f"{self.problem}/{self.name} {name}")


def operand(t: torch.Tensor | None, name: str, shape: tuple[int, ...], device: torch.device,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``t`` as a contiguous tensor of ``dtype`` (the model's: float32, or bfloat16 where a variant
    serves a bfloat16 model) on ``device`` of ``shape``, or InputError naming what came."""
    want = str(dtype).removeprefix("torch.")
    if t is None:
        raise InputError(f"{name}: expected a {want} tensor of shape {shape}, got None")
    if t.dtype != dtype:
        raise InputError(f"{name}: expected {want}, got {str(t.dtype).removeprefix('torch.')}")
    if t.device != device:
        raise InputError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    if tuple(t.shape) != tuple(shape):
        raise InputError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    return t.detach().contiguous()


def input_operand(x: torch.Tensor, in_features: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The input as a contiguous CUDA matrix (batch, in_features) of ``dtype``, or InputError."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise InputError(f"expected a 2-D input (batch, {in_features}), got {getattr(x, 'shape', type(x).__name__)}")
    if x.device.type != "cuda":
        raise InputError(f"expected a CUDA input, got one on {x.device}")
    return operand(x, "input", (x.shape[0], in_features), x.device, dtype)


def refuse_bfloat16_gradients(variant: Variant, *tensors: torch.Tensor | None) -> None:
    """InputError where a call with these tensors of a bfloat16 model would need a backward this
    records none of (a variant's differentiable path calls it in ``fused_call``'s forward)."""
    if needs_grad(*tensors):
        raise InputError(f"{variant.name}: a bfloat16 model's linear here records no backward: call it under "
                         "torch.no_grad() (a differentiable variant runs it inside autograd.fused_call)")


def linear_parameters(linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An nn.Linear's (weight, bias), read from its parameter dict (where torch.func's
    functional_call puts what it swaps in, too). ``linear.weight`` goes through
    nn.Module.__getattr__: about 1 µs a read against 0.05 (2-core CPU), and a bfloat16 model's
    path read four of them before its GEMM, host time that KernelBench's harness counts
    (``bfloat16_model_linear``)."""
    parameters = linear._parameters
    return parameters["weight"], parameters.get("bias")


def bfloat16_model_linear(variant: Variant, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          name: str) -> torch.Tensor:
    """linear(x) of a bfloat16 model as its reference computes it: cuBLAS's bfloat16 output, the
    bias added in its epilogue, so an epilogue kernel starts from the reference's own tensor.
    InputError where a gradient is needed (a differentiable path calls this inside
    ``fused_call``'s forward, under no_grad) or the operands are not a bfloat16 model's;
    ``weight`` and ``bias`` are the Linear's (``linear_parameters``), ``name`` its attribute in
    the model, for messages.

    The GEMM is launched after as few checks as keep it right (grad need, the three dtypes, a
    CUDA matrix); the GEMM checks the devices and the shapes itself, and only when it refuses are
    the operands checked one by one, to say which is wrong. A call timed from an idle GPU
    (KernelBench's harness) waits for the host up to the GEMM's launch: the checks of every
    operand (``operand``: a detach, a shape tuple, a device compare each) had made that 56 µs
    against the reference's 12.6 (H200's host, 99 at 1024 rows; F.linear itself 52-56 in both).
    With a bias the GEMM is ``addmm(bias, x, weight.t())``, which is what F.linear calls for a
    matrix (at::linear), so the result is the same tensor; F.linear's own host time was 38.4 µs
    against addmm's 30.7 (medians, the GPU idle before each call, same machine).
    """
    refuse_bfloat16_gradients(variant, x, weight, bias)
    bf16 = torch.bfloat16
    if x.dtype is bf16 and weight.dtype is bf16 and (bias is None or bias.dtype is bf16) and x.is_cuda and x.dim() == 2:
        try:  # with a bias, at::linear's own call for a matrix, without its wrapper's host time
            return F.linear(x, weight) if bias is None else torch.addmm(bias, x, weight.t())
        except RuntimeError:
            pass  # a device or a shape that does not fit: said below, naming the operand
    n_out, n_in = weight.shape
    x = input_operand(x, n_in, bf16)
    w = operand(weight, f"{name}.weight", (n_out, n_in), x.device, bf16)
    bias = None if bias is None else operand(bias, f"{name}.bias", (n_out,), x.device, bf16)
    return F.linear(x, w, bias)


def linear_operands(x: torch.Tensor, linear, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, weight, bias) of ``x @ linear.weight.T + linear.bias`` checked and contiguous;
    ``name`` is the Linear's attribute in the model, for messages."""
    return gemm_operands(x, linear.weight, linear.bias, name)


def gemm_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, weight, bias) of ``x @ weight.T + bias`` checked and contiguous (a fused forward gets
    the tensors, not the Linear); ``name`` is the Linear's attribute in the model, for messages."""
    n_out, n_in = weight.shape
    x = input_operand(x, n_in)
    weight = operand(weight, f"{name}.weight", (n_out, n_in), x.device)
    return x, weight, operand(bias, f"{name}.bias", (n_out,), x.device)


class GemmKernelVariant(CudaVariant):
    """A problem's GEMM-based kernel in one of the three main loops of ``autofuse/kernels/csrc/gemm.cuh``.

    Subclasses set ``kind`` to cuda_naive, cuda_tiled or cuda_templated; the configurations
    and defines follow from it.
    """

    @classmethod
    def configs(cls, shape, device):
        if cls.kind == "cuda_naive":
            return [{}]
        if cls.kind == "cuda_tiled":
            return [{"tile": 32}, {"tile": 16}]
        return blocked_gemm_configs()

    def defines(self):
        if self.kind == "cuda_naive":
            return {"AF_NAIVE": 1}
        if self.kind == "cuda_tiled":
            return {"AF_TILED": 1, "AF_TILE": self.params["tile"]}
        return super().defines()
