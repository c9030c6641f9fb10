"""What the gate builds once and reuses must be what it would build again.

A batch class's cases differ from the tuned shape's in the batch alone, so ``build_case`` keeps
the models it drew (``gate._MODELS``) and the gradient check keeps each case's float64 and floor
gradients (``PreparedCase.gradients``). Reused, each must equal a fresh build bit for bit, and a
wrong candidate checked after a right one on the same cache must still fail.
"""

import pytest
import torch
from test_gate_catches_wrong_answers import SplitBackwardWithoutRangeCheck

from autofuse.core import registry
from autofuse.tuning import gate
from autofuse.tuning.gate import CheckCase, build_case, check_cases, check_variant


def fresh(problem, case, mode):
    """``build_case`` with nothing kept from earlier cases."""
    gate._MODELS.clear()
    built = build_case(problem, case, "cpu", torch.float32, mode)
    return built, torch.get_rng_state()


@pytest.mark.parametrize("distribution,randomize", [("rand", False), ("randn", True), ("large", True), ("wide", True)])
@pytest.mark.parametrize("problem_name,mode", [("gemm_bn", "train"), ("matmul_gelu_softmax", "any")])
def test_a_batch_class_gets_the_case_a_fresh_build_would(problem_name, mode, distribution, randomize):
    problem = registry.get_problem(problem_name)
    tuned = {"batch_size": 64, "in_features": 48, "out_features": 40}
    rung = {**tuned, "batch_size": 9}
    build_case(problem, CheckCase(tuned, distribution, 11, randomize), "cpu", torch.float32, mode)  # kept
    kept_model, kept_x = build_case(problem, CheckCase(rung, distribution, 11, randomize), "cpu", torch.float32, mode)
    kept_rng = torch.get_rng_state()
    (model, x), rng = fresh(problem, CheckCase(rung, distribution, 11, randomize), mode)
    assert torch.equal(kept_x, x)
    assert kept_model.training == model.training
    for (name, a), (_, b) in zip(kept_model.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(kept_rng, rng)  # what draws from the global generator next sees the same state


@pytest.mark.parametrize("problem_name,mode", [("gemm_bn", "train"), ("matmul_gelu_softmax", "any"),
                                               ("gemm_avgpool_gelu_residual", "any")])
def test_a_case_drawn_ahead_on_a_thread_is_the_one_a_fresh_build_draws(problem_name, mode):
    """The worker draws a job's randomized cases while its first candidate compiles
    (``gate.draw_ahead``); the gate then gets the same model, input and generator state, and
    whatever drew from the global generator meanwhile is not disturbed."""
    problem = registry.get_problem(problem_name)
    cases = check_cases(problem, {"batch_size": 64, "in_features": 48, "out_features": 40}, 21)
    gate._MODELS.clear()
    gate.draw_ahead(problem, [CheckCase({"batch_size": 3, "in_features": 5, "out_features": 4}, "randn", 1, True)],
                    "cpu", torch.float32, mode)  # an earlier job's draw, never gated: dropped below
    torch.manual_seed(5)
    before = torch.get_rng_state()
    gate.draw_ahead(problem, cases, "cpu", torch.float32, mode)
    assert torch.equal(torch.get_rng_state(), before)
    assert len(gate._DRAWING) == sum(c.randomize for c in cases)
    ahead = []
    for case in cases:
        ahead.append((build_case(problem, case, "cpu", torch.float32, mode), torch.get_rng_state()))
    assert not gate._DRAWING and not gate._INPUTS  # each taken by the build that needed it
    # A batch class's cases: every model is kept, and every input is drawn ahead.
    rungs = [CheckCase({**c.shape, "batch_size": 9}, c.distribution, c.seed, c.randomize) if c.shape == cases[0].shape
             else c for c in cases]
    before = torch.get_rng_state()
    gate.draw_ahead(problem, rungs, "cpu", torch.float32, mode)
    assert torch.equal(torch.get_rng_state(), before) and not gate._DRAWING and len(gate._INPUTS) == len(rungs)
    ahead += [(build_case(problem, case, "cpu", torch.float32, mode), torch.get_rng_state()) for case in rungs]
    assert not gate._INPUTS
    # Inputs a job drew and never used are dropped when the next job draws its own.
    gate.draw_ahead(problem, rungs, "cpu", torch.float32, mode)
    gate.draw_ahead(problem, cases, "cpu", torch.float32, mode)
    assert {k[1] for k in gate._INPUTS} == {tuple(sorted(c.shape.items())) for c in cases}
    gate._INPUTS.clear()
    for case, ((model, x), rng) in zip(cases + rungs, ahead):
        (want, want_x), want_rng = fresh(problem, case, mode)
        assert torch.equal(x, want_x) and torch.equal(rng, want_rng) and model.training == want.training
        for (name, a), (_, b) in zip(model.state_dict().items(), want.state_dict().items(), strict=True):
            assert torch.equal(a, b), (case.describe(), name)


def test_a_kept_model_is_a_copy():
    """A caller may train the model it gets (BatchNorm's running statistics move): the next case
    must still start from the drawn one."""
    problem = registry.get_problem("gemm_bn")
    case = CheckCase({"batch_size": 16, "in_features": 24, "out_features": 20}, "randn", 3, True)
    model, x = build_case(problem, case, "cpu", torch.float32, "train")
    with torch.no_grad():
        model.gemm.weight.add_(1.0)
        model(x)
    again, _ = build_case(problem, case, "cpu", torch.float32, "train")
    (drawn, _), _ = fresh(problem, case, "train")
    for (name, a), (_, b) in zip(again.state_dict().items(), drawn.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_gradients_kept_from_a_right_candidate_still_fail_a_wrong_one(monkeypatch):
    """The float64 and floor gradients are computed once per case; the decoy checked after eager
    on the same cache is judged against them and fails on the wide case, as on its own."""
    problem = registry.get_problem("matmul_gelu_softmax")
    shape = {"batch_size": 64, "in_features": 256, "out_features": 192}
    cases = check_cases(problem, shape, seed=321)
    calls = []
    reference_model = type(problem).reference_model
    monkeypatch.setattr(type(problem), "reference_model", lambda self, model: calls.append(1) or reference_model(self, model))
    cache = {}
    eager = registry.get_variant(problem.name, "eager")("fp32")
    assert check_variant(eager, problem, cases, "cpu", mode="any", autograd=True, cache=cache).ok
    first = len(calls)
    assert check_variant(eager, problem, cases, "cpu", mode="any", autograd=True, cache=cache).ok
    # The second candidate computes one float64 model: the after-update check's, whose weights it moved.
    assert len(calls) - first == 1 and first > len(cases) + 1
    SplitBackwardWithoutRangeCheck.problem = problem.name
    result = check_variant(SplitBackwardWithoutRangeCheck("fp32"), problem, cases, "cpu", mode="any", autograd=True,
                           cache=cache)
    assert not result.ok and " wide " in result.reason and "gradient of" in result.reason, result.reason


@pytest.mark.parametrize("problem_name,mode", [("gemm_bn", "train"), ("matmul_gelu_softmax", "any")])
def test_the_gradient_checks_cotangents_drawn_ahead_are_the_ones_drawn_in_place(problem_name, mode, monkeypatch):
    """The gate draws the cotangents of every case of the tuned shape in parallel once the first
    case is prepared (gemm_bn at 32768 rows: 5-6 s a case one after another); each case gets the
    cotangent it would draw itself, and none is left drawn and unused."""
    problem = registry.get_problem(problem_name)
    cases = check_cases(problem, {"batch_size": 64, "in_features": 48, "out_features": 40}, 13)
    eager = registry.get_variant(problem.name, "eager")("fp32")
    used = []
    cotangent = gate._cotangent
    monkeypatch.setattr(gate, "_cotangent", lambda problem, prepared, precision: used.append(
        (prepared, gate._COTANGENTS.get((prepared.case.seed + 7, tuple(prepared.ref.shape))))) or cotangent(
        problem, prepared, precision))
    assert check_variant(eager, problem, cases, "cpu", mode=mode, autograd=True, cache={}).ok
    assert not gate._COTANGENTS
    ahead = [prepared for prepared, drawn in used if drawn is not None]
    assert len(ahead) == sum(c.shape == cases[0].shape and problem.gradient_check_applies(c, mode, "fp32")
                             for c in cases) > 1
    for prepared in ahead:  # drawn in place, as without the threads
        held = prepared.gradients[("fp32", mode)][0]
        assert torch.equal(held, cotangent(problem, prepared, "fp32")), prepared.case.describe()


def test_a_case_whose_kept_model_holds_nan_is_named_broken_not_the_candidate():
    """An H200 tune of 22 (bfloat16 model) failed every candidate at 8 to 2048 rows, eager among
    them, with 'parameter matmul.bias was modified' on one case: a NaN never equals its own clone.
    The gate now says the case is broken, which no candidate can cause by being wrong."""
    problem = registry.get_problem("matmul_gelu_softmax")
    tuned = {"batch_size": 16, "in_features": 48, "out_features": 40}
    case = CheckCase({**tuned, "batch_size": 9}, "randn", 11, True)
    gate._MODELS.clear()
    build_case(problem, CheckCase(tuned, "randn", 11, True), "cpu", torch.float32, "any")  # kept
    [(pristine, *_)] = gate._MODELS.values()
    with torch.no_grad():
        pristine.linear.bias[3] = float("nan")  # what overwriting the kept model's memory would leave
    eager = registry.get_variant("matmul_gelu_softmax", "eager")("fp32")
    result = check_variant(eager, problem, [case], "cpu", mode="any")
    gate._MODELS.clear()
    assert not result.ok and "parameter linear.bias held NaN before the call" in result.reason, result.reason


@pytest.fixture
def evaluated_once():
    """(evaluate, a small job, the worker's state) after eager's evaluation: the cases' models
    drawn and kept, the cases prepared. Kept models are forgotten at both ends."""
    from autofuse.tuning import evaluate
    from autofuse.tuning.outcome import Candidate, Job, Outcome

    gate._MODELS.clear()
    job = Job("matmul_gelu_softmax", {"batch_size": 16, "in_features": 48, "out_features": 40}, "cpu", "float32",
              "fp32", "any", 0)
    state = {}
    assert evaluate.evaluate(state, job, Candidate("eager", {})).outcome is Outcome.OK
    yield evaluate, job, state
    gate._MODELS.clear()


def _kept(distribution, in_features=48):
    [pristine] = [held[0] for key, held in gate._MODELS.items() if key[4] == distribution and key[2][0] == in_features]
    return pristine


def test_a_candidate_that_writes_into_the_kept_models_is_recorded_and_the_next_gets_them_drawn_again(
        evaluated_once, monkeypatch):
    """On an H200, a CUDA graph re-pointed past its output wrote over three kept models, and
    every candidate after it failed the gate. Here a stray write during a candidate's timed calls
    stands for it: that candidate is recorded incorrect, saying why, and the next one passes."""
    from autofuse.tuning.outcome import Candidate, Outcome

    evaluate, job, state = evaluated_once
    timed = evaluate.time_callable

    def stray_write(fn, *args, **kwargs):
        with torch.no_grad():
            _kept("large").linear.bias[0] += 1.0
        return timed(fn, *args, **kwargs)

    monkeypatch.setattr(evaluate, "time_callable", stray_write)
    hit = evaluate.evaluate(state, job, Candidate("eager", {}))
    assert hit.outcome is Outcome.INCORRECT and hit.reason.startswith("wrote outside its own memory"), hit.reason
    assert "the kept model of the large seed=2 cases" in hit.reason and not any(key[4] == "large" for key in gate._MODELS)
    monkeypatch.setattr(evaluate, "time_callable", timed)
    assert evaluate.evaluate(state, job, Candidate("eager", {})).outcome is Outcome.OK
    assert gate.damaged_models() == [] and any(key[4] == "large" for key in gate._MODELS)  # drawn again


def test_a_candidate_that_writes_into_a_prepared_case_is_recorded_and_the_case_prepared_again(
        evaluated_once, monkeypatch):
    """The same for what the gate prepared once per case (its model, input, reference, floor):
    a write into one fails the candidate that made it, not the ones after it."""
    from autofuse.tuning.outcome import Candidate, Outcome

    evaluate, job, state = evaluated_once
    prepared = next(p for p in state["cases"].values() if p.case.distribution == "rand")
    timed = evaluate.time_callable

    def stray_write(fn, *args, **kwargs):
        prepared.x[0, 0] += 1.0
        return timed(fn, *args, **kwargs)

    monkeypatch.setattr(evaluate, "time_callable", stray_write)
    hit = evaluate.evaluate(state, job, Candidate("eager", {}))
    assert hit.outcome is Outcome.INCORRECT and hit.reason.startswith("wrote outside its own memory"), hit.reason
    assert f"the prepared case {prepared.case.describe()}" in hit.reason and "kept model" not in hit.reason
    monkeypatch.setattr(evaluate, "time_callable", timed)
    assert evaluate.evaluate(state, job, Candidate("eager", {})).outcome is Outcome.OK
    assert gate.damaged_cases(state["cases"]) == [] and all(p is not prepared for p in state["cases"].values())


def test_a_candidate_that_raises_after_a_stray_write_leaves_the_next_one_a_clean_gate(evaluated_once, monkeypatch):
    """A candidate that writes into a kept model and then fails is recorded by its failure (the
    worker's), and what it wrote is not the next candidate's outcome."""
    from autofuse.tuning.outcome import Candidate, Outcome

    evaluate, job, state = evaluated_once
    timed = evaluate.time_callable

    def stray_write_then_raise(fn, *args, **kwargs):
        with torch.no_grad():
            _kept("randn").linear.weight[0, 0] += 1.0
        raise RuntimeError("illegal memory access")

    monkeypatch.setattr(evaluate, "time_callable", stray_write_then_raise)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        evaluate.evaluate(state, job, Candidate("eager", {}))
    monkeypatch.setattr(evaluate, "time_callable", timed)
    assert evaluate.evaluate(state, job, Candidate("eager", {})).outcome is Outcome.OK


def test_a_stray_write_while_candidates_are_timed_together_is_said_and_the_next_gets_a_clean_gate(
        evaluated_once, monkeypatch, capsys):
    """Re-timing runs candidates that passed their own evaluation together, so a stray write
    there names no one: it is said, and what was written is drawn again."""
    from autofuse.tuning.outcome import Candidate, Outcome

    evaluate, job, state = evaluated_once
    together = evaluate.time_interleaved

    def stray_write(fns, *args, **kwargs):
        with torch.no_grad():
            _kept("wide").linear.weight[0, 0] += 1.0
        return together(fns, *args, **kwargs)

    monkeypatch.setattr(evaluate, "time_interleaved", stray_write)
    timings = evaluate.retime(state, job, [Candidate("eager", {})], rounds=2)
    assert set(timings) == {"eager[]", evaluate.BASELINE}  # the timings stand: the writer is not known
    assert "the kept model of the wide seed=4 cases changed while eager-baseline, eager[] were timed" in capsys.readouterr().err
    monkeypatch.setattr(evaluate, "time_interleaved", together)
    assert evaluate.evaluate(state, job, Candidate("eager", {})).outcome is Outcome.OK
