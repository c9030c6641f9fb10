"""The floors a dispatch is measured against: what no implementation of the call can beat.

* ``floor_row``: cuBLAS's GEMM alone at the precision (a training step adds the weight-gradient
  GEMM) for GEMM-bound problems, or a copy of the bytes the call must move where the algebra
  removes the GEMM (``Problem.floor == "memory"``).
* ``weight_read_row``: the small-batch floor. At batch 1 a GEMM's work is reading W (bfloat16
  8192×8192: 134 MB), so its time is W's bytes at the precision's element size (2 under bf16,
  4 under fp32 and tf32: what the kernel must read) over the copy bandwidth measured in the
  same run.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from autofuse.bench.report import BenchRow
from autofuse.bench.setup import Setup
from autofuse.bench.targets import FLOOR, TRAINING
from autofuse.core.precision import linear, math_mode
from autofuse.tuning.timing import Timing

WEIGHT_READ = "weight read"
COPY = "copy"
# The copy that measures the bandwidth moves at least this much, so it streams from memory
# (an H100's L2 is 50 MB) even where W is small, and so the writes it leaves in the L2 when its
# clock stops are a small share of it: a copy of 256 MB ran at 2.86 TB/s after a flush that left
# the L2 dirty and 3.06 after one that left it clean, 1 GiB at 2.97 and 3.01 (H100,
# benchmarks/gpu/flush_cost.py).
MIN_COPY_BYTES = 1 << 30


def floor_row(setup: Setup):
    """(the floor's row, its call)."""
    if setup.prob.floor == "memory":
        return _memory_floor(setup)
    weight = setup.prob.linear_of(setup.model).weight.detach()
    x, precision, training = setup.x, setup.precision, setup.step == TRAINING
    # A training step's GEMMs: the forward's, then the weight's gradient from the GEMM's upstream gradient.
    grad_y = torch.randn(x.shape[0], weight.shape[0], device=x.device) if training else None
    what = "forward GEMM + weight-gradient GEMM" if training else "GEMM"
    if precision == "bf16":
        # The strictest floor: operands already in bfloat16 (a bfloat16 model's are), a bfloat16
        # result. A variant fed float32 inputs still pays for casting x, which this floor does not.
        xb, wb = x.bfloat16(), weight.bfloat16()
        gb = grad_y.bfloat16() if training else None
        note = f"cuBLAS {what} alone (bf16 operands and result)"
        return BenchRow(FLOOR, "floor", {}, note=note), (lambda: (xb @ wb.t(), gb.t() @ xb) if training else xb @ wb.t())
    return _float32_gemms(x, weight, grad_y, precision, what)


def _float32_gemms(x, weight, grad_y, precision: str, what: str):
    # The weight gradient dyᵀ·x from the operands' fastest layout, made before the clock starts:
    # under tf32, K-major copies (Hopper's TF32 tensor cores read K-major only: 0.397 ms against
    # 0.569 as laid out, 1024×8192×8192, H100); in float32 FMA the layout as it comes is as fast.
    training = grad_y is not None
    k_major = training and precision == "tf32" and x.is_cuda
    grad_t, x_t = (grad_y.t().contiguous(), x.t().contiguous()) if k_major else (None, None)

    def gemms():
        with math_mode(precision):
            y = linear(x, weight, None, precision)
            if not training:
                return y
            return y, (grad_t @ x_t.t() if k_major else grad_y.t() @ x)
    arithmetic = "tf32" if precision == "tf32" else "float32 FMA"
    return BenchRow(FLOOR, "floor", {}, note=f"cuBLAS {what} alone ({arithmetic})"), gemms


def _memory_floor(setup: Setup):
    """Copy the bytes no implementation can avoid moving: the forward's input and output and,
    for a training step, also reading the upstream gradient and x and writing each parameter's
    gradient once (x does not require grad: autofuse.tuning.timed_call). In the model's dtype:
    a bfloat16 model's rows are half a float32 model's bytes."""
    size = setup.x.element_size()
    nbytes = setup.prob.memory_floor_bytes(setup.shape) * size // 4  # memory_floor_bytes counts float32
    what = "read + write"
    if setup.step == TRAINING:
        with torch.no_grad():
            out = copy.deepcopy(setup.model)(setup.x)
        nbytes += size * (out.numel() + setup.x.numel() + sum(p.numel() for p in setup.model.parameters() if p.requires_grad))
        what = "forward's read + write; upstream gradient and x read, parameter gradients written"
    return BenchRow(FLOOR, "floor", {}, note=f"copy of {nbytes / 1e6:.4g} MB ({what})"), _copy_of(nbytes, setup.device)


def _copy_of(nbytes: int, device) -> Callable[[], torch.Tensor]:
    """A call that moves ``nbytes`` (reads half, writes half) at the copy bandwidth."""
    buffer = torch.empty(max(nbytes // 8, 1), dtype=torch.float32, device=device)
    return buffer.clone


def weight_bytes(setup: Setup) -> int:
    """W's bytes at the element size the precision's GEMM must read: 2 under bf16, else 4."""
    weight = setup.prob.linear_of(setup.model).weight
    return weight.numel() * (2 if setup.precision == "bf16" else 4)


def copy_row(setup: Setup):
    """(the copy row, its call): a copy that measures the bandwidth, on a GPU of at least
    ``MIN_COPY_BYTES``; on the CPU (tests) of W's bytes."""
    nbytes = max(MIN_COPY_BYTES if setup.device_type == "cuda" else 8, weight_bytes(setup))
    return BenchRow(COPY, "reference", {"bytes": nbytes}, note=f"copy of {nbytes / 1e6:.4g} MB (read + write)"), \
        _copy_of(nbytes, setup.device)


def weight_read_row(setup: Setup, copied: BenchRow) -> BenchRow | None:
    """W's bytes at the copy's bandwidth: the copy's timing scaled by W's bytes over its own, so
    its p20-p80 is the copy's. None where the copy was not timed."""
    if copied.timing is None:
        return None
    nbytes, moved = weight_bytes(setup), copied.params["bytes"]
    scale = nbytes / moved
    timing = Timing(*(getattr(copied.timing, f) * scale for f in ("median_ms", "p20_ms", "p80_ms")), copied.timing.reps)
    bandwidth = moved / (copied.timing.median_ms * 1e-3) / 1e9
    note = f"W's {nbytes / 1e6:.4g} MB ({'bf16' if setup.precision == 'bf16' else 'float32'}) at {bandwidth:.4g} GB/s copy"
    return BenchRow(WEIGHT_READ, "floor", {"bytes": nbytes}, timing, note)
