"""On the GPU: a bfloat16 model (``model.bfloat16()``, bfloat16 inputs) through the fused variants.

The triton variants of 22, 99 and gemm_bn and 51's ``single_pass`` take a bfloat16 model's x and
W as they are (no cast pass, no cached copy), compute every epilogue in float32 and write
bfloat16. Each is held to the gate at bf16 against the float64 reference (output, running
statistics, and gradients of x and every parameter), whose floor is the eager bfloat16 model,
at odd sizes and batch 1, and at a default shape, where the fused forward and backward are also
compared with the eager bfloat16 model's directly. The cublas_epilogue variants of gemm_bn, 22 and 99
serve a bfloat16 model, held to the eager bfloat16 model's own arithmetic in the forward and
gated with gradients as the triton variants are. The interpreted CPU checks
(tests/test_triton_interpreted.py, ``bf16_model``) cover the kernels' logic; these run them compiled.
"""

import copy

import pytest
import torch
from helpers import relative_error

from autofuse.core import registry
from autofuse.core.variant import EagerVariant
from autofuse.testing import assert_variant_conforms
from autofuse.tuning.gate import CheckCase, check_variant

PROBLEMS = ["matmul_gelu_softmax", "matmul_clamp_lse_mish", "gemm_bn"]
SIZES = ((1, 1000, 777), (37, 1004, 777), (1025, 1000, 1025))


def _configs(cls, shape) -> list[dict]:
    """The first bf16 configuration per (persistent, tma) choice at ``shape``."""
    seen, chosen = set(), []
    for params in cls.configs_for(shape, "cuda", "bf16"):
        if (params["persistent"], params["tma"]) not in seen:
            seen.add((params["persistent"], params["tma"]))
            chosen.append(params)
    return chosen


@pytest.mark.gpu
@pytest.mark.parametrize("problem", PROBLEMS)
def test_triton_serves_a_bfloat16_model_at_odd_sizes(problem):
    prob, cls = registry.get_problem(problem), registry.get_variant(problem, "triton")
    for sizes in SIZES:
        shape = dict(zip(prob.dims, sizes))
        for params in _configs(cls, shape):
            assert_variant_conforms(problem, "triton", device="cuda", precision="bf16", params=params,
                                    dtype=torch.bfloat16, shapes=[shape], seed=sizes[0])


