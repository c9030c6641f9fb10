"""The correctness gate must reject each classic wrong answer (at fp32, on CPU).

Each wrong variant below is what a seed write-up got wrong; a gate that let any of them
through would be unable to fail. So must it reject the decoys of tests/plugins/decoy_variants.py,
right-looking answers no caller could drop in (float64, transposed storage, another device, a
cache, ...), each saying why. The right answers (eager, simplified) pass the same gate.
"""

import pytest
import torch
import torch.nn.functional as F
from helpers import use_test_plugins

import autofuse
from autofuse.core import plugins, registry
from autofuse.core.variant import Variant
from autofuse.tuning.gate import check_cases, check_variant
from autofuse.tuning.outcome import Outcome

SHAPE = {"batch_size": 64, "in_features": 256, "out_features": 192}


def gate(problem_name, variant_cls, mode="train", precision="fp32"):
    problem = registry.get_problem(problem_name)
    shape = problem.normalize_shape({problem.dims[i]: v for i, v in enumerate(SHAPE.values())})
    variant_cls.problem = problem.name
    return check_variant(variant_cls(precision), problem, check_cases(problem, shape, seed=321), "cpu", mode=mode)


class Wrong(Variant):
    name = "wrong"
    kind = "simplified"
    description = "a deliberately wrong answer"
    problem = "?"


class Zeros(Wrong):
    def forward(self, model, x):
        return registry.get_variant(self.problem, "eager")()(model, x) * 0


class ResidualOnly(Wrong):  # 51: "x unchanged"
    def forward(self, model, x):
        return x.clone()


class UniformSoftmax(Wrong):  # 99: every row 1/N
    def forward(self, model, x):
        n = model.linear.out_features
        return torch.full((x.shape[0], n), 1.0 / n, dtype=x.dtype)


class TanhGelu51(Wrong):
    def forward(self, model, x):
        z = (model.gemm(x) - model.subtract).mean(1, keepdim=True)
        return x + F.gelu(z, approximate="tanh")


class TanhGelu99(Wrong):
    def forward(self, model, x):
        return F.softmax(F.gelu(model.linear(x), approximate="tanh"), dim=1)


class SoftmaxNoMax(Wrong):
    def forward(self, model, x):
        e = F.gelu(model.linear(x)).exp()
        return e / e.sum(1, keepdim=True)


class LogSumExpNoMax22(Wrong):
    def forward(self, model, x):
        y = torch.clamp(model.matmul(x) * (2 * model.scale_factor), model.clamp_min, model.clamp_max)
        z = y.exp().sum(1, keepdim=True).log()
        return z * F.mish(z)


class LogSumExpNoMax51(Wrong):
    def forward(self, model, x):
        z = (model.gemm(x) - model.subtract).mean(1, keepdim=True)
        return x + F.gelu(z.exp().log())


class BatchNormWithoutRunningStats(Wrong):
    def forward(self, model, x):
        y = model.gemm(x) * model.scale
        bn = model.bn
        return F.batch_norm(y, None, None, bn.weight, bn.bias, training=True, eps=bn.eps)


class StaleFold(Wrong):
    """Folds the eval-mode weights once and never again: wrong after an optimizer step."""

    def __init__(self, precision="fp32", **params):
        super().__init__(precision, **params)
        self.folded = None

    def forward(self, model, x):
        gemm, bn = model.gemm, model.bn
        if self.folded is None:
            k = bn.weight / torch.sqrt(bn.running_var + bn.eps)
            self.folded = (gemm.weight * (model.scale * k)[:, None], (gemm.bias * model.scale - bn.running_mean) * k + bn.bias)
        return F.linear(x, *self.folded)


def _fp16_split(t: torch.Tensor):
    """Float16 hi and lo of each row scaled by a power of two, as triton's split_fp16 makes them
    (``fp16_row_parts``), in float64 with the row scales: no range check."""
    biased = (t.abs().amax(dim=1).view(torch.int32) >> 23) & 0xFF
    scale = torch.pow(2.0, (14 - (biased - 127)).clamp(-126, 126).double())[:, None]
    v = t.double() * scale
    hi = v.half().double()
    return hi, (v - hi).half().double(), scale


