"""Base class of the ``triton`` variants: a tensor-core GEMM with the problem's epilogue inside.

Triton is imported lazily: where it is missing the variant is not admitted and ``autofuse
list`` says why. The kernels run on CUDA, and on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``), which is how CI checks their masks, partial tiles and odd shapes.

The search space (``gemm_configs``) is the main loop's: tile sizes, k-slice, pipeline depth
(``stages``), warps, group size of the grouped ordering, persistence (one program per SM
walking the tiles, or one per tile) and TMA (tensor descriptors; only where the rows are
16-byte aligned). Configurations that cannot run are projected away: too much shared memory
for the stages, or more accumulator registers per thread than a warp group can hold.
Warp specialization is not a knob: Triton 3.6 offers it (``tl.range(warp_specialize=True)``)
on Blackwell only. Split-K is not a knob either: the default shapes have 64+ tiles for 132 SMs.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import os
from typing import Any, ClassVar

import torch

from autofuse.cuda_variant import operand
from autofuse.errors import InputError
from autofuse.variant import Variant

# (BLOCK_M, BLOCK_N) pairs; BLOCK_K, stages, warps, group size, persistence and TMA are searched per pair.
TILES = ((128, 128), (128, 256), (64, 128), (128, 64), (256, 128), (64, 256))
BLOCK_KS = (32, 64)
STAGES = (3, 4, 2, 5)
WARPS = (8, 4)
GROUPS = (8, 16)
# Shared memory the stages may take (H100: 227 KB per block), counting float32 operands,
# which the in-kernel conversion of x and the fp32/tf32 paths load; the rest is the epilogue's.
STAGE_BYTES = 200 * 1024
# Accumulator floats per thread: 128 keeps a 128×256 tile at 8 warps and leaves registers for
# the 3xTF32 split; more spills.
MAX_ACC_PER_THREAD = 128
# Under the interpreter (the CPU tests): tiles of 16, so small odd shapes cross several tiles in
# every dimension and the edges (partial tiles, the K tail, clamped rows) are exercised.
INTERPRETER_SPACE = {"tiles": ((16, 16), (32, 16)), "block_ks": (16,), "stages": (2,), "warps": (4,), "groups": (2, 8)}


def gemm_configs(n_in: int, device: str = "cuda", operand_bytes: int = 4) -> list[dict[str, Any]]:
    """Every valid main-loop configuration for a K of ``n_in`` on ``device``, the default first."""
    tma_ok = n_in % 8 == 0  # 16-byte row strides for float32 x and a bfloat16 W
    space = INTERPRETER_SPACE if device == "cpu" else {"tiles": TILES, "block_ks": BLOCK_KS, "stages": STAGES,
                                                         "warps": WARPS, "groups": GROUPS}  # fmt: skip
    configs = []
    for (bm, bn), bk, stages, warps, group, persistent, tma in itertools.product(
            space["tiles"], space["block_ks"], space["stages"], space["warps"], space["groups"],
            (True, False), (True, False)):
        if tma and not tma_ok:
            continue
        if stages * (bm + bn) * bk * operand_bytes > STAGE_BYTES or bm * bn > MAX_ACC_PER_THREAD * 32 * warps:
            continue
        configs.append({"block_m": bm, "block_n": bn, "block_k": bk, "stages": stages, "warps": warps,
                        "group_m": group, "persistent": persistent, "tma": tma})
    return configs


def interpreting() -> bool:
    """Whether Triton runs kernels through its interpreter (on the CPU) in this process."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def triton_missing() -> str | None:
    """Why Triton cannot be imported here, or None."""
    try:
        importlib.import_module("triton")
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install
        return f"triton cannot be imported ({exc}); it ships with CUDA builds of torch, or `pip install triton`"
    return None


def fused_kernels_apply(*tensors: torch.Tensor) -> bool:
    """Whether a backward's Triton kernels can take these tensors: float32 and contiguous, on
    CUDA (or on the CPU under the interpreter), with Triton importable. Else the torch formula runs."""
    if triton_missing() is not None:
        return False
    device = "cpu" if interpreting() else "cuda"
    return all(t.dtype == torch.float32 and t.is_contiguous() and t.device.type == device for t in tensors)


