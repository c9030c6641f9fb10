"""Where ``autofuse tune`` and ``autofuse bench`` run, and at which shapes: checked before any work.

A CUDA device asked for where torch sees none is an error naming it, not an AssertionError from
deep in torch. The built-in problems' default shapes are a GPU's: on a 2-core CPU, a tune of
gemm_bn at 16384×4096×4096 finished 0 of 6 trials in 40 s (issue 32). So on the CPU a default
shape that big is refused, and the error names a CPU-sized shape to run instead; a shape the
caller names is always run.
"""

from __future__ import annotations

import math

import torch

from autofuse.errors import InputError
from autofuse.serve.table import shape_key

# Multiply-adds (the product of a shape's sizes: batch × in × out for a GEMM) above which a default
# shape is left to a GPU. At 1024³ one float32 GEMM took 136 ms on the 2-core test machine (loaded),
# and a trial's gate and timing run dozens: minutes per tune. gemm_bn's first default is 256 times that.
CPU_MAX_SIZE = 2**30


def resolve_device(device: str | None) -> str:
    """``device``, or where it is None "cuda" if torch sees a GPU, else "cpu"."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise InputError(f"device must be cpu, cuda or cuda:N, got {device!r}") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device {device!r} asked for, but torch.cuda.is_available() is False here")
    return device


def shapes_to_run(prob, shape, device: str, asked: str | None) -> list[dict]:
    """[``shape``] normalized, else the problem's default shapes, which on the CPU must be CPU-sized.

    ``device`` is ``resolve_device(asked)``; ``asked`` None means nobody chose the CPU.
    """
    if shape is not None:
        return [prob.normalize_shape(shape)]
    shapes = [dict(s) for s in prob.default_shapes]
    big = [s for s in shapes if math.prod(s.values()) > CPU_MAX_SIZE]
    if torch.device(device).type != "cpu" or not big:
        return shapes
    why = ("no CUDA GPU was found here (torch.cuda.is_available() is False)" if asked is None
           else f"the device is {device}")
    small = [s for s in prob.conformance_shapes() if math.prod(s.values()) <= CPU_MAX_SIZE]
    try_this = (f"--device cpu --shape {shape_key(max(small, key=lambda s: math.prod(s.values())))}" if small
                else "--device cpu --shape with smaller sizes")
    raise InputError(f"{why}, and {prob.name}'s default shape(s) {'; '.join(prob.shape_str(s) for s in big)} are "
                     f"sized for a GPU (over {CPU_MAX_SIZE:,} multiply-adds, the product of the sizes): "
                     f"name a CPU-sized shape, e.g. {try_this}")
