"""Every parameter PyTorch gives a gradient gets one (issue 32.3), under every autograd-capable
variant that runs on the CPU, in every mode (and, gpu-marked, under every CUDA one).

An optimizer skips a parameter whose ``.grad`` is None, weight decay included, so a None where
PyTorch has a tensor (even one of ~1e-13, as training-mode BatchNorm gives the GEMM bias) makes
training drift from plain PyTorch. The gate compares gradient values; this checks their presence.
"""

import pytest
import torch
from helpers import PROBLEMS, SMALL, assert_close, kernelbench_model, twin

from autofuse.core import registry

B, IN, OUT = SMALL
MODES = [(p, m) for p in PROBLEMS
         for m in (("train", "eval") if registry.get_problem(p).mode_sensitive else ("train",))]


def _autograd_variants(problem, device):
    """Autograd-capable variants for ``device``, on the CPU those that can run here. `compiled` has
    a test of its own on the CPU (it is blocked at collection, and slow to compile), none on CUDA."""
    return [name for name, cls in sorted(registry.variants(problem).items())
            if cls.supports_autograd and device in cls.devices and name != "compiled"
            and (device != "cpu" or cls.unavailable_reason("cpu") is None)]


CASES = [(p, m, v) for p, m in MODES for v in _autograd_variants(p, "cpu")]
CUDA_CASES = [(p, m, v) for p, m in MODES for v in _autograd_variants(p, "cuda")]


def assert_gradients_where_pytorchs_are(problem, mode, variant_name, params=None, device="cpu"):
    """A tensor gradient for every parameter PyTorch gives one, finite, and PyTorch's within the
    problem's fp32 tolerance (on the GPU, parameters the output does not depend on: finite only,
    as the gate checks them)."""
    prob, cls = registry.get_problem(problem), registry.get_variant(problem, variant_name)
    reason = cls.admits(device, torch.float32, "fp32", autograd=True)
    if reason is not None:
        pytest.skip(f"{problem}/{variant_name} cannot run here: {reason}")
    shape = dict(zip(prob.dims, SMALL))
    valid = cls.configs_for(shape, device, "fp32")
    if not valid:
        pytest.skip(f"{problem}/{variant_name} has no configuration at {shape} on {device}")
    variant = cls("fp32", **(params if params is not None else valid[0]))
    variant.build(device)
    tol, invariant = prob.tolerances["fp32"], prob.invariant_parameters(mode) if device != "cpu" else ()
    model = kernelbench_model(problem, B, IN, OUT, mode=mode).to(device)
    reference = twin(model)
    x = torch.randn(B, IN, device=device)
    out = variant(model, x.clone().requires_grad_(True))
    want = reference(x.clone().requires_grad_(True))
    g = torch.randn_like(want)
    out.backward(g)
    want.backward(g)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:
            continue
        what = f"{problem}/{variant_name} ({mode}): {name}.grad"
        assert p.grad is not None, f"{what} is None; PyTorch's is {q.grad}"
        assert torch.isfinite(p.grad).all(), f"{what} is not finite: {p.grad}"
        if name not in invariant:
            assert_close(p.grad, q.grad, atol=tol.atol, rtol=tol.rtol, what=what)


@pytest.mark.parametrize("problem, mode, variant", CASES, ids=[f"{p}-{m}-{v}" for p, m, v in CASES])
def test_every_parameter_with_a_pytorch_gradient_gets_one(problem, mode, variant):
    assert_gradients_where_pytorchs_are(problem, mode, variant)


@pytest.mark.gpu
@pytest.mark.parametrize("problem, mode, variant", CUDA_CASES, ids=[f"{p}-{m}-{v}" for p, m, v in CUDA_CASES])
def test_every_parameter_with_a_pytorch_gradient_gets_one_on_the_gpu(problem, mode, variant):
    assert_gradients_where_pytorchs_are(problem, mode, variant, device="cuda")


@pytest.mark.parametrize("problem, mode", MODES)
def test_compiled_gives_every_parameter_with_a_pytorch_gradient_one(problem, mode, with_compiled):
    assert_gradients_where_pytorchs_are(problem, mode, "compiled", {"mode": "default", "dynamic": False})