class SplitFp16WithoutRangeCheck(Wrong):  # 99 on split float16 parts: float32-accurate but for wide rows
    def forward(self, model, x):
        (xh, xl, xs), (wh, wl, ws) = _fp16_split(x), _fp16_split(model.linear.weight.detach())
        y = (xh @ wh.T + xh @ wl.T + xl @ wh.T) / (xs * ws.T) + model.linear.bias.double()
        return F.softmax(F.gelu(y.float()), dim=1)


def _split_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a·bᵀ for K-major a and b on their rows' float16 splits (``_fp16_split``), no range check."""
    (ah, al, a_scale), (bh, bl, b_scale) = _fp16_split(a.contiguous()), _fp16_split(b.contiguous())
    return ((ah @ bh.T + ah @ bl.T + al @ bh.T) / (a_scale * b_scale.T)).float()


class _LinearSplitBackward(torch.autograd.Function):
    """F.linear, whose backward multiplies as triton's fp32 backward does (``Fp16Gemms``: dy's rows
    and the columns of W, dy and x split into float16 parts) but with no range check."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        return _split_matmul(dy, weight.t()), _split_matmul(dy.t(), x.t()), dy.sum(0)


class SplitBackwardWithoutRangeCheck(Wrong):  # 99 and 39 with an exact forward: float32-accurate but for wide columns
    supports_autograd = True

    def forward(self, model, x):
        if self.problem == "gemm_bn":
            return model.bn(_LinearSplitBackward.apply(x, model.gemm.weight, model.gemm.bias) * model.scale)
        return F.softmax(F.gelu(_LinearSplitBackward.apply(x, model.linear.weight, model.linear.bias)), dim=1)


WRONG = [
    ("gemm_bn", Zeros, "train"),
    ("gemm_avgpool_gelu_residual", Zeros, "train"),
    ("matmul_gelu_softmax", Zeros, "train"),
    ("matmul_clamp_lse_mish", Zeros, "train"),
    ("gemm_avgpool_gelu_residual", ResidualOnly, "train"),
    ("matmul_gelu_softmax", UniformSoftmax, "train"),
    ("gemm_avgpool_gelu_residual", TanhGelu51, "train"),
    ("matmul_gelu_softmax", TanhGelu99, "train"),
    ("matmul_gelu_softmax", SoftmaxNoMax, "train"),
    ("matmul_clamp_lse_mish", LogSumExpNoMax22, "train"),
    ("gemm_avgpool_gelu_residual", LogSumExpNoMax51, "train"),
    ("gemm_bn", BatchNormWithoutRunningStats, "train"),
    ("gemm_bn", StaleFold, "eval"),
    ("matmul_gelu_softmax", SplitFp16WithoutRangeCheck, "train"),
]


@pytest.mark.parametrize("problem,wrong,mode", WRONG, ids=[f"{p}-{w.__name__}" for p, w, _ in WRONG])
def test_gate_rejects(problem, wrong, mode):
    result = gate(problem, wrong, mode)
    assert not result.ok, f"{wrong.__name__} passed the gate for {problem} (error {result.error:.3g})"
    print(result.reason)


def test_only_the_wide_rows_catch_a_split_without_a_range_check():
    """The float16 split passes every other case at fp32: the wide family is what rejects it."""
    problem = registry.get_problem("matmul_gelu_softmax")
    shape = problem.normalize_shape({problem.dims[i]: v for i, v in enumerate(SHAPE.values())})
    SplitFp16WithoutRangeCheck.problem = problem.name
    cases = check_cases(problem, shape, seed=321)
    others = [c for c in cases if c.distribution != "wide"]
    assert len(others) < len(cases), "the gate has no wide-row case"
    result = check_variant(SplitFp16WithoutRangeCheck("fp32"), problem, others, "cpu")
    assert result.ok, result.reason
    result = check_variant(SplitFp16WithoutRangeCheck("fp32"), problem, cases, "cpu")
    assert not result.ok and " wide " in result.reason, result.reason


@pytest.mark.parametrize("problem,mode", [("matmul_gelu_softmax", "train"), ("gemm_bn", "eval"), ("gemm_bn", "train")])
def test_the_wide_rows_catch_a_backward_split_without_a_range_check(problem, mode):
    """The same for the gradients: a forward that is exact and a backward on float16 splits of dy's
    rows and of the columns of W, dy and x passes every case but the wide one, whose outliers sit
    in every other row of x and of W and whose cotangent is zero where they would carry the
    gradient (``Problem.quiet_wide_cotangent``)."""
    prob = registry.get_problem(problem)
    shape = prob.normalize_shape({prob.dims[i]: v for i, v in enumerate(SHAPE.values())})
    SplitBackwardWithoutRangeCheck.problem = prob.name
    cases = check_cases(prob, shape, seed=321)
    others = [c for c in cases if c.distribution != "wide"]
    result = check_variant(SplitBackwardWithoutRangeCheck("fp32"), prob, others, "cpu", mode=mode, autograd=True)
    assert result.ok, result.reason
    result = check_variant(SplitBackwardWithoutRangeCheck("fp32"), prob, cases, "cpu", mode=mode, autograd=True)
    assert not result.ok and " wide " in result.reason and "gradient of" in result.reason, result.reason
    print(result.reason)


@pytest.mark.parametrize("problem", ["gemm_bn", "gemm_avgpool_gelu_residual", "matmul_gelu_softmax", "matmul_clamp_lse_mish"])
@pytest.mark.parametrize("name", ["eager", "simplified"])
def test_right_answers_pass_the_same_gate(problem, name):
    modes = ("train", "eval") if registry.get_problem(problem).mode_sensitive else ("train",)
    for mode in modes:
        variant = registry.get_variant(problem, name)
        result = check_variant(variant("fp32"), registry.get_problem(problem),
                               check_cases(registry.get_problem(problem), _shape(problem), 321), "cpu", mode=mode)
        assert result.ok, result.reason


def _shape(problem):
    p = registry.get_problem(problem)
    return p.normalize_shape(dict(zip(p.dims, SHAPE.values())))


# Each decoy of tests/plugins/decoy_variants.py, with what the gate's reason must say.
DECOYS = [
    ("matmul_gelu_softmax", "float64_output", "the output's dtype must be the reference's float32, got float64"),
    ("matmul_gelu_softmax", "transposed_output", "the output must be contiguous as the reference's is"),
    ("matmul_gelu_softmax", "meta_output", "the output's device must be the reference's cpu, got meta"),
    ("matmul_gelu_softmax", "nonnegative_only", "relative L2 error"),
    ("matmul_gelu_softmax", "cached_by_shape", "outputs alias"),
    ("matmul_gelu_softmax", "cached_by_data_ptr", "outputs alias"),
    ("matmul_gelu_softmax", "mutates_input", "the input was modified"),
    ("matmul_gelu_softmax", "noisy", "relative L2 error"),
    ("matmul_gelu_softmax", "wrong_one_call_in_four", "relative L2 error"),
    ("matmul_gelu_softmax", "weights_snapshotted", "relative L2 error"),
    ("matmul_clamp_lse_mish", "flat_output", "the output's shape must be the reference's"),
]
# (batch, in, out) tuned: a moderate one, batch 1 (a transposed (1, N) is contiguous), an odd one.
DECOY_SIZES = [(64, 256, 192), (1, 37, 53), (5, 33, 7)]


@pytest.fixture
def decoys(monkeypatch):
    use_test_plugins(monkeypatch, "decoy_variants")
    yield
    monkeypatch.delenv("AUTOFUSE_PLUGINS")
    plugins.reset_plugin_manager()


@pytest.mark.parametrize("sizes", DECOY_SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("problem,name,says", DECOYS, ids=[name for _, name, _ in DECOYS])
def test_gate_rejects_the_decoys_saying_why(decoys, problem, name, says, sizes):
    prob = registry.get_problem(problem)
    cases = check_cases(prob, dict(zip(prob.dims, sizes)), seed=321)
    result = check_variant(registry.get_variant(problem, name)("fp32"), prob, cases, "cpu")
    assert not result.ok, f"{name} passed the gate for {problem} at {sizes} (error {result.error:.3g})"
    assert says in result.reason, f"{name}: the reason should say {says!r}, got {result.reason!r}"


def test_gate_rejects_a_parameter_without_a_gradient_where_pytorch_gives_one(decoys):
    """An optimizer skips a parameter whose .grad is None (weight decay included): a variant that
    leaves one None where PyTorch gives a tensor trains differently, even where the values are ~0."""
    prob = registry.get_problem("matmul_gelu_softmax")
    cases = check_cases(prob, _shape("matmul_gelu_softmax"), seed=321)
    result = check_variant(registry.get_variant("matmul_gelu_softmax", "drops_bias_gradient")("fp32"), prob, cases,
                           "cpu", autograd=True)
    assert not result.ok and "gradient of linear.bias is None where PyTorch's is a tensor" in result.reason, result.reason


def test_a_tune_records_the_contract_decoys_as_incorrect_and_eager_wins(decoys, tmp_path):
    """The issue's two: right values as float64, and in transposed storage, had passed ("ok")."""
    names = ["eager", "float64_output", "transposed_output"]
    [result] = autofuse.tune("matmul_gelu_softmax", {"batch_size": 16, "in_features": 48, "out_features": 40},
                             device="cpu", table=tmp_path / "t.json", seed=3, variants=names, trial_timeout=120,
                             autograd_entry=False, progress=False, budget="full")  # every decoy meets the gate
    rows = {row.variant: row.result for row in result.rows}
    assert {name: rows[name].outcome for name in names} == {
        "eager": Outcome.OK, "float64_output": Outcome.INCORRECT, "transposed_output": Outcome.INCORRECT}
    assert "dtype must be the reference's float32, got float64" in rows["float64_output"].reason
    assert "must be contiguous" in rows["transposed_output"].reason
    assert result.winner["variant"] == "eager"


