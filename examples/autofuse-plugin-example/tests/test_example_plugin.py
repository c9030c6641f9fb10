"""The plugin's own tests: its variants through autofuse's conformance kit, the same gate the
tuner applies (float64 reference, several input distributions, odd shapes and batch 1)."""

from autofuse_plugin_example.row_chunked import RowChunkedGeluSoftmax

from autofuse.core import registry
from autofuse.testing import assert_variant_conforms, parametrize_variants


@parametrize_variants(problems=["matmul_sigmoid_sum"])
def test_the_new_problems_variants_conform(problem, variant):
    assert_variant_conforms(problem, variant)


def test_row_chunked_conforms_in_every_configuration():
    for params in RowChunkedGeluSoftmax.configs({}, "cpu"):
        assert_variant_conforms("matmul_gelu_softmax", "row_chunked", params=params)


def test_row_chunked_is_right_across_several_chunks():
    # The conformance shapes' batches fit in one chunk; 200 rows are 4 chunks of 64 (the last partial).
    assert_variant_conforms("matmul_gelu_softmax", "row_chunked", params={"rows": 64}, shapes=((200, 48, 40),))


def test_both_are_registered_by_this_plugin():
    assert registry.owner("matmul_sigmoid_sum") == "example.matmul_sigmoid_sum"
    assert registry.owner("kb2-56", "fused_bias") == "example.matmul_sigmoid_sum"
    assert registry.owner("matmul_gelu_softmax", "row_chunked") == "example.row_chunked"
