"""The gradient check leaves out rows whose gradient jumps within rounding (a logit at a clamp bound).

matmul_clamp_lse_mish clamps its logits at ±10, where the derivative drops from 1 to 0. A logit
planted 2e-5 under the bound (20 float32 ulps: eager float32 keeps it inside) and a variant that
counts it as over the bound (an accurate forward that rounded to the other side) disagree on that
row's gradient by whole percent. The check must accept that variant, and only because of
``rows_on_a_kink``: without the hook it fails, and a variant wrong on another row still fails.
"""

import torch
import torch.nn.functional as F

from autofuse.core import registry
from autofuse.core.variant import Variant
from autofuse.tuning.gate import CheckCase, PreparedCase, build_case, check_gradients, floor_output

PROBLEM = registry.get_problem("matmul_clamp_lse_mish")
SHAPE = {"batch_size": 6, "input_size": 32, "hidden_size": 24}
ROW = 2
GAP = 2e-5  # how far under the bound the planted logit sits


class OverTheBound(Variant):
    """The reference in float32, but logits within ``WINDOW`` under the upper bound count as over
    it (clamped, so no gradient): the planted one is, as an accurate forward rounding up would have it."""

    name = "over_the_bound"
    kind = "simplified"
    description = "logits 5e-5 under the clamp bound treated as over it"
    problem = PROBLEM.name
    WINDOW = 5e-5
    scale_row = None  # (row, factor): a row's gradient off by factor, its output right: other rows still count

    def forward(self, model, x):
        logits = model.matmul(x) * (2 * model.scale_factor)
        hi = model.clamp_max
        over = (logits > hi - self.WINDOW) & (logits <= hi)
        clamped = torch.where(over, torch.full_like(logits, hi), logits.clamp(model.clamp_min, hi))
        z = torch.logsumexp(clamped, 1, keepdim=True)
        out = z * F.mish(z)
        if self.scale_row is not None:
            row, factor = self.scale_row
            scaled = out * torch.where(torch.arange(out.shape[0]) == row, factor, 1.0).unsqueeze(1)
            out = scaled + (out - scaled).detach()  # the output's values, the scaled row's gradient
        return out


def planted_case() -> PreparedCase:
    """A randomized case with row ``ROW``'s largest logit moved to ``GAP`` under the upper bound."""
    case = CheckCase(SHAPE, "randn", 11, randomize=True)
    model, x = build_case(PROBLEM, case, "cpu", torch.float32, "train")
    linear = model.matmul
    with torch.no_grad():
        logits = F.linear(x.double(), linear.weight.double(), linear.bias.double())
        col = int(logits[ROW].argmax())
        target = (model.clamp_max - GAP) / (2 * model.scale_factor)
        linear.bias[col] = target - (x[ROW].double() @ linear.weight[col].double()).item()
    ref, ref_model = PROBLEM.reference(model, x)
    return PreparedCase(case, model, x, ref, ref_model, floor_output(model, x, "fp32"))


def test_the_planted_row_is_on_a_kink_at_fp32_only():
    prepared = planted_case()
    kinked = PROBLEM.rows_on_a_kink(prepared.model, prepared.x, "fp32")
    assert kinked.tolist() == [row == ROW for row in range(SHAPE["batch_size"])]
    assert PROBLEM.rows_on_a_kink(prepared.model, prepared.x, "ieee").tolist() == kinked.tolist()
    assert PROBLEM.rows_on_a_kink(prepared.model, prepared.x, "tf32") is None


def test_a_forward_on_the_other_side_of_a_kink_passes_and_fails_without_the_hook(monkeypatch):
    prepared = planted_case()
    _, reason = check_gradients(OverTheBound("fp32"), PROBLEM, prepared, "train")
    assert reason is None

    monkeypatch.setattr(type(PROBLEM), "rows_on_a_kink", lambda self, model, x, precision: None)
    prepared = planted_case()  # a new case: one keeps the cotangent it was first checked with
    _, reason = check_gradients(OverTheBound("fp32"), PROBLEM, prepared, "train")
    assert reason is not None and reason.startswith("gradient of input")


def test_a_wrong_gradient_on_another_row_still_fails():
    prepared = planted_case()
    wrong = OverTheBound("fp32")
    wrong.scale_row = (ROW + 1, 1.001)
    _, reason = check_gradients(wrong, PROBLEM, prepared, "train")
    assert reason is not None and reason.startswith("gradient of")


def test_a_logit_whose_huge_terms_cancel_is_on_a_kink_at_fp32():
    """A row whose logits rest on huge terms that cancel is on a kink whatever their values: float32
    rounds those terms to more than the distance to a bound, so any float32 GEMM may put a logit on
    either side (x rows 1e12 wide, H100: cuBLAS fp32 put one on the wrong side; at 1e30, the right
    one). Row ``ROW`` gets two entries 1e12 whose columns of W cancel: its logits keep their values,
    and only this row joins the rows on a kink."""
    case = CheckCase(SHAPE, "randn", 11, randomize=True)
    model, x = build_case(PROBLEM, case, "cpu", torch.float32, "train")
    with torch.no_grad():
        model.matmul.weight[:, 1] = -model.matmul.weight[:, 0]
        x[ROW, 1] = x[ROW, 0]  # so its two entries add nothing, now and at 1e12
        before = PROBLEM.rows_on_a_kink(model, x, "fp32")
        logits = F.linear(x.double(), model.matmul.weight.double(), model.matmul.bias.double())
        x[ROW, :2] = 1e12
        after = PROBLEM.rows_on_a_kink(model, x, "fp32")
        moved = F.linear(x.double(), model.matmul.weight.double(), model.matmul.bias.double()) - logits
    assert moved.abs().max() < 1e-3  # the huge terms cancel (float64 rounds 1e12 to ~1e-4)
    assert not before[ROW]
    assert after.tolist() == [row == ROW or bool(before[row]) for row in range(SHAPE["batch_size"])]
