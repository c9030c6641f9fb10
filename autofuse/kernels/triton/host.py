"""The host side of autofuse's Triton kernels: importing them, launching them, and the passes
that prepare their operands. Used by the triton variants (``triton_variant``), their backwards
(``variants/<problem>/gradients.py``, ``triton_backward``) and ``autograd``; imports triton only
when a kernel module is first asked for (``kernel_module``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
import threading
from typing import Any

import torch

from autofuse.core import capture

# An operand, its low part (the operand again unless split) and, for the float16 operands, its rows'
# inverse scales (else None): what ``triton_variant.input_operands`` and ``weight_operands`` return.
# The range-checked float16 paths append a fourth element: the float32 source for the GEMM's exact
# path (``fp16_input_parts``; in the backward a transposed view such as dyᵀ, read through its
# strides), or in W's cached operand its ``WideCheck``.
Operand = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


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


def round_tf32(t: torch.Tensor) -> torch.Tensor:
    """``t`` (float32) rounded to TF32 to nearest, ties away from zero, as ``tf32_parts`` does in a kernel."""
    return ((t.contiguous().view(torch.int32) + 0x1000) & -0x2000).view(torch.float32)


def split_tf32(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo), each a TF32 number, with hi + lo = t to about 2⁻²² relative."""
    hi = round_tf32(t)
    return hi, round_tf32(t - hi)


