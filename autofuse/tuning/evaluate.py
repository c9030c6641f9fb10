"""What a worker subprocess does with a candidate: build it, gate it, time it.

Each function takes the worker's ``state`` dict first (prepared check cases and timing
inputs, kept while the job stays the same) and returns picklable results. They can be
called in-process too, which the tests do.
"""

from __future__ import annotations

import sys

from autofuse.core import registry
from autofuse.core.precision import math_mode, parse_dtype
from autofuse.core.variant import EagerVariant
from autofuse.errors import BuildError
from autofuse.serve import graphs
from autofuse.tuning import timeline
from autofuse.tuning.gate import (CheckCase, build_case, check_cases, check_variant, damaged_cases, damaged_models,
                                  draw_ahead, tuner_cases)
from autofuse.tuning.outcome import Candidate, Job, Outcome, TrialResult
from autofuse.tuning.timed_call import forward_call, replayed_call, training_call
from autofuse.tuning.timing import Timing, time_callable, time_interleaved

BASELINE = "eager-baseline"


def _job_state(state: dict, job: Job) -> dict:
    if state.get("job") != job:
        state.clear()
        state["job"] = job
    return state


def evaluate(state: dict, job: Job, candidate: Candidate, reach_ms: float | None = None,
             gate: bool = True, timed: Timing | None = None) -> TrialResult:
    """``_evaluate``, then whether the candidate wrote into what the gate keeps between
    candidates (its drawn models, its prepared cases): one that writes memory it does not own
    is recorded incorrect, and everything this worker kept for the job (cases, models, the
    timing case) is dropped and drawn again, so the candidates after it are checked on what
    they should be."""
    try:
        result = _evaluate(state, job, candidate, reach_ms, gate, timed)
    except Exception:  # its failure is its outcome (the worker's); what it wrote must not be the next one's
        try:
            _forget_if_damaged(state)
        except Exception:  # noqa: BLE001 - a CUDA error that outlived the candidate: the worker is replaced
            pass
        raise
    damaged = _forget_if_damaged(state)
    if not damaged:
        return result
    return TrialResult(Outcome.INCORRECT, f"wrote outside its own memory: {'; '.join(damaged)} changed while it ran",
                       compile_s=result.compile_s)


def _forget_if_damaged(state: dict) -> list[str]:
    """What the candidate just run changed of the gate's kept models and cases; all the job's
    kept state dropped if anything."""
    damaged = damaged_models() + damaged_cases(state.get("cases", {}))
    if damaged:
        state.clear()
    return damaged


def _evaluate(state: dict, job: Job, candidate: Candidate, reach_ms: float | None = None,
              gate: bool = True, timed: Timing | None = None) -> TrialResult:
    """Build and time one candidate at the job's shape, then check it against float64.

    Timed first: with ``reach_ms`` (the budget's reach of the best gated time so far), a
    candidate slower than that is recorded ``out_of_reach`` with its time and not gated, since
    it cannot be chosen; the gate (its cases, one at an odd small shape where a kernel's sizes
    may specialise it anew; none there for ``Variant.compiles_per_shape``) is most of a trial's
    time. ``gate=False`` stops after the timing (``out_of_reach``, "timed only"): a caller that
    races a few candidates times them all first, then gates some with that timing (``timed``:
    not measured again), on the instance that was timed, while the job (the rung) stays the same.
    """
    state = _job_state(state, job)
    problem = registry.get_problem(job.problem)
    cls = registry.get_variant(job.problem, candidate.variant)
    kept = state.setdefault("timed", {})
    variant = kept.get(candidate.label()) if timed is not None else None
    reused = variant is not None  # built again, ``compiled`` would wrap a new code object and compile anew
    if not reused:
        variant = cls(candidate.precision or job.precision, **candidate.params)
    if "drawing" not in state:  # the gate's cases drawn while the job's first candidates compile and are timed
        _timing_case(state, job)  # first: it draws from the global generator too
        draw_ahead(problem, check_cases(problem, job.shape, job.seed), job.device, parse_dtype(job.dtype), job.mode)
        state["drawing"] = True
    try:
        if not reused:
            with timeline.span(lambda: f"  build {candidate.label()}"):
                variant.build(job.device)
        if timed is None:
            with timeline.span(lambda: f"  first calls (compiling) and timing {candidate.label()} {timeline.at(job.shape)}"):
                timed = time_callable(_timed_call(state, job, variant, candidate.autograd), job.device,
                                      budget_ms=job.budget_ms)
        timing = timed
    except BuildError as exc:  # a variant that compiles at its first call (torch.compile) failed to
        return TrialResult(Outcome.COMPILE_FAILED, str(exc), compile_s=getattr(variant, "compile_seconds", None))
    # Read after the first calls (the timing's warm-up, at the timed shape): they are the ones that compiled.
    compile_s = getattr(variant, "compile_seconds", None)
    if not gate:
        # Kept, while the job stays, for the gate and the re-timing that may follow: a new instance
        # compiled again what the timing compiled (``compiled``'s training step, seconds a rung).
        kept[candidate.label()] = variant
        return TrialResult(Outcome.OUT_OF_REACH, "timed only", timing=timing, compile_s=compile_s)
    if reach_ms is not None and timing.median_ms > reach_ms:
        return TrialResult(Outcome.OUT_OF_REACH, f"{timing.median_ms:.4g} ms, beyond the gated best's reach "
                           f"({reach_ms:.4g} ms): not gated", timing=timing, compile_s=compile_s)
    cases = tuner_cases(problem, cls, candidate.params, job.shape, job.seed)
    try:
        check = check_variant(variant, problem, cases, job.device, dtype=parse_dtype(job.dtype), mode=job.mode,
                              autograd=candidate.autograd, cache=state.setdefault("cases", {}))
    except BuildError as exc:  # another case's sizes compiled anew, and failed
        kept.pop(candidate.label(), None)
        return TrialResult(Outcome.COMPILE_FAILED, str(exc), compile_s=compile_s)
    if not check.ok:
        kept.pop(candidate.label(), None)
        return TrialResult(Outcome.INCORRECT, check.reason, check.error, compile_s=compile_s)
    return TrialResult(Outcome.OK, None, check.error, timing, compile_s=compile_s)