@pytest.mark.parametrize("problem", ["gemm_bn", "gemm_avgpool_gelu_residual", "matmul_gelu_softmax", "matmul_clamp_lse_mish"])
@pytest.mark.parametrize("name", ["eager", "simplified"])
def test_right_answers_in_bfloat16_return_bfloat16(problem, name):
    """A bfloat16 model's output is bfloat16, and the right answers keep that contract."""
    prob = registry.get_problem(problem)
    cases = check_cases(prob, _shape(problem), 321)
    result = check_variant(registry.get_variant(problem, name)("bf16"), prob, cases, "cpu", dtype=torch.bfloat16)
    assert result.ok, result.reason


def test_the_plugin_conformance_kit_catches_a_split_without_a_range_check():
    """``autofuse.testing``'s cases hold the wide rows too: a plugin's emulated float32 that cannot
    carry them fails its own conformance tests, not first the tuner's gate."""
    from autofuse.testing import conformance_cases

    SplitFp16WithoutRangeCheck.problem = "matmul_gelu_softmax"
    cases = conformance_cases("matmul_gelu_softmax", seed=5)
    result = check_variant(SplitFp16WithoutRangeCheck("fp32"), registry.get_problem("matmul_gelu_softmax"), cases, "cpu")
    assert not result.ok and " wide " in result.reason, result.reason