def fp16_parts(t: torch.Tensor, split: bool, tma_rows: int | None = None, **check: Any) -> Operand:
    """(hi, lo, inverse row scales) of a contiguous 2-D float32 ``t`` in float16, one program per
    row (``gemm.fp16_row_parts``); lo is hi again unless ``split``. ``check`` holds the
    range check's arguments of that kernel, if any (``fp16_weight_parts``, ``fp16_input_parts``).
    ``tma_rows``: hi and lo are written in whole tiles of that many rows, zeros past t's rows, and
    returned as views of t's rows (see _WHOLE_TILES)."""
    rows, cols = t.shape
    whole = rows if tma_rows is None else -(-rows // tma_rows) * tma_rows
    hi = torch.empty(whole, cols, device=t.device, dtype=torch.float16)
    lo = torch.empty_like(hi) if split else hi
    inv_scale = torch.empty(rows, device=t.device)
    if rows:
        block = row_parts_block(cols)
        gemm_kernels().fp16_row_parts[(whole,)](t, hi, lo, inv_scale, cols, rows, SPLIT=split, BLOCK=block,
                                                num_warps=4 if block <= 1024 else 8, **check)
    if whole != rows:
        hi = _rows_of(hi, rows)
        lo = _rows_of(lo, rows) if split else hi
    return hi, lo, inv_scale


def row_parts_block(cols: int) -> int:
    """Columns ``fp16_row_parts`` takes per step: the row whole up to 2048, at least 16."""
    return min(2048, max(16, 1 << (max(cols, 1) - 1).bit_length()))


# The range check's exact path (docs/precision.md; ``gemm.exact_tile``: float32 FMA, TF32 under tf32; a
# launch of its own, ``launch_main_loop``): its k-slice.
EXACT_K = 32


@dataclasses.dataclass(frozen=True)
class WideCheck:
    """W's side of the range check, made with W's float16 parts and kept with them: W itself (the
    exact path's operand) and its column maxima over their max (how far a loss of x reaches)."""

    source: torch.Tensor
    col_weight: torch.Tensor


def fp16_weight_parts(w: torch.Tensor, split: bool) -> tuple[Operand, WideCheck]:
    """W's float16 ``Operand`` (``fp16_parts``; rows it cannot carry flagged by a negated scale)
    and its ``WideCheck``, in one pass over W."""
    cols = w.shape[1]
    col_max = torch.zeros(cols, device=w.device)
    parts = fp16_parts(w, split, col_max_ptr=col_max, STATS=True)
    col_weight = col_max / col_max.amax().clamp_min(torch.finfo(torch.float32).tiny) if cols else col_max
    return parts, WideCheck(w, col_weight)


def fp16_input_parts(x: torch.Tensor, split: bool, weights: Operand, check: WideCheck,
                     tma_rows: int | None = None) -> tuple[Operand, Operand]:
    """x's float16 parts and W's, each with its source appended (the exact path's operand), x's
    rows' inverse scales negated where the parts cannot carry them (``fp16_row_parts``, weighted by
    W's column maxima); W's were flagged with its parts. No host sync: the GEMM reads the signs
    (``gemm.tile_flagged``). ``tma_rows``: x's parts in whole row tiles (``fp16_parts``)."""
    hi, lo, x_scale = fp16_parts(x, split, tma_rows, col_weight_ptr=check.col_weight, FLAG=True)
    return (hi, lo, x_scale, x), (*weights[:3], check.source)


def transposed(t: torch.Tensor) -> torch.Tensor:
    """``t.t().contiguous()`` for a 2-D float32 tensor, by a Triton kernel where one can run
    (``fused_kernels_apply``): torch's copy of a transposed view moved 0.9 TB/s on an H100
    (0.070 ms for 1024×8192, the Triton one 0.027). The tf32 weight gradient takes x's copy where
    no epilogue backward wrote dyᵀ (``autograd._weight_gradient``)."""
    rows, cols = t.shape
    block = 64
    if not fused_kernels_apply(t) or t.numel() == 0 or -(-cols // block) > 65535:  # the grid's second dimension
        return t.t().contiguous()
    out = torch.empty(cols, rows, device=t.device, dtype=t.dtype)
    gemm_kernels().transpose[(-(-rows // block), -(-cols // block))](t, out, rows, cols, BLOCK=block, num_warps=4)
    return out


def fused_kernels_apply(*tensors: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> bool:
    """Whether a backward's Triton kernels can take these tensors: of ``dtypes`` (float32 unless
    the kernel converts what it loads) and contiguous, on CUDA (or on the CPU under the
    interpreter), with Triton importable. Else the torch formula runs."""
    if triton_missing() is not None:
        return False
    device = "cpu" if interpreting() else "cuda"
    return all(t.dtype in dtypes and t.is_contiguous() and t.device.type == device for t in tensors)


def kernel_module(name: str, package: str | None = None):
    """The Triton kernel module ``name`` (relative to ``package`` if it starts with a dot),
    imported on first use (it imports triton), its kernels launched through
    ``autofuse.kernels.triton.launch``: one wrapper per module in the process, so the forward's variants
    and the backwards share each kernel's launch cache."""
    return _kernel_module(importlib.util.resolve_name(name, package))


@functools.cache
def _kernel_module(name: str):
    from autofuse.kernels.triton.launch import Kernels

    return Kernels(name)


def gemm_kernels():
    """``autofuse.kernels.triton.gemm``: the shared main loop and ``tf32_parts`` (see ``kernel_module``)."""
    return kernel_module("autofuse.kernels.triton.gemm")


def epilogue_kernels():
    """``autofuse.kernels.triton.epilogue``: what the epilogues and backwards share, ``column_sums``
    among them (see ``kernel_module``)."""
    return kernel_module("autofuse.kernels.triton.epilogue")


@functools.cache
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def launch_grid(m: int, n: int, block_m: int, block_n: int, persistent: bool, device: torch.device) -> tuple[int]:
    """One program per tile of an (m × n) output, or (persistent) one per SM, never more than
    there are tiles (4 under the interpreter, so its programs walk several tiles each)."""
    tiles = -(-m // block_m) * -(-n // block_n)
    if not persistent:
        return (tiles,)
    programs = 4 if device.type != "cuda" else sm_count(device.index if device.index is not None else 0)
    return (min(tiles, programs),)


def launch_main_loop(grid: tuple[int], exact_inline: bool = False, **arguments: Any) -> None:
    """``gemm.persistent_gemm`` with ``arguments`` (``loop_operands``' and the launch's). Where they
    carry the range check's exact path (EXACT_K), the flagged tiles are multiplied again from the
    float32 sources (no host sync: each program reads the flags): in the same launch where
    ``exact_inline`` (a persistent grid, each program redoing its own tiles), else in a second."""
    kernel = gemm_kernels().persistent_gemm
    if arguments.get("EXACT_K") and exact_inline:
        kernel[grid](**arguments, EXACT_INLINE=True)
        return
    kernel[grid](**arguments)
    if arguments.get("EXACT_K"):
        kernel[grid](**arguments, EXACT_PASS=True)


class Arrivals:
    """The zeroed int32 counters of kernels whose last program to arrive finishes the launch
    (``gemm.last_to_arrive``, which sets its counter back to 0). Launches that may run at once must
    not share one: plain calls take their stream's own (calls on one stream run in order). A call
    being captured into a CUDA graph takes the counter of the stream its replays are promised to
    (``autofuse.core.capture``: the runtime's graphs replay on their caller's stream only), else one
    nobody else will, for good, since its replays may run beside another stream's calls. The
    counters are zeroed once, in a buffer made by the first plain call on a device (a capture's
    warm-up calls run plain first); ``counter`` gives None where the buffer does not exist yet
    during a capture, or all its counters are given: the caller then finishes in a launch of its own.

    Before the promise every capture took a counter of its own, and its warm-up on a fresh side
    stream another: a process that captured 128 graphs (a key recaptured after each change of the
    model's state, say) had used up the 256, and its later captures finished in a second launch."""

    SLOTS = 256

    def __init__(self):
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._taken: dict[torch.device, int] = {}  # counters given on the device
        self._streams: dict[tuple[torch.device, int], torch.Tensor] = {}  # (device, stream) -> its counter
        self._lock = threading.Lock()  # two threads' first calls must not take one slot

    def counter(self, device: torch.device) -> torch.Tensor | None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            capturing, promised = True, capture.replay_stream()
            stream = None if promised is None else (device, promised)
        else:
            capturing, stream = False, (device, _raw_stream(device) if device.type == "cuda" else 0)
        counter = self._streams.get(stream)
        if counter is not None:
            return counter
        with self._lock:
            return self._give(device, stream, capturing)

    def _give(self, device: torch.device, stream: tuple | None, capturing: bool) -> torch.Tensor | None:
        if stream in self._streams:  # another thread gave it meanwhile
            return self._streams[stream]
        buffer = self._buffers.get(device)
        if buffer is None:
            if capturing:
                return None
            buffer = self._buffers[device] = torch.zeros(self.SLOTS * 4, device=device, dtype=torch.int32)
        slot = self._taken.get(device, 0)
        if slot == self.SLOTS:
            return None
        self._taken[device] = slot + 1
        counter = buffer[4 * slot:4 * slot + 1]  # 16 bytes apart: Triton specializes a pointer's alignment
        if stream is not None:
            self._streams[stream] = counter
        return counter


def _raw_stream(device: torch.device) -> int:
    return torch._C._cuda_getCurrentRawStream(torch.cuda.current_device() if device.index is None else device.index)


def loop_operands(xs: Operand, weights: Operand, split: bool, tma_blocks: tuple[int, int, int] | None,
                  w_descs: tuple | None = None) -> dict[str, Any]:
    """The operand arguments of ``gemm.persistent_gemm``, built here once for every launch:
    pointers, or with ``tma_blocks`` (BLOCK_M, BLOCK_N, BLOCK_K) tensor descriptors (W's
    ``w_descs`` where already made); the low parts only if ``split``; the float16 rows' scales
    (None but on the float16 paths); and where the operands carry their sources (a fourth
    element, the range-checked float16 paths), those, their strides and the exact path's k-slice.

    Operands the kernel does not read are None: Triton makes a None argument a constant, so
    neither its binding nor the launcher's descriptor encoding costs host time per call."""
    (x, x_lo, x_scale), (w, w_lo, w_scale) = xs[:3], weights[:3]
    if not split:
        x_lo = w_lo = None
    args = {"x_ptr": None, "x_lo_ptr": None, "w_ptr": None, "w_lo_ptr": None, "x_desc": None, "x_lo_desc": None,
            "w_desc": None, "w_lo_desc": None, "x_scale_ptr": x_scale, "w_scale_ptr": w_scale}
    if len(xs) > 3:  # range-checked float16 parts (``fp16_input_parts``): flagged tiles multiply the sources
        args.update(x32_ptr=xs[3], w32_ptr=weights[3], EXACT_K=EXACT_K, x32_strides=tuple(xs[3].stride()),
                    w32_strides=tuple(weights[3].stride()))
    if tma_blocks is None:
        args.update(x_ptr=x, x_lo_ptr=x_lo, w_ptr=w, w_lo_ptr=w_lo)
        return args
    block_m, block_n, block_k = tma_blocks
    x_desc, x_lo_desc = descriptors((x, x_lo), block_m, block_k)
    w_desc, w_lo_desc = w_descs if w_descs is not None else descriptors((w, w_lo), block_n, block_k)
    args.update(x_desc=x_desc, x_lo_desc=x_lo_desc, w_desc=w_desc, w_lo_desc=w_lo_desc)
    return args


def descriptors(tensors, rows: int, block_k: int) -> tuple:
    """A TMA descriptor of [rows, block_k] blocks for each tensor (None for None), over the whole
    buffer where the tensor is a view of its rows (see _WHOLE_TILES)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return tuple(None if t is None else TensorDescriptor.from_tensor(getattr(t, _WHOLE_TILES, t), [rows, block_k])
                 for t in tensors)


# Whole tiles: x's operand pass (bf16's cast, the float16 parts) writes a buffer of whole TMA row
# tiles, zeros past x's rows, and hands on the view of x's rows, whose attribute _WHOLE_TILES names
# the buffer; ``descriptors`` gives TMA the buffer. A box that runs past its tensor's last row
# slowed the whole GEMM: 22 at 37 rows on rung 64's 64-row tile (Nsight Compute, NVIDIA H200)
# took 49.8 µs of GEMM under bf16 against 38.4 with x so padded (42.4 against 37.6 at 40 rows,
# 39.3 against 37.9 at 48), 48.3 against 37.6 under tf32's float16 parts, 77.7 against 75.3
# under fp32's split ones. The zeros are what the box's out-of-bounds fill reads, so the products
# are the same bit for bit.
_WHOLE_TILES = "_autofuse_whole_tiles"


def _rows_of(buffer: torch.Tensor, rows: int) -> torch.Tensor:
    """The view of ``buffer``'s first ``rows`` rows, naming ``buffer`` for ``descriptors``."""
    view = buffer[:rows]
    setattr(view, _WHOLE_TILES, buffer)
    return view


def bfloat16_whole_tiles(x: torch.Tensor, block_m: int) -> torch.Tensor:
    """``x.bfloat16()`` (x contiguous, float32) in whole ``block_m``-row tiles, by one kernel
    (``gemm.bfloat16_padded``; see _WHOLE_TILES). Where x's rows are whole tiles, torch's cast.

    A bfloat16 x (a bfloat16 model's) is returned as it is: no pass writes it, and a copy into
    whole tiles was measured a loss as often as a gain (NVIDIA H200, the shipped table's triton
    entries, GPU time): 99 at 8192² took 55.5 → 47.8 µs at 37 rows and 81.1 → 70.4 at 100, but
    42.0 → 44.4 at 1 row and 44.4 → 46.3 at 17; gemm_bn eval at 4096² 16.4 → 18.6 at 1 row and
    19.1 → 20.9 at 37."""
    rows, cols = x.shape
    whole = -(-rows // block_m) * block_m
    if whole == rows or x.dtype == torch.bfloat16:
        return x.bfloat16()
    buffer = torch.empty(whole, cols, device=x.device, dtype=torch.bfloat16)
    block = 4096
    gemm_kernels().bfloat16_padded[(-(-buffer.numel() // block),)](x, buffer, x.numel(), buffer.numel(),
                                                                  BLOCK=block, num_warps=8)
    return _rows_of(buffer, rows)