def problem_kernels(problem: str):
    """``variants/<problem>/triton_kernels.py``, imported on first use (it imports triton)."""
    return importlib.import_module(f"autofuse.variants.{problem}.triton_kernels")


@functools.cache
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


class TritonVariant(Variant):
    """A problem's Triton kernels (``kernels``: the module, relative to the variant's package)."""

    kind = "triton"
    devices = ("cpu", "cuda")  # the CPU only under TRITON_INTERPRET=1: see unavailable_reason
    dtypes = (torch.float32,)
    precisions = ("fp32", "tf32", "bf16")  # fp32 through 3xTF32, so not ieee
    supports_autograd = True
    kernels: ClassVar[str] = ".triton_kernels"

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        reason = super().unavailable_reason(device) or triton_missing()
        if reason is None and device == "cpu" and not interpreting():
            reason = "runs on cuda (on the CPU only under TRITON_INTERPRET=1, Triton's interpreter)"
        if reason is None and device == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0):
            reason = f"needs tensor cores with TF32 (compute capability 8.0+), got {torch.cuda.get_device_capability()}"
        return reason

    in_dim: ClassVar[str] = "in_features"  # the shape parameter that is K

    @classmethod
    def configs(cls, shape, device):
        return gemm_configs(shape[cls.in_dim], device)

    def build(self, device: str) -> None:
        self.module()

    def module(self):
        """The problem's kernel module, imported on first use (it imports triton)."""
        if "_module" not in self.__dict__:
            self._module = importlib.import_module(self.kernels, type(self).__module__.rpartition(".")[0])
        return self._module

    def main_loop(self, x: torch.Tensor, w: torch.Tensor) -> dict[str, Any]:
        """The keyword arguments every kernel's main loop takes: operands (pointers or TMA
        descriptors), tile sizes, precision, and the launch's warps and stages."""
        p = self.params
        bm, bn, bk = p["block_m"], p["block_n"], p["block_k"]
        x_desc = w_desc = None
        if p["tma"]:
            from triton.tools.tensor_descriptor import TensorDescriptor

            x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
            w_desc = TensorDescriptor.from_tensor(w, [bn, bk])
        return {"x_ptr": x, "w_ptr": w, "x_desc": x_desc, "w_desc": w_desc, "BLOCK_M": bm, "BLOCK_N": bn,
                "BLOCK_K": bk, "GROUP_M": p["group_m"], "PRECISION": self.precision, "TMA": p["tma"],
                "EVEN_K": x.shape[1] % bk == 0, "INTERPRET": interpreting(), "num_warps": p["warps"],
                "num_stages": p["stages"]}

    def operands(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, name: str):
        """(x, the GEMM's weight operand, bias) checked and contiguous: under bf16 the weight's cached
        bfloat16 copy; a missing bias is zeros. Errors name expected and got."""
        n_out, n_in = weight.shape
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != n_in:
            raise InputError(f"expected a 2-D input (batch, {n_in}), got {getattr(x, 'shape', type(x).__name__)}")
        x = operand(x, "input", tuple(x.shape), x.device)
        w = operand(weight, f"{name}.weight", (n_out, n_in), x.device)
        if self.precision == "bf16":
            w = self.gemm_weight(weight)  # the cached copy of the parameter itself, not of this detached view
        b = torch.zeros(n_out, device=x.device) if bias is None else operand(bias, f"{name}.bias", (n_out,), x.device)
        return x, w, b

    def grid(self, x: torch.Tensor, n_out: int) -> tuple[int]:
        """One program per tile, or (persistent) one per SM, never more than there are tiles."""
        tiles = -(-x.shape[0] // self.params["block_m"]) * -(-n_out // self.params["block_n"])
        if not self.params["persistent"]:
            return (tiles,)
        programs = 4 if x.device.type != "cuda" else sm_count(x.device.index if x.device.index is not None else 0)
        return (min(tiles, programs),)
