"""CUDA host entry points check their input contracts before any launch (no GPU needed to fail them)."""

import pytest
import torch

from autofuse import InputError, registry
from autofuse.cuda_variant import CudaVariant, input_operand, operand


def test_input_contract_names_expected_and_got():
    with pytest.raises(InputError, match=r"expected a 2-D input \(batch, 8\), got torch.Size\(\[8\]\)"):
        input_operand(torch.rand(8), 8)
    with pytest.raises(InputError, match="expected a CUDA input, got one on cpu"):
        input_operand(torch.rand(2, 8), 8)


def test_operand_contract_names_expected_and_got():
    with pytest.raises(InputError, match="expected float32, got float64"):
        operand(torch.rand(3, dtype=torch.float64), "bias", (3,), torch.device("cpu"))
    with pytest.raises(InputError, match=r"expected shape \(4,\), got \(3,\)"):
        operand(torch.rand(3), "bias", (4,), torch.device("cpu"))
    with pytest.raises(InputError, match="got None"):
        operand(None, "bias", (4,), torch.device("cpu"))
    strided = torch.rand(4, 6)[:, ::2]
    assert operand(strided, "weight", (4, 3), torch.device("cpu")).is_contiguous()  # made contiguous


def test_built_in_cuda_variants_are_fp32_cuda_only_and_all_have_a_backward():
    for problem in ("gemm_bn", "gemm_avgpool_gelu_residual", "matmul_gelu_softmax", "matmul_clamp_lse_mish"):
        for name, cls in registry.variants(problem).items():
            if issubclass(cls, CudaVariant):
                assert cls.devices == ("cuda",) and cls.dtypes == (torch.float32,) and cls.supports_autograd, name
                assert cls.admits("cpu", torch.float32, "fp32", False) is not None
