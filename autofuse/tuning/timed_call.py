"""What one timed call is: a forward without autograd, or a training step.

The tuner (``evaluate``) and ``autofuse bench`` time calls through these two functions, so
an entry's time and the bench's row measure the same thing.

A training step is what one layer costs in ``optimizer.zero_grad(set_to_none=True);
loss.backward()``: every parameter's gradient set to None first (so no accumulation add is
timed), the forward with autograd recording, then the backward of a fixed upstream gradient.

* The upstream gradient is random normal, drawn once per output shape from a fixed seed, and
  every candidate gets the same one. All ones is a degenerate case: softmax's rows sum to 1,
  so the backward of ones through softmax is exactly zero.
* Only the parameters require grad, not the input: the block is timed as the first layer of
  a network, fed inputs that do not require grad (KernelBench's ``torch.rand``). The
  backward of a GEMM-based problem is then one more GEMM (the weight's gradient), not two.
  A layer deeper in a network would also compute the input's gradient (a third GEMM), which
  this timing leaves out. Gradients are still checked for the input too (``check_gradients``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from autofuse.core.precision import math_mode
from autofuse.serve import graphs

# The upstream gradient's seed: fixed, so every run and every candidate sees the same one.
UPSTREAM_SEED = 20261123


def upstream_gradient(out: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
    """A random normal tensor shaped like ``out``, the same for every call with this shape
    (kept in ``cache`` when given, so candidates timed together share one tensor)."""
    key = (tuple(out.shape), out.dtype, out.device)
    cache = {} if cache is None else cache
    if key not in cache:
        generator = torch.Generator().manual_seed(UPSTREAM_SEED)
        cache[key] = torch.randn(tuple(out.shape), generator=generator).to(device=out.device, dtype=out.dtype)
    return cache[key]


def forward_call(run: Callable, model: nn.Module, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """``run(model, x)`` under ``torch.no_grad()``: inference."""
    def call():
        with torch.no_grad():
            return run(model, x)
    return call


def replayed_call(run: Callable, model: nn.Module, x: torch.Tensor,
                  writes: tuple[str, ...] = ()) -> Callable[[], torch.Tensor]:
    """``run(model, x)`` as the runtime serves a key it replays as a CUDA graph
    (``autofuse.serve.graphs``; ``writes``: the buffers a training-mode forward writes), warmed
    until captured: where the runtime replays, a candidate's time is its replay's, re-pointed at
    x or paying the copies its graph needs (cuBLAS's GEMM at 1×8192² bf16: 47 µs; its graph's
    copies and their gaps: 3-9 µs more, benchmarks/analysis.md)."""
    graphed = graphs.GraphedCall.standalone(run, model, writes)
    call = forward_call(graphed, model, x)
    for _ in range(graphs.WARM_CALLS + 1):
        call()
    return call


def training_call(run: Callable, model: nn.Module, x: torch.Tensor, upstream: dict | None = None,
                  precision: str = "fp32") -> Callable[[], torch.Tensor]:
    """One training step of ``run(model, x)``: parameter gradients cleared, forward, backward,
    all under ``math_mode(precision)``, as a user training at that precision sets the flags for
    the whole step (else eager's backward under tf32 ran its GEMMs in fp32: 13.5 ms where the
    step takes about 3, gemm_bn at 16384 on an H100)."""
    x = x.detach()  # the input does not require grad (see the module docstring)
    params = [p for p in model.parameters() if p.requires_grad]
    upstream = {} if upstream is None else upstream

    def step():
        for param in params:
            param.grad = None
        with torch.enable_grad(), math_mode(precision):
            out = run(model, x)
            out.backward(upstream_gradient(out, upstream))
        return out
    return step
