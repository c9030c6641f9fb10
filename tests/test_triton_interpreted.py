"""The Triton kernels' logic on the CPU, through Triton's interpreter (TRITON_INTERPRET=1).

Each check runs tests/interpreted/check_triton.py in its own process: the interpreter must be
on before triton defines the kernels, and this session may have imported them without it.
The GPU compiles the same kernels for real; these check masks, partial tiles, odd shapes,
batch 1, both schedules and every operand path against the float64 reference (gradients
included), float32 models and bfloat16 ones, and that the checks can fail at all (a tanh-GELU
mutant is rejected).
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from autofuse.kernels.triton.variant import triton_missing

SCRIPT = pathlib.Path(__file__).parent / "interpreted" / "check_triton.py"


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])


def unusable() -> str | None:
    """Why the Triton (and numpy) installed cannot run these checks, or None. The test extra takes
    whatever release the user's torch requires; these pass under 3.6.0 with numpy 2.3, and 3.7.1,
    3.8.0 and 3.9.0 with numpy 2.4."""
    if triton_missing() is not None:
        return f"needs triton: {triton_missing()}"
    import numpy
    import triton

    version = triton.__version__
    if _release(version) < (3, 6):
        return (f"Triton {version}'s interpreter cannot run the TMA configurations: before 3.6 it checks that a "
                "descriptor's strides are 16-byte aligned in elements, not bytes (3.3 and older have no "
                "triton.tools.tensor_descriptor at all)")
    if _release(version) < (3, 7) and _release(numpy.__version__) >= (2, 4):
        return (f"Triton {version}'s interpreter calls int() on one-element arrays, an error since numpy 2.4 "
                f"(numpy {numpy.__version__} is installed); 3.7 squeezes them first")
    return None


pytestmark = pytest.mark.skipif(unusable() is not None, reason=str(unusable()))


def _run(*args):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{args}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout


@pytest.mark.parametrize("config", ["persistent-pointers", "grid-tma"])
@pytest.mark.parametrize("problem", ["matmul_gelu_softmax", "matmul_clamp_lse_mish", "gemm_bn"])
def test_triton_variant_passes_the_gate_interpreted(problem, config):
    _run("gate", problem, config, "fp32,tf32,bf16")


@pytest.mark.parametrize("config", ["persistent-pointers", "grid-tma"])
@pytest.mark.parametrize("problem", ["matmul_gelu_softmax", "matmul_clamp_lse_mish", "gemm_bn"])
def test_triton_variant_serves_a_bfloat16_model_interpreted(problem, config):
    """A bfloat16 model (x, parameters, BN statistics in bfloat16) under bf16: the gate against the
    float64 reference, gradients and running statistics included; outputs in bfloat16."""
    _run("gate", problem, config, "bf16_model")


def test_a_bfloat16_model_is_served_by_the_triton_variants_interpreted(tmp_path):
    """Tune candidates, dispatch through get_module and the KernelBench export at bf16 for a bfloat16 model."""
    _run("bf16_model_serving", str(tmp_path))


def test_a_bfloat16_model_of_22_rounds_where_its_reference_does_interpreted():
    """KernelBench compares a bfloat16 model's output with the bfloat16 reference at 1e-2; the
    float32-exact z·mish(z) lies ~1% from it at z near 19. The output must equal an emulation of the
    reference's CUDA arithmetic bit for bit, on rows too where rounding each exp(v − max) against the
    row's max (as torch does) gives another z than the per-tile sums did (1.4% off in out there)."""
    _run("bf16_model_rounds_as_the_reference")


def test_22s_finish_inside_the_gemms_launch_equals_the_finish_apart_interpreted():
    """One launch a call (``finish_inside``): the last program to arrive merges the rows; bit for bit
    the two-launch output at every precision and for bfloat16 models, the range check's exact path
    taking tiles again, calls repeated (the counter back at 0), pairs merged in steps."""
    _run("finish_inside")


