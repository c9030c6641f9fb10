"""What one bench measurement is built from: the problem at a shape, the model and input in the
model's dtype, how a call is timed, and the dispatching module a user would get.

``autofuse bench`` (one shape, every row) and its batch sweep (``autofuse.bench.sweep``, a few
rows at many batches) build their calls here, so a row named the same measures the same call in
both. A bfloat16 model (``dtype=torch.bfloat16``) is the reference model cast with
``model.bfloat16()`` and fed bfloat16 inputs, as KernelBench's harness runs at
``precision=torch.bfloat16``; it exists under bf16 only (``check_dtype``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from autofuse.bench.targets import FORWARD, TRAINING
from autofuse.core.precision import check_dtype, dtype_name, parse_dtype
from autofuse.core.problem import Problem
from autofuse.errors import InputError
from autofuse.serve.runtime import get_module
from autofuse.tuning.gate import CheckCase, build_case
from autofuse.tuning.timed_call import forward_call, training_call

STEPS = (FORWARD, TRAINING)


@dataclasses.dataclass
class Setup:
    """One measurement's problem, shape and settings, its model and input, and how a call is timed."""

    prob: Problem
    shape: dict
    device: str
    precision: str
    mode: str
    step: str
    model: nn.Module
    x: torch.Tensor
    upstream: dict = dataclasses.field(default_factory=dict)  # one upstream gradient for every row

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype (float32, or bfloat16 for a bfloat16 model)."""
        return self.x.dtype

    @property
    def device_type(self) -> str:
        return torch.device(self.device).type

    def timed(self, run, model: nn.Module | None = None):
        """``run(model, x)`` as the call to time: a forward, or a training step."""
        model = self.model if model is None else model
        if self.step == FORWARD:
            return forward_call(run, model, self.x)
        return training_call(run, model, self.x, self.upstream, self.precision)


def resolve_dtype(dtype: str, precision: str | None) -> tuple[str, str]:
    """``(dtype name, precision)`` checked together: a bfloat16 model implies bf16 where no
    precision is named, and any other precision is an error that says so."""
    torch_dtype = parse_dtype(dtype)
    precision = precision or ("bf16" if torch_dtype == torch.bfloat16 else "fp32")
    check_dtype(torch_dtype, precision)
    return dtype_name(torch_dtype), precision


def check_step(step: str) -> None:
    if step not in STEPS:
        raise InputError(f"step must be one of {STEPS}, got {step!r}")


def make_setup(prob: Problem, shape: dict, device: str, dtype: str, precision: str, mode: str, step: str) -> Setup:
    """The model (default init, seed 0) and a ``torch.rand`` input at ``shape``, both in ``dtype``."""
    model, x = build_case(prob, CheckCase(shape, "rand", 0, False), device, parse_dtype(dtype), mode)
    return Setup(prob, shape, device, precision, mode, step, model, x)


def dispatch_module(setup: Setup, table) -> nn.Module:
    """``get_module``'s module with the setup model's parameters, buffers and dtype (a bfloat16
    model's module is cast as the model was, so its calls take the ``dtype=bfloat16`` keys)."""
    prob, model = setup.prob, setup.model
    args, kwargs = prob.init_args(setup.shape)
    module = get_module(prob.name, *args, table=table, precision=setup.precision, tune_on_miss=False, **kwargs)
    module.to(device=setup.x.device, dtype=setup.dtype)
    module.load_state_dict(model.state_dict())
    module.train(model.training)
    for attr in ("scale_factor", "clamp_min", "clamp_max"):  # plain attributes the state_dict omits
        if hasattr(model, attr):
            setattr(module, attr, getattr(model, attr))
    return module


def dispatch_call(setup: Setup, table) -> tuple[dict, object]:
    """(``dispatch_info`` of the setup's call, the timed call): without grad, or (a training step)
    with its parameters requiring grad in grad mode, which takes the ``autograd=true`` entry."""
    module = dispatch_module(setup, table)
    with torch.set_grad_enabled(setup.step == TRAINING):
        info = module.dispatch_info(setup.x)
    return info, setup.timed(lambda m, inp: m(inp), module)