class RunningVarOff(Wrong):  # gemm_bn: right output, running variance updated 25% too high
    def forward(self, model, x):
        out = registry.get_variant(self.problem, "eager")(self.precision)(model, x)
        with torch.no_grad():
            model.bn.running_var.mul_(1.25)
        return out


def test_running_statistics_are_held_to_the_floor_as_outputs_are():
    """A bfloat16 model's own arithmetic puts its running variance ~13% from float64 at batch 2 on
    large inputs (the variance of two close values, each rounded to bfloat16): eager itself failed
    the fixed tolerance there. Running statistics now get the outputs' bound, FLOOR_FACTOR times
    plain PyTorch's error at the precision, so eager passes, and a wrong update still fails."""
    from autofuse.testing import conformance_cases

    prob = registry.get_problem("gemm_bn")
    shape = dict(zip(prob.dims, (2, 100, 77)))
    for seed in range(3):
        cases = conformance_cases("gemm_bn", seed, (shape,))
        result = check_variant(registry.get_variant("gemm_bn", "eager")("bf16"), prob, cases, "cpu",
                               dtype=torch.bfloat16)
        assert result.ok, result.reason
    RunningVarOff.problem = "gemm_bn"
    for dtype, precision in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        cases = check_cases(prob, dict(zip(prob.dims, (64, 256, 192))), 321)
        result = check_variant(RunningVarOff(precision), prob, cases, "cpu", dtype=dtype)
        assert not result.ok and "bn.running_var (running statistic) wrong" in result.reason, (dtype, result.reason)