def _grads(run, model, x, cotangent) -> dict:
    """The output and the gradients of the input and of every parameter, by name."""
    x = x.detach().clone().requires_grad_(True)
    out = run(model, x)
    out.backward(cotangent.to(out.dtype))
    return {"output": out.detach(), "input": x.grad, **{n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("problem,variant", [(p, "triton") for p in PROBLEMS]
                         + [pytest.param(p, "cublas_epilogue", marks=pytest.mark.nvcc)
                            for p in PROBLEMS])
def test_a_bfloat16_model_at_a_default_shape_is_as_close_to_float64_as_eager(problem, variant, mode):
    """The gate at a default shape, then the output and every gradient against the float64 model:
    within twice the bf16 tolerance or twice the eager bfloat16 model's own error."""
    prob, cls = registry.get_problem(problem), registry.get_variant(problem, variant)
    if mode == "eval" and not prob.mode_sensitive:
        pytest.skip("one mode only")
    shape = dict(prob.default_shapes[-1])
    variant = cls("bf16", **cls.configs_for(shape, "cuda", "bf16")[0])
    cases = [CheckCase(shape, "randn", 5, randomize=True)]
    result = check_variant(variant, prob, cases, "cuda", dtype=torch.bfloat16, mode=mode, autograd=True)
    assert result.ok, result.reason
    model = prob.build_model(shape).train(mode == "train").cuda().bfloat16()
    x = prob.make_input(shape, "randn", torch.Generator().manual_seed(1), device="cuda", dtype=torch.bfloat16)
    cotangent = torch.randn(variant(copy.deepcopy(model), x).shape, device="cuda")
    # Each against float64, the eager bfloat16 model's error beside it: a gradient that bfloat16
    # conditions badly may be far from eager's and still closer to the truth (H100: 22's input
    # gradient differed from eager's by 0.11 where the gate, against float64, passed).
    got = _grads(variant, copy.deepcopy(model), x, cotangent)
    eager = _grads(EagerVariant("bf16"), copy.deepcopy(model), x, cotangent)
    exact = _grads(lambda m, v: m(v), copy.deepcopy(model).double(), x.double(), cotangent.double())
    tol = prob.tolerance("bf16")
    for name, want in exact.items():
        if want is None or name in prob.invariant_parameters(mode):
            continue
        assert got[name] is not None and got[name].dtype == torch.bfloat16, name
        error, eager_error = relative_error(got[name], want), relative_error(eager[name], want)
        assert error <= max(2 * tol.rel_l2, 2 * eager_error), (name, error, eager_error)


@pytest.mark.gpu
@pytest.mark.nvcc
def test_single_pass_serves_a_bfloat16_model():
    """51's single_pass on bfloat16 rows: the conformance shapes and the default shape."""
    problem = "gemm_avgpool_gelu_residual"
    prob = registry.get_problem(problem)
    assert_variant_conforms(problem, "single_pass", device="cuda", precision="bf16", dtype=torch.bfloat16)
    assert_variant_conforms(problem, "single_pass", device="cuda", precision="bf16", dtype=torch.bfloat16,
                            shapes=[dict(prob.default_shapes[0])])


def _strip_and_two_kernel_configs(cls, shape) -> list[dict]:
    """The first strip configuration that holds the batch (if one does) and the first two-kernel one."""
    configs = cls.configs_for(shape, "cuda", "bf16")
    strips = [c for c in configs if c["strip_cols"] > 0]
    return strips[:1] + [c for c in configs if c["strip_cols"] == 0][:1]


@pytest.mark.gpu
@pytest.mark.nvcc
def test_cublas_epilogue_serves_a_bfloat16_models_forward_as_its_reference_computes():
    """gemm_bn's cublas_epilogue on a bfloat16 model: the gate at odd sizes on both paths, gradients
    included, then training without them against the eager
    bfloat16 model itself, whose arithmetic on the GPU is the one KernelBench's harness compares
    with, on its rand inputs with linear's bias lifted (a column's mean many times its spread, where
    BatchNorm's 1/σ scales any other rounding of y or y·s up): the output within 2·2⁻⁸·(|out| + 1)
    (one bfloat16 step at any |out|; KernelBench allows 2.56 of these units), the running statistics
    within one step of the model's."""
    problem = "gemm_bn"
    prob, cls = registry.get_problem(problem), registry.get_variant(problem, "cublas_epilogue")
    # 1000 columns: the two-kernel path's whole-line kernels (N % 8 == 0), a part-filled last strip.
    for sizes in ((2, 100, 77), (37, 1004, 777), (1025, 1000, 1025), (1025, 1000, 1000)):
        shape = dict(zip(prob.dims, sizes))
        for params in _strip_and_two_kernel_configs(cls, shape):
            assert_variant_conforms(problem, "cublas_epilogue", device="cuda", precision="bf16", params=params,
                                    dtype=torch.bfloat16, shapes=[shape])
    for sizes, lift in (((4096, 512, 1024), 4.0), ((1000, 300, 517), 0.0), ((37, 64, 96), 4.0)):
        shape = dict(zip(prob.dims, sizes))
        for params in _strip_and_two_kernel_configs(cls, shape):
            torch.manual_seed(sizes[0])
            model = prob.build_model(shape).train().cuda().bfloat16()
            with torch.no_grad():
                model.gemm.bias += lift
            reference = copy.deepcopy(model)
            x = torch.rand(sizes[0], sizes[1], device="cuda").bfloat16()
            with torch.no_grad():
                want, got = reference(x).float(), cls("bf16", **params)(model, x).float()
            steps = ((got - want).abs() / (want.abs() + 1)).max().item() * 2**8
            assert steps <= 2.0, (sizes, params, steps)
            for name in ("running_mean", "running_var"):
                ours, theirs = getattr(model.bn, name).float(), getattr(reference.bn, name).float()
                assert ((ours - theirs).abs() <= theirs.abs() * 2**-7).all(), (sizes, params, name)


@pytest.mark.gpu
@pytest.mark.nvcc
@pytest.mark.parametrize("problem", ["matmul_gelu_softmax", "matmul_clamp_lse_mish"])
def test_cublas_epilogue_serves_a_bfloat16_models_forward_as_its_reference_computes_rows(problem):
    """22's and 99's cublas_epilogue on a bfloat16 model: the gate at odd sizes and batch 1 for
    every row configuration kind, gradients included, then the output against the eager bfloat16
    model's on KernelBench's rand inputs and on randn: within one bfloat16 step,
    2⁻⁸·(|out| + 1) (KernelBench's tolerance is 2.56 of these), and equal to it bit for bit in all
    but a few elements (the row's float32 sum is added in another order, so its bfloat16 rounding
    may differ where it lies on a boundary). A kernel that rounds once, at the end, misses the
    second: 22's z from unrounded terms differed in 3 of 1024 rows by a step, 335 with z rounded
    once (see the triton variant's ``lse_mish_finish_bf16``)."""
    prob, cls = registry.get_problem(problem), registry.get_variant(problem, "cublas_epilogue")
    for sizes in ((1, 1000, 777), (37, 1004, 777), (1025, 1000, 1025)):
        shape = dict(zip(prob.dims, sizes))
        configs = cls.configs_for(shape, "cuda", "bf16")
        for params in configs[:1] + [c for c in configs if c.get("items") == 0][:1]:
            assert_variant_conforms(problem, "cublas_epilogue", device="cuda", precision="bf16", params=params,
                                    dtype=torch.bfloat16, shapes=[shape])
    for sizes in ((1024, 8192, 8192), (37, 1004, 777), (200, 1000, 1000)):  # 99's gelu table from 160 rows
        shape = dict(zip(prob.dims, sizes))
        for params in cls.configs_for(shape, "cuda", "bf16")[:2]:
            for dist in ("rand", "randn"):
                torch.manual_seed(sizes[0])
                model = prob.build_model(shape).cuda().bfloat16()
                x = getattr(torch, dist)(sizes[0], sizes[1], device="cuda").bfloat16()
                with torch.no_grad():
                    want, got = model(x).float(), cls("bf16", **params)(model, x).float()
                steps = ((got - want).abs() / (want.abs() + 1)).max().item() * 2**8
                differ = (got != want).sum().item()
                assert steps <= 1.0, (sizes, params, dist, steps)
                assert differ <= max(2, want.numel() // 1000), (sizes, params, dist, differ)


@pytest.mark.gpu
def test_a_bfloat16_models_linear_is_f_linear_on_any_strides_and_names_a_wrong_operand():
    """``bfloat16_model_linear`` launches the GEMM F.linear makes (addmm with the bias) on the
    operands as they are (a strided x included: the reference's own tensor, bit for bit); where
    the GEMM refuses (a device or a shape), the InputError names the operand, as the checks
    before the fast path did."""
    from autofuse.errors import InputError
    from autofuse.kernels.cuda_variant import bfloat16_model_linear, linear_parameters

    variant = registry.get_variant("matmul_gelu_softmax", "cublas_epilogue")("bf16")
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48).cuda().bfloat16().requires_grad_(False)
    x = torch.randn(74, 128, device="cuda").bfloat16()[::2, 3:67]  # 37 × 64, strides (256, 1)
    want = torch.nn.functional.linear(x, linear.weight, linear.bias)
    assert torch.equal(bfloat16_model_linear(variant, x, *linear_parameters(linear), "linear"), want)
    cases = [(x.float(), {}, "input: expected bfloat16, got float32"),
             (x[:, :63], {}, r"input: expected shape \(37, 64\), got \(37, 63\)"),
             (x, {"bias": torch.zeros(47, device="cuda", dtype=torch.bfloat16)},
              r"linear.bias: expected shape \(48,\), got \(47,\)"),
             (x, {"weight": linear.weight.cpu()}, "linear.weight: expected a tensor on cuda:0, got one on cpu")]
    for x_case, swapped, match in cases:
        wrong = copy.deepcopy(linear)
        for name, value in swapped.items():
            setattr(wrong, name, torch.nn.Parameter(value, requires_grad=False))
        with pytest.raises(InputError, match=match):
            bfloat16_model_linear(variant, x_case, *linear_parameters(wrong), "linear")


def _clamp_lse_mish_chain(y: torch.Tensor, s: float, lo: float, hi: float) -> torch.Tensor:
    """22's reference after its Linear, on y as it is: every step a bfloat16 tensor."""
    v = y * s
    v = torch.clamp(v + v, lo, hi)
    z = torch.logsumexp(v, dim=1, keepdim=True)
    return z * torch.nn.functional.mish(z)


@pytest.mark.gpu
@pytest.mark.nvcc
@pytest.mark.parametrize("block", [128, 256])
def test_clamp_lse_mish_bfloat16_rows_follow_the_reference_in_every_form(block):
    """22's bfloat16-model row kernel against the reference's own chain on the same y, in each of
    its forms: packed pairs with the row staged in shared memory (N = 8192, and 1000: a block
    with idle threads), packed and read twice (a row past 48 KB), the float form (a scale that is
    no bfloat16 value, or N not a multiple of 8). Rows hold a NaN, +inf, −inf, all −inf, values
    that overflow when doubled, or one value but their max (each rounding of a term then counts
    n − 1 times, see below), under the default clamp, an unbounded one, a zero scale (inf · 0 is
    NaN) and a negative one. Bit for bit but for a few rows whose float32 sum is added in another
    order."""
    cls = registry.get_variant("matmul_clamp_lse_mish", "cublas_epilogue")
    variant = cls("bf16", block=block)
    for n in (8192, 1000, 24584, 777):
        for s, lo, hi in ((2.0, -10.0, 10.0), (0.3, -10.0, 10.0), (1.0, float("-inf"), float("inf")),
                          (0.0, -10.0, 10.0), (-0.5, -3.0, 1e30)):
            torch.manual_seed(n)
            y = (torch.randn(64, n, device="cuda") * torch.logspace(-3, 3, 64, device="cuda")[:, None]).bfloat16()
            y[1, n // 3] = float("nan")
            y[2, n - 1] = float("inf")
            y[3, 0] = float("-inf")
            y[4] = float("-inf")
            y[5, ::7] = 3e38
            if s != 0:
                # Rows of one value but their max, v = 2·s·y about −8.6 and 0.1: n − 1 equal terms
                # exp(d), d = v − max not a bfloat16 value, their sum near 1.5 and z near 0.5,
                # where bfloat16 is fine. A kernel that skips rounding d or exp(d) errs the same
                # way n − 1 times: at n = 8192, 4 to 27 of these 32 rows differ under each scale
                # (a CPU emulation of the chain; on an H200 both such mutants fail this test).
                y[32:] = ((-8.6 + 0.5 * torch.rand(32, 1, device="cuda")) / (2 * s)).bfloat16()
                y[32:, n // 2] = ((0.04 + 0.16 * torch.rand(32, device="cuda")) / (2 * s)).bfloat16()
            want = _clamp_lse_mish_chain(y, s, lo, hi)
            got = torch.empty_like(want)
            variant.launch("af_clamp_lse_mish_rows_bf16", y, got, s, lo, hi, *y.shape, device=y.device)
            torch.cuda.synchronize()
            same = (got == want) | (got.isnan() & want.isnan())
            assert (got.isnan() == want.isnan()).all(), (n, s, lo, hi, got[:6].flatten(), want[:6].flatten())
            assert (~same).sum().item() <= 2, (n, s, lo, hi, (~same).nonzero()[:4].flatten().tolist())


@pytest.mark.gpu
@pytest.mark.nvcc
def test_the_gelu_tables_lookup_is_the_computed_value_for_every_bfloat16_input():
    """99's table of a bfloat16 model's gelu (bf16_table.cuh) against computing it, bit for bit,
    on all 65536 bfloat16 inputs: those in the table and those it leaves to compute (zeros,
    subnormals, large values, ±inf, NaN). The computed value is also torch's own bfloat16 gelu,
    within one bfloat16 step, so a table filled with the wrong function fails too. Two
    configurations, two libraries in one process: each fills its own table."""
    cls = registry.get_variant("matmul_gelu_softmax", "cublas_epilogue")
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32, device="cuda").to(torch.int16).view(torch.bfloat16)
    shape = dict(zip(registry.get_problem("matmul_gelu_softmax").dims, (1024, 8192, 8192)))
    for params in cls.configs_for(shape, "cuda", "bf16")[:2]:
        variant = cls("bf16", **params)
        by_table, computed = torch.empty_like(x), torch.empty_like(x)
        variant.launch("af_gelu_bf16", x, by_table, x.numel(), 1, device=x.device)
        variant.launch("af_gelu_bf16", x, computed, x.numel(), 0, device=x.device)
        torch.cuda.synchronize()
        differ = (by_table.view(torch.int16) != computed.view(torch.int16)).nonzero().flatten()
        assert differ.numel() == 0, (params, differ.numel(), x[differ[:4]].tolist(), by_table[differ[:4]].tolist())
    want = torch.nn.functional.gelu(x)
    nan, inf = want.isnan(), want.isinf()
    assert torch.equal(nan, computed.isnan()) and torch.equal(inf, computed.isinf())
    assert torch.equal(want[inf], computed[inf])
    finite = ~(nan | inf)
    err = (computed[finite].float() - want[finite].float()).abs() / (want[finite].float().abs() + 2**-120)
    assert err.max().item() <= 2**-8, err.max().item()
