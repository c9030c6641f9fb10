"""A conformance kit any plugin's variants run through (registry driven, variant names as ids).

In a plugin's test suite::

    from autofuse.testing import assert_variant_conforms, parametrize_variants

    @parametrize_variants(problems=["gemm_bn"])
    def test_conforms(problem, variant):
        assert_variant_conforms(problem, variant)

Each check is the same gate the tuner applies (float64 reference, several distributions,
randomized parameters, side effects, aliasing, staleness), at odd shapes including batch 1
and sizes of 1, in every mode the problem has, plus gradients where autograd is claimed.
``wide_gradient_inputs`` draws the wide-row families a GEMM backward on split parts must carry.
"""

from __future__ import annotations

import pytest
import torch

from autofuse.core import registry
from autofuse.core.problem import CONFORMANCE_SIZES as CONFORMANCE_SHAPES  # noqa: F401 - kept importable
from autofuse.tuning.gate import CheckCase, check_variant

# "wide": rows of x and W whose largest entries dwarf the rest (the gate's own case, ``check_cases``), so a
# plugin's emulated float32 that cannot carry such rows fails here as it would fail the tuner's gate.
DISTRIBUTIONS = (("rand", False), ("randn", True), ("large", True), ("wide", True))


def variant_ids(problems: list[str] | None = None, generic: bool = False) -> list[tuple[str, str]]:
    names = problems or sorted(registry.problems())
    return [(registry.get_problem(p).name, v) for p in names for v in sorted(registry.variants(p))
            if generic or not registry.is_generic(p, v)]


def parametrize_variants(problems: list[str] | None = None, generic: bool = False):
    """``pytest.mark.parametrize("problem,variant", ...)`` over every registered variant.

    Variants every problem gets (``compiled``: torch.compile of the reference, from
    ``autofuse_register_generic_variants``) are left out unless ``generic``: they are autofuse's
    to test, and compiling each at every conformance shape takes minutes on a CPU.
    """
    ids = variant_ids(problems, generic)
    return pytest.mark.parametrize("problem,variant", ids, ids=[f"{p}/{v}" for p, v in ids])


def _shapes(prob, shapes) -> list[dict]:
    """``shapes`` as dicts: None is the problem's own conformance shapes; a tuple is sizes in ``dims`` order."""
    if shapes is None:
        return prob.conformance_shapes()
    return [dict(s) if isinstance(s, dict) else dict(zip(prob.dims, s)) for s in shapes]


def conformance_cases(problem: str, seed: int = 0, shapes=None) -> list[CheckCase]:
    prob = registry.get_problem(problem)
    cases = []
    for i, shape in enumerate(_shapes(prob, shapes)):
        for j, (distribution, randomize) in enumerate(DISTRIBUTIONS):
            cases.append(CheckCase(shape, distribution, seed + 10 * i + j, randomize))
    return cases


def assert_variant_conforms(problem: str, variant: str, *, device: str = "cpu", precision: str = "fp32",
                            params: dict | None = None, dtype=torch.float32, seed: int = 0, shapes=None) -> None:
    """Fail with the gate's reason unless ``variant`` passes on every conformance case, mode and autograd need."""
    prob = registry.get_problem(problem)
    variant_cls = registry.get_variant(problem, variant)
    reason = variant_cls.admits(torch.device(device).type, dtype, precision, autograd=False)
    if reason is not None:
        pytest.skip(f"{problem}/{variant} cannot run here: {reason}")
    modes = ("train", "eval") if prob.mode_sensitive else ("train",)
    for shape in _shapes(prob, shapes):
        # Configurations may depend on the shape (a row held in registers): each shape checks
        # the given one where it is valid, else that shape's default.
        cases = conformance_cases(problem, seed, (shape,))
        valid = variant_cls.configs_for(cases[0].shape, torch.device(device).type, precision)
        if not valid or (params is not None and params not in valid):
            continue
        instance = variant_cls(precision, **(params if params is not None else valid[0]))
        instance.build(device)
        for mode in modes:
            for autograd in (False, True) if variant_cls.supports_autograd else (False,):
                if autograd and variant_cls.admits(torch.device(device).type, dtype, precision, autograd=True):
                    continue  # e.g. a bfloat16 model's gradients, which another variant serves
                result = check_variant(instance, prob, cases, device, dtype=dtype, mode=mode, autograd=autograd)
                assert result.ok, f"{problem}/{variant} ({mode}, {precision}, autograd={autograd}): {result.reason}"


def wide_gradient_inputs(m: int, n: int, k: int, side: str, span: str, ratio: float, zeroed: bool,
                         generator: torch.Generator, count: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dy, x, W) of a GEMM's backward (dy: m × n, x: m × k, W: n × k; randn) with ``side``'s ("x",
    "W" or "dy") rows wide: ``count`` of their columns ``ratio`` times the rest, in two rows or
    (``span`` "all") every row. With ``zeroed`` the entries each wide one multiplies are zero, so
    dx = dy·W or dW = dyᵀ·x rests on the ordinary entries alone: x's wide rows meet zero rows of dy
    in dW, W's wide rows zero columns of dy in dx, dy's wide rows zero rows of W in dx and zero rows
    of x in dW. A column of x or dy (dW contracts over the batch) is wide where only some rows are.
    The float16 splits' worst case (docs/precision.md, the range check)."""
    if side not in ("x", "W", "dy") or span not in ("two", "all"):
        raise ValueError(f"side must be 'x', 'W' or 'dy' and span 'two' or 'all', got {side=}, {span=}")
    dy, x = torch.randn(m, n, generator=generator), torch.randn(m, k, generator=generator)
    w = torch.randn(n, k, generator=generator) / k ** 0.5
    big = {"x": x, "W": w, "dy": dy}[side]
    rows = torch.arange(big.shape[0]) if span == "all" else torch.randperm(big.shape[0], generator=generator)[:2]
    cols = torch.randperm(big.shape[1], generator=generator)[:count]
    big[rows[:, None], cols[None, :]] *= ratio
    if zeroed and side == "x":
        dy[rows] = 0.0
    elif zeroed and side == "W":
        dy[:, rows] = 0.0
    elif zeroed:
        w[cols] = 0.0
        x[rows] = 0.0
    return dy, x, w