class OffOnlyWithGradients(Wrong):
    """Right with no gradient, 5% high with one, its gradients PyTorch's: a detached term moves the
    output and not the graph (a path that saves for the backward is other code)."""

    def forward(self, model, x):
        out = registry.get_variant(self.problem, "eager")()(model, x)
        return out + 0.05 * out.detach() if torch.is_grad_enabled() else out


def test_gate_checks_the_output_an_autograd_entry_serves_not_only_its_gradients():
    OffOnlyWithGradients.problem = "matmul_gelu_softmax"
    prob = registry.get_problem("matmul_gelu_softmax")
    cases = check_cases(prob, _shape("matmul_gelu_softmax"), seed=321)
    assert check_variant(OffOnlyWithGradients("fp32"), prob, cases, "cpu").ok  # the no-grad path is right
    result = check_variant(OffOnlyWithGradients("fp32"), prob, cases, "cpu", autograd=True)
    assert not result.ok and result.reason.startswith("output with gradients on:"), result.reason


class GradModeSpy(Wrong):
    """Eager, noting whether each call ran with gradients on."""

    modes: list = []

    def forward(self, model, x):
        GradModeSpy.modes.append(torch.is_grad_enabled())
        return registry.get_variant(self.problem, "eager")()(model, x)


class ScalesItsWeightWithGradients(Wrong):
    """Right, but with gradients on it scales the GEMM's weight in place after its call: a side
    effect its no-grad path has not."""

    def forward(self, model, x):
        out = registry.get_variant(self.problem, "eager")()(model, x)
        if torch.is_grad_enabled():
            with torch.no_grad():
                model.linear.weight.mul_(1.5)
        return out


def test_the_autograd_gate_runs_every_call_with_gradients_and_checks_there_what_the_no_grad_gate_does():
    """An autograd entry serves grad-mode calls alone (those no backward follows switch to the
    inference entry), so its gate runs every call with gradients on and holds it to what the
    no-grad gate checks: the output, what a call must leave alone, a second call, one after an
    update."""
    prob = registry.get_problem("matmul_gelu_softmax")
    cases = check_cases(prob, _shape("matmul_gelu_softmax"), seed=321)
    GradModeSpy.problem = ScalesItsWeightWithGradients.problem = prob.name
    GradModeSpy.modes = []
    assert check_variant(GradModeSpy("fp32"), prob, cases, "cpu", autograd=True).ok
    assert len(GradModeSpy.modes) > len(cases) and all(GradModeSpy.modes), GradModeSpy.modes
    assert check_variant(ScalesItsWeightWithGradients("fp32"), prob, cases, "cpu").ok
    result = check_variant(ScalesItsWeightWithGradients("fp32"), prob, cases, "cpu", autograd=True)
    assert not result.ok and result.reason.startswith("with gradients on: parameter linear.weight was modified"), result.reason
