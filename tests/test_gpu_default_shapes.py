"""On the GPU: every variant's default configuration passes the gate at the problems' default shapes.

The conformance kit covers odd and tiny shapes; this covers the sizes people tune (16384×4096²
and 1024×8192² GEMMs), in training and eval mode for gemm_bn. The float64 references are
computed once per problem, shape and mode and shared by the variants.
"""

import pytest
import torch

from autofuse.core import registry
from autofuse.tuning.gate import check_cases, check_variant

CASES = [(p, i, mode) for p in sorted(registry.problems())
         for i in range(len(registry.get_problem(p).default_shapes))
         for mode in (("train", "eval") if registry.get_problem(p).mode_sensitive else ("train",))]
_shared_cache: dict = {}


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("problem,shape_index,mode", CASES, ids=[f"{p}-{i}-{m}" for p, i, m in CASES])
def test_every_variant_passes_the_gate_at_default_shapes(problem, shape_index, mode):
    prob = registry.get_problem(problem)
    shape = dict(prob.default_shapes[shape_index])
    cases = check_cases(prob, shape, seed=2026)
    failures = []
    for name, cls in registry.variants(problem).items():
        if cls.admits("cuda", torch.float32, "fp32", autograd=False) is not None:
            continue
        variant = cls("fp32", **cls.configs(shape, "cuda")[0])
        variant.build("cuda")
        result = check_variant(variant, prob, cases, "cuda", mode=mode, cache=_shared_cache)
        if not result.ok:
            failures.append(f"{name}: {result.reason}")
    _shared_cache.clear()
    assert not failures, failures
