"""The correctness gate must reject each classic wrong answer (at fp32, on CPU).

Each wrong variant below is what a seed write-up got wrong; a gate that let any of them
through would be unable to fail. The right answers (eager, simplified) pass the same gate.
"""

import torch
import torch.nn.functional as F
import pytest

from autofuse import registry
from autofuse.variant import FoldCache, Variant
from autofuse.verify import check_cases, check_variant

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
]


@pytest.mark.parametrize("problem,wrong,mode", WRONG, ids=[f"{p}-{w.__name__}" for p, w, _ in WRONG])
def test_gate_rejects(problem, wrong, mode):
    result = gate(problem, wrong, mode)
    assert not result.ok, f"{wrong.__name__} passed the gate for {problem} (error {result.error:.3g})"
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
