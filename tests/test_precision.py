"""The precision classes: their order, what each admits, and how each is judged."""

import pytest
import torch

from autofuse.core import precision, registry
from autofuse.core.variant import Variant
from autofuse.errors import InputError
from autofuse.serve import table


def test_strictest_first_and_the_table_agrees():
    assert precision.PRECISIONS == ("ieee", "fp32", "tf32", "bf16")
    assert table.PRECISIONS == precision.PRECISIONS  # kept torch-free for the CLI


@pytest.mark.parametrize(("requested", "order"), [
    ("ieee", ("ieee",)),
    ("fp32", ("fp32", "ieee")),
    ("tf32", ("tf32", "fp32", "ieee")),
    ("bf16", ("bf16", "tf32", "fp32", "ieee")),
])
def test_a_stricter_entry_serves_a_looser_request_never_the_reverse(requested, order):
    assert precision.serving_order(requested) == order


def test_unknown_precision_is_an_input_error_naming_the_known_ones():
    with pytest.raises(InputError, match="ieee"):
        precision.serving_order("fp16")


@pytest.mark.parametrize("name", ["ieee", "fp32"])
def test_ieee_and_fp32_keep_tf32_off_whatever_the_global_flag(name):
    # Not monkeypatch: allow_tf32 is served by cuBLASModule.__getattr__, so pytest's undo deletes it.
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        with precision.math_mode(name):
            assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        with precision.math_mode("tf32"):
            torch.backends.cuda.matmul.allow_tf32 = False  # the body may change it; the exit restores
        assert torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_ieee_is_held_to_the_fp32_tolerance():
    problem = registry.get_problem("matmul_gelu_softmax")
    assert problem.tolerance("ieee") == problem.tolerances["fp32"] == problem.tolerance("fp32")
    assert problem.tolerance("bf16") == problem.tolerances["bf16"]


def test_ieee_admits_float32_inputs_only():
    precision.check_dtype(torch.float32, "ieee")
    with pytest.raises(InputError, match="bf16"):
        precision.check_dtype(torch.bfloat16, "ieee")


def test_a_compensated_variant_leaves_ieee_out_and_is_not_admitted_there():
    class Compensated(Variant):
        name, problem, kind, description = "c", "matmul_gelu_softmax", "simplified", "3xTF32"
        precisions = ("fp32", "tf32", "bf16")

    assert Compensated.admits("cpu", torch.float32, "ieee", False) == "precision ieee not in ('fp32', 'tf32', 'bf16')"
    assert Compensated.admits("cpu", torch.float32, "fp32", False) is None


def test_a_float32_models_bf16_gemm_reads_x_and_its_gemm_input_alike():
    """Under bf16 a forward may hand the GEMM x's bfloat16 copy (``gemm_input``, kept for dW): the
    product and the bias left to the epilogue are those of x itself, never a bfloat16 model's
    (bias rounded and added by the GEMM)."""
    x, w, b = torch.randn(5, 7) * 3, torch.randn(3, 7), torch.randn(3)
    xb = precision.gemm_input(x, "bf16")
    assert xb.dtype == torch.bfloat16 and precision.gemm_input(x, "fp32") is x
    (y, left), (y_b, left_b) = precision.linear_deferring_bias(x, w, b, "bf16"), precision.linear_deferring_bias(
        xb, w, b, "bf16")
    assert torch.equal(y, y_b) and left is b and left_b is b
    product = precision.float32_model_product(xb, w, "bf16")
    assert product.dtype == torch.float32 and torch.equal(product, precision.linear(x, w, None, "bf16"))