def test_a_bfloat16_model_of_gemm_bn_rounds_where_its_reference_does_interpreted():
    """KernelBench compares a bfloat16 model's output with the bfloat16 reference at 1e-2; in
    training, BatchNorm's 1/σ scales the reference's rounding of linear's output and x·s up to 2
    bfloat16 steps past that (39 at 16384 × 4096², H100)."""
    _run("bf16_model_bn_rounds_as_the_reference")


def test_a_float32_models_bf16_gradients_are_float32_sums_not_bfloat16_interpreted():
    """The triton variants keep x's bfloat16 copy for the backward's GEMMs; dx and dW must still be
    written in the model's float32, not rounded to bfloat16 and converted by autograd after."""
    _run("float32_model_bf16_gradients")

def test_triton_backward_kernels_match_the_torch_formulas_interpreted():
    _run("backward_kernels")


def test_gemm_bn_training_without_running_statistics_interpreted():
    _run("bn_without_running_stats")


def test_gemm_bn_eval_after_training_reads_the_updated_statistics_interpreted():
    _run("eval_after_training")


def test_gemm_bn_training_in_one_row_tile_is_one_launch_and_passes_the_gate_interpreted():
    """Where one row tile holds the batch, the statistics, running statistics and output come
    from the GEMM's epilogue (``column_batchnorm``); the gate, gradients included, at batch 2, an
    odd batch, a full tile and one row past it (which takes the three-launch path)."""
    _run("one_tile_training")


def test_gemm_avgpool_backward_kernels_match_the_torch_formulas_interpreted():
    _run("avgpool_backward")


def test_x_tf32_parts_and_the_interpreters_tensor_core_truncation():
    _run("tf32_operands")


def test_the_float16_operands_scale_rows_exactly_interpreted():
    _run("fp16_operands")


def test_the_backwards_float16_gemms_and_column_parts_interpreted():
    _run("fp16_backward_gemms")


def test_x_rounded_in_the_main_loop_matches_the_rounding_pass_interpreted():
    _run("tf32_round_in_the_kernel")


def test_the_backwards_transpose_kernel_interpreted():
    _run("transpose")


def test_x_operand_passes_write_whole_row_tiles_and_change_no_product_interpreted():
    _run("whole_row_tiles")


def test_a_wrong_kernel_fails_the_interpreted_gate():
    _run("mutant_fails")


def test_the_accurate_exp_of_the_softmax_epilogues_interpreted():
    _run("exp_nonpositive")


def test_the_lse_mish_output_is_float32_accurate_where_softplus_underflows_interpreted():
    _run("lse_mish_output")


@pytest.mark.parametrize("config", ["persistent-pointers", "grid-tma"])
@pytest.mark.parametrize("problem", ["matmul_gelu_softmax", "matmul_clamp_lse_mish", "gemm_bn"])
def test_wide_rows_keep_the_precisions_accuracy_interpreted(problem, config):
    _run("wide_rows", problem, config)


def test_the_range_check_flags_wide_rows_by_effect_not_ordinary_ones_interpreted():
    _run("wide_rows_flags")


def test_the_exact_path_keeps_its_sums_rounding_error_interpreted():
    _run("exact_path_sum")


def test_the_split_paths_pass_the_gate_where_eagers_error_alone_is_a_lucky_floor_interpreted():
    _run("lucky_floor")


def test_wide_rows_keep_the_fp32_backwards_accuracy_interpreted():
    _run("wide_gradients")


def test_the_backwards_range_check_flags_by_effect_not_ordinary_inputs_interpreted():
    _run("wide_gradients_flags")


@pytest.mark.parametrize("config", ["persistent-pointers", "grid-tma"])
@pytest.mark.parametrize("problem", ["matmul_gelu_softmax", "matmul_clamp_lse_mish", "gemm_bn"])
def test_the_gates_wide_case_checks_the_fp32_backward_interpreted(problem, config):
    _run("wide_gate", problem, config)
