"""Every registered variant of every problem through the conformance kit, on CPU (and CUDA if present)."""

import pytest
from conftest import DEVICES
from helpers import PROBLEMS

from autofuse.core import registry
from autofuse.testing import assert_variant_conforms, parametrize_variants


@parametrize_variants()
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_variant_conforms(problem, variant, precision, device):
    assert_variant_conforms(problem, variant, device=device, precision=precision)


@pytest.mark.parametrize("problem", PROBLEMS)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_the_generic_eager_conforms(problem, precision, device):
    # parametrize_variants leaves generic variants out (compiled compiles for minutes); eager, once
    # each problem's own variant, stays in the kit.
    assert_variant_conforms(problem, "eager", device=device, precision=precision)


@pytest.mark.gpu
@parametrize_variants()
def test_variant_conforms_tf32_on_gpu(problem, variant):
    shapes = None
    if variant == "triton":
        # TF32 products in the kernel; at batch 1 and K = 1 the floor (cuBLAS's TF32 mode) is
        # float32 arithmetic, so these are gated where the tuner gates them: from batch 37 (see
        # TritonVariant.only_where_gated and tests/test_triton_gpu.py).
        prob = registry.get_problem(problem)
        shapes = [s for s in prob.conformance_shapes() if min(s.values()) >= 37]
    assert_variant_conforms(problem, variant, device="cuda", precision="tf32", shapes=shapes)


# Open: at 5×33×1000 on large inputs the bf16 forward's small
# softmax entries are 40x further from float64 than eager bf16's, and the input gradient misses
# (5.24 > 0.475; H100). Strict: the day it passes, this marker must go.
BF16_ONE_HOT = pytest.mark.xfail(strict=True, reason="99 cublas_epilogue bf16, 5×33×1000 large: gradient 5.24 > 0.475")


@pytest.mark.gpu
@pytest.mark.parametrize("problem, precision", [
    ("matmul_gelu_softmax", "fp32"), pytest.param("matmul_gelu_softmax", "bf16", marks=BF16_ONE_HOT),
    ("matmul_clamp_lse_mish", "fp32"), ("matmul_clamp_lse_mish", "bf16")])
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
            try:
                assert_variant_conforms(problem, "cublas_epilogue", device="cuda", precision=precision,
                                        params=params, shapes=[shape])  # fmt: skip
            except AssertionError as exc:
                raise AssertionError(f"{sizes} {params}: {exc}") from None


@pytest.mark.gpu
def test_every_gemm_bn_epilogue_configuration_on_gpu():
    """Every configuration of gemm_bn's training epilogue (strips of 8, 16, 32 columns held in
    shared memory; the two-kernel path) at the shapes where it is offered: batch 2, odd widths
    (scalar loads) and multiples of 4 (float4), a partial last strip, a strip at the 200 KB edge,
    several chunks of rows (the cross-chunk merge and its arrival counters, reused across cases),
    and a batch no strip holds."""
    prob = registry.get_problem("gemm_bn")
    variant = registry.get_variant("gemm_bn", "cublas_epilogue")
    for sizes in ((2, 1, 1), (2, 16, 36), (1, 37, 53), (37, 1000, 777), (64, 256, 192), (1600, 8, 33),
                  (700, 3, 37), (6500, 4, 36)):  # fmt: skip
        shape = dict(zip(prob.dims, sizes))
        for params in variant.configs(shape, "cuda"):
            assert_variant_conforms("gemm_bn", "cublas_epilogue", device="cuda", params=params, shapes=[shape])


@pytest.mark.gpu
@pytest.mark.parametrize("strip_cols", [8, 32])
def test_gemm_bn_strip_configuration_falls_back_when_the_batch_does_not_fit(monkeypatch, strip_cols):
    """A strip configuration at a batch whose strip exceeds the device's shared memory (8000 rows:
    250 KB or 1 MB) runs the two kernels instead. configs() never offers such a pair, so it is
    admitted here by hand."""
    variant = registry.get_variant("gemm_bn", "cublas_epilogue")
    params = {"strip_cols": strip_cols, "block": 256}
    monkeypatch.setattr(variant, "configs", classmethod(lambda cls, shape, device: [params]))
    assert_variant_conforms("gemm_bn", "cublas_epilogue", device="cuda", params=params,
                            shapes=[(8000, 4, 36), (8000, 3, 37)])  # fmt: skip
