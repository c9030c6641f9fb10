"""Every registered variant of every problem through the conformance kit, on CPU (and CUDA if present)."""

import pytest

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
