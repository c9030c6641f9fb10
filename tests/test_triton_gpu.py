"""On the GPU: every operand path and schedule of the ``triton`` kind through the tuner's gate.

Issue 11's list: batch 1, 37, 1000 and 1025, in all three precisions, train and eval, with and
without gradients (``assert_variant_conforms`` runs every mode and autograd need). K = 1000 is
a multiple of 8 but of no BLOCK_K (TMA, and the masked K tail of the pointer loads); K = 1004
is not a multiple of 8 (no TMA: the pointer path alone); N = 777 and 1025 leave partial column
tiles, batch 1025 a row tile of one. Each configuration is the first valid one of its operand
path, persistence and TMA choice, so the tile sizes are the defaults the tuner starts from.

At tf32 batch 1 is left out: there cuBLAS's TF32 mode (the gate's floor) multiplies in float32,
and TF32 products on large inputs failed the bound it sets (both operand paths, H100). So those
configurations may serve only the shapes the tuner gated them at (``TritonVariant.only_where_gated``;
tests/test_runtime.py checks the dispatcher keeps to that), and here they are checked from batch 37.
"""

import pytest
import torch

from autofuse.core import registry
from autofuse.kernels.triton.variant import OPERANDS
from autofuse.testing import assert_variant_conforms

PROBLEMS = ["matmul_gelu_softmax", "matmul_clamp_lse_mish", "gemm_bn"]
SIZES = ((1, 1000, 777), (37, 1004, 777), (1000, 1000, 777), (1025, 1000, 1025))


def representative_configs(cls, shape, precision) -> list[dict]:
    """The first valid configuration per (operands, persistent, tma) at this shape and precision."""
    seen, chosen = set(), []
    for params in cls.configs_for(shape, "cuda", precision):
        key = (params["operands"], params["persistent"], params["tma"])
        if key not in seen:
            seen.add(key)
            chosen.append(params)
    return chosen


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("problem", PROBLEMS)
def test_every_triton_operand_path_passes_the_gate_at_odd_batches(problem, precision):
    prob = registry.get_problem(problem)
    cls = registry.get_variant(problem, "triton")
    if cls.admits("cuda", torch.float32, precision, autograd=True) is not None:
        pytest.skip(cls.admits("cuda", torch.float32, precision, autograd=True))
    paths, failures = set(), []
    for sizes in SIZES:
        shape = dict(zip(prob.dims, sizes))
        for params in representative_configs(cls, shape, precision):
            if cls.only_where_gated(params) is not None and sizes[0] < 37:
                continue
            paths.add(params["operands"])
            try:
                assert_variant_conforms(problem, "triton", device="cuda", precision=precision, params=params,
                                        shapes=[shape], seed=sizes[0])  # fmt: skip
            except AssertionError as exc:  # every failing configuration is reported, not only the first
                # A configuration served only where gated (split_trunc) may miss on the
                # ill-conditioned large inputs; on the others it must pass like the rest.
                if cls.params_elsewhere(params) != params and " large " in str(exc):
                    print(f"served only where gated, fails here: {sizes} {params}: {exc}")
                    continue
                failures.append(f"{sizes} {params}: {exc}")
    # Every operand path of this precision was exercised (a path the space lost would go unchecked).
    assert paths == {name for name, (served, *_) in OPERANDS.items() if served == precision}
    assert not failures, "\n".join(failures)
