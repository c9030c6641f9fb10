"""Every parameter PyTorch gives a gradient gets one (issue 32.3), under every autograd-capable
variant that runs on the CPU, in every mode.

An optimizer skips a parameter whose ``.grad`` is None, weight decay included, so a None where
PyTorch has a tensor (even one of ~1e-13, as training-mode BatchNorm gives the GEMM bias) makes
training drift from plain PyTorch. The gate compares gradient values; this checks their presence.
"""

import pytest
import torch
from helpers import PROBLEMS, SMALL, assert_close, kernelbench_model, twin

from autofuse.core import plugins, registry

B, IN, OUT = SMALL
MODES = [(p, m) for p in PROBLEMS
         for m in (("train", "eval") if registry.get_problem(p).mode_sensitive else ("train",))]


def _cpu_autograd_variants(problem):
    return [name for name, cls in sorted(registry.variants(problem).items())
            if cls.supports_autograd and cls.unavailable_reason("cpu") is None]


CASES = [(p, m, v) for p, m in MODES for v in _cpu_autograd_variants(p)]  # `compiled` is blocked here (conftest)


def assert_gradients_where_pytorchs_are(problem, mode, variant_name, params=None):
    cls = registry.get_variant(problem, variant_name)
    shape = dict(zip(registry.get_problem(problem).dims, SMALL))
    variant = cls("fp32", **(params if params is not None else cls.configs(shape, "cpu")[0]))
    variant.build("cpu")
    tol = registry.get_problem(problem).tolerances["fp32"]
    model = kernelbench_model(problem, B, IN, OUT, mode=mode)
    reference = twin(model)
    x = torch.randn(B, IN)
    out = variant(model, x.clone().requires_grad_(True))
    want = reference(x.clone().requires_grad_(True))
    g = torch.randn_like(want)
    out.backward(g)
    want.backward(g)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is not None:
            assert p.grad is not None, f"{problem}/{variant_name} ({mode}): {name}.grad is None; PyTorch's is {q.grad}"
            assert_close(p.grad, q.grad, atol=tol.atol, rtol=tol.rtol,
                         what=f"{problem}/{variant_name} ({mode}): {name}.grad")


@pytest.mark.parametrize("problem, mode, variant", CASES, ids=[f"{p}-{m}-{v}" for p, m, v in CASES])
def test_every_parameter_with_a_pytorch_gradient_gets_one(problem, mode, variant):
    assert_gradients_where_pytorchs_are(problem, mode, variant)


@pytest.fixture
def compiled(monkeypatch):
    """`compiled` registered (conftest leaves it out: each compile takes seconds on a CPU)."""
    monkeypatch.delenv("AUTOFUSE_BLOCK_PLUGINS", raising=False)
    plugins.reset_plugin_manager()
    yield
    monkeypatch.undo()
    plugins.reset_plugin_manager()


@pytest.mark.parametrize("problem, mode", MODES)
def test_compiled_gives_every_parameter_with_a_pytorch_gradient_one(problem, mode, compiled):
    assert_gradients_where_pytorchs_are(problem, mode, "compiled", {"mode": "default", "dynamic": False})