def retime(state: dict, job: Job, candidates: list[Candidate], rounds: int) -> dict[str, Timing]:
    """Time already-verified candidates and the eager baseline round-robin in one run (the
    baseline as they run: a forward, or a training step where any runs with gradients)."""
    state = _job_state(state, job)
    calls = {}
    if not all(c.autograd for c in candidates):
        calls[BASELINE] = _timed_call(state, job, EagerVariant(job.precision), False)
    for candidate in candidates:
        variant = state.get("timed", {}).get(candidate.label())  # the instance timed and gated in this job, if kept
        if variant is None:
            variant = registry.get_variant(job.problem, candidate.variant)(candidate.precision or job.precision,
                                                                          **candidate.params)
            variant.build(job.device)
        calls[candidate.label()] = _timed_call(state, job, variant, candidate.autograd)
    if any(c.autograd for c in candidates):
        calls[BASELINE + " +grad"] = _timed_call(state, job, EagerVariant(job.precision), True)
    timings = time_interleaved(calls, job.device, rounds=rounds)
    if damaged := _forget_if_damaged(state):  # none wrote stray at its own evaluation: no one to name
        print(f"autofuse: {'; '.join(damaged)} changed while {', '.join(calls)} were timed together: "
              "drawn again for what comes next", file=sys.stderr)
    return timings


def gemm_floor(state: dict, job: Job) -> Timing | None:
    """cuBLAS's GEMM alone on the timing case's x and W at the job's precision, operands already
    in the GEMM's dtype (a lower bound of every call that multiplies through it:
    ``Variant.bounded_by_gemm``); None where the problem's floor is not a GEMM."""
    state = _job_state(state, job)
    problem = registry.get_problem(job.problem)
    if problem.floor != "gemm":
        return None
    model, x = _timing_case(state, job)
    weight = problem.linear_of(model).weight.detach()
    if job.precision == "bf16":
        x, weight = x.bfloat16(), weight.bfloat16()

    def gemm():
        with math_mode(job.precision):
            return x @ weight.t()
    return time_callable(gemm, job.device, budget_ms=min(job.budget_ms, 200.0))


def _timed_call(state: dict, job: Job, variant, autograd: bool):
    """A zero-argument call of ``variant`` on KernelBench's own input (torch.rand, default init):
    a forward without autograd (replayed as a CUDA graph where the runtime would replay it), or a
    training step (``autofuse.tuning.timed_call``) for the autograd entry."""
    model, x = _timing_case(state, job)
    if not autograd:
        problem = registry.get_problem(job.problem)
        batch, updates = job.shape.get(problem.batch_dim, 0), problem.training_updates
        if graphs.graphable(variant, batch, x.device, False, job.mode, updates):
            return replayed_call(variant, model, x, updates if job.mode == "train" else ())
        return forward_call(variant, model, x)
    return training_call(variant, model, x, state.setdefault("upstream", {}), variant.precision)


def _timing_case(state: dict, job: Job):
    """KernelBench's own input (torch.rand, default init) at the job's shape, made once per job."""
    if "timing_case" not in state:
        problem = registry.get_problem(job.problem)
        case = CheckCase(job.shape, "rand", job.seed, randomize=False)
        state["timing_case"] = build_case(problem, case, job.device, parse_dtype(job.dtype), job.mode)
    return state["timing_case"]
