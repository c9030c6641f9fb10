"""Every registered variant of every problem through the conformance kit, on CPU (and CUDA if present)."""

import pytest

from autofuse import registry
from autofuse.testing import assert_variant_conforms, parametrize_variants
from conftest import DEVICES


@parametrize_variants()
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_variant_conforms(problem, variant, precision, device):
    assert_variant_conforms(problem, variant, device=device, precision=precision)


@pytest.mark.gpu
@parametrize_variants()
def test_variant_conforms_tf32_on_gpu(problem, variant):
    assert_variant_conforms(problem, variant, device="cuda", precision="tf32")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("problem", ["matmul_gelu_softmax", "matmul_clamp_lse_mish"])
def test_every_row_epilogue_configuration_on_gpu(problem, precision):
    """Every configuration of the row epilogues (row in registers or streamed, 16-byte or
    scalar loads of float32 or bfloat16 logits), where the default-only tests above reach few:
    rows a multiple of 8 (vector loads), of 4 only (float vectors, scalar bfloat16) and odd,
    batch 1, and a row of 4100 that every register layout (items 8 to 32) holds."""
    prob = registry.get_problem(problem)
    variant = registry.get_variant(problem, "cublas_epilogue")
    for sizes in ((1, 40, 64), (5, 33, 1000), (3, 17, 777), (2, 16, 4100)):
        shape = dict(zip(prob.dims, sizes))
        for params in variant.configs(shape, "cuda"):
            assert_variant_conforms(problem, "cublas_epilogue", device="cuda", precision=precision, params=params,
                                    shapes=[shape])  # fmt: skip
