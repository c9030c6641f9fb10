"""Batch classes: a tune at batch B also gates and times entries for its shape family's other batches.

A configuration gated at B may be wrong elsewhere (TF32 products on float16 parts failed the tf32
gate at batch 1 and passed at 37 and up, H100: ``TritonVariant.only_where_gated``), and the
fastest one at B is not the fastest where the batch is small and the weight's read is the floor.
So after the search at B, each "rung" of the ladder (the problem's smallest batch, the powers of 8
below B, for the forward 32, and 128 and 256 under bf16 and tf32, and 2B: ``rung_batches``) races
a handful of candidates at that batch: the winner's configuration first, the study's next
fastest, each other fused variant's best at B within the budget's ``prune`` of the winner
(``other_kinds``; a training step's rungs at one row only), small-tile seeds below
``SMALL_BATCH`` (the variant's ``small_batch_seeds``), the entry the table already holds at the
rung (an earlier tune's choice: ``rung_candidates``), the simplest variants, and, where the
winner's operands pass only where gated, its variant at the next stricter precision. Each is
timed at the rung's shape, then gated fastest first as a trial is (``evaluate``; under ``quick``
only within reach of the best gated, ``run_rung``), the best few re-timed against eager
(``choose``), and the choice becomes an ordinary table entry at batch b marked ``rung_of`` B. A
batch between rungs is served by the nearest entries
(``autofuse.serve.dispatch``); an entry restricted to where it was gated serves only inside the
batches its exact configuration passed (``gated_batches``).
"""

from __future__ import annotations

import dataclasses
import datetime
import math

import torch

from autofuse.core import registry
from autofuse.core.precision import serving_order
from autofuse.core.problem import Problem
from autofuse.core.variant import check_params
from autofuse.errors import InputError, TableError
from autofuse.serve import graphs
from autofuse.serve.dispatch import bad_entry, gated_around
from autofuse.serve.table import fingerprint_key, parse_shape_key, shape_key
from autofuse.tuning import prewarm
from autofuse.tuning import study as studies
from autofuse.tuning.budget import Budget
from autofuse.tuning.budget import budget as get_budget
from autofuse.tuning.outcome import Candidate, Job, Outcome, TrialResult
from autofuse.tuning.progress import TrialProgress
from autofuse.tuning.search import trial_shapes
from autofuse.tuning.selection import Row, candidate_records, choose

# The ladder's step between the smallest batch and B.
RUNG_RATIO = 8
# Below this batch the weight's read is the floor (H100, 8192² bf16: 134 MB of weight, 40 µs at
# 3.35 TB/s, while 128 rows of products take ~2 µs): a rung races small-tile configurations too.
SMALL_BATCH = 128
# The forward ladder's extra rungs inside the memory-bound regime, where the best tile is as tall as
# the batch (the triton kind's small tiles are 16, 32 and 64 rows): without 32, batch 32 took rung
# 64's choice, for triton a 64-row tile, 4-6% slower than a 32-row one (H100, 8192² bf16, tuner's
# timing: 22 60.2 µs against 57.9, 99 64.1 against 61.0, gemm_bn eval of a bfloat16 model 55.7
# against 52.4), and a 16-row tile (rung 8's) was no better (55.3-65.7). Where the tensor cores
# take one 16- or 19-bit product per multiply (bf16, tf32) the GEMM stays memory-bound to a few
# hundred rows (the ridge: ~206 FLOP per byte on an H200, ~295 on an H100), and neither neighbour
# of 64 and 512 serves between them: at 100 and 200 rows of 22's bf16 family rung 64's 64-row tile
# read W twice and rung 512's 128×256 tile ran 64 programs, 1.67x and 1.75x torch.compile's
# cuBLAS GEMM (0.0842 and 0.0952 ms against 0.0503 and 0.0545, H200). fp32's split takes three
# products and ieee's FMA is slower still: compute-bound there (99 fp32 at 200 rows: rung 512
# served at 1.004x a tune at 200). The autograd ladder races the same few configurations at
# every rung, so it gains nothing from more.
MEMORY_BOUND_RUNGS = {"ieee": (32,), "fp32": (32,), "tf32": (32, 128, 256), "bf16": (32, 128, 256)}
# At a compute-bound rung, the simplest variants race only where nothing else passes if eager was
# beyond this many times the budget's reach at B (``Ladder.fallbacks``).
FALLBACK_SPEEDUP = 2.0


def rung_batches(problem: Problem, shape: dict, mode: str, precision: str, autograd: bool = False) -> list[int]:
    """The batches a tune at ``shape`` and ``precision`` also covers: the problem's smallest batch (2
    for a training BatchNorm), each power of ``RUNG_RATIO`` between it and B, the forward's
    ``MEMORY_BOUND_RUNGS`` at the precision between them, and 2B; never B itself."""
    if problem.batch_dim is None:
        return []
    tuned, smallest = shape[problem.batch_dim], smallest_batch(problem, mode)
    rungs, power = {smallest, 2 * tuned}, RUNG_RATIO
    while power < tuned:
        rungs.add(power)
        power *= RUNG_RATIO
    if not autograd:
        rungs.update(b for b in MEMORY_BOUND_RUNGS[precision] if smallest < b < tuned)
    return sorted(b for b in rungs if b != tuned)


def smallest_batch(problem: Problem, mode: str) -> int:
    """The smallest batch a call in ``mode`` may have: 2 for a training BatchNorm, else 1."""
    return problem.min_train_batch if mode == "train" else 1


def rung_shape(problem: Problem, shape: dict, batch: int) -> dict:
    return {**shape, problem.batch_dim: batch}


@dataclasses.dataclass
class Ladder:
    """What every rung of one key races, besides its own small-batch seeds."""

    winner: Candidate  # the winner at B
    runners_up: list[Candidate]  # the study's next fastest at B, then each other kind's best (``other_kinds``)
    simplest: list[Candidate]  # eager and simplified: a rung always has a gated entry
    stricter: Candidate | None  # the winner's variant at the next stricter precision, where it is restricted
    spaces: dict  # the tune's admitted variants and their configurations at B
    speedup: float | None = None  # the winner's time at B over eager's (its entry's ``speedup``)

    def fallbacks(self, batch: int, budget: Budget) -> frozenset[str]:
        """Labels of the simplest candidates that race at ``batch`` only where no other passes
        (``run_rung``): at a rung of ``SMALL_BATCH`` rows or more, compute-bound as B is, where the
        winner at B ran more than ``FALLBACK_SPEEDUP`` times the budget's reach faster than eager.
        Timed there all the same, they cost kb2-99's rungs at 512 and 2048 (forward and training
        step) 3.5 s of 33 and were never within reach (H200, fp32: eager 3.3-3.8x the winner at B).
        None under an unlimited reach (``full``: every candidate gated)."""
        if (batch < SMALL_BATCH or math.isinf(budget.reach) or self.speedup is None
                or self.speedup <= FALLBACK_SPEEDUP * budget.reach):
            return frozenset()
        return frozenset(c.label() for c in self.simplest)


def build_ladder(problem: str, winner: dict, ranked: list[tuple[str, dict]], spaces: dict, stricter_params: dict | None,
           precision: str, budget: Budget, autograd: bool) -> Ladder:
    """The candidates every rung races, from the tune's ``winner`` entry, its ``ranked`` timed
    configurations (fastest first) and ``stricter_params`` (the stricter precision's recorded
    configuration of the winner's variant, or None: its first). The autograd entry's runners-up
    are the other kinds close at B alone, which its rungs race at one row only
    (``rung_candidates``): each of its candidates is a training step."""
    variants = registry.variants(problem)
    first = Candidate(winner["variant"], dict(winner["params"]), autograd)
    runners = [] if autograd else [Candidate(v, dict(p)) for v, p in ranked
                                   if (v, p) != (first.variant, first.params)][:budget.rung_runners_up]
    runners += [dataclasses.replace(c, autograd=autograd) for c in other_kinds(winner, spaces, budget, variants)
                if c not in runners and (variants[c.variant].supports_autograd or not autograd)]
    simplest = [Candidate(name, dict(configs[0]), autograd) for name, configs in spaces.items()
                if variants[name].rank() <= 1 and name != first.variant and (variants[name].supports_autograd or not autograd)]
    stricter, cls = None, variants[first.variant]
    next_stricter = serving_order(precision)[1:2]
    if cls.only_where_gated(first.params) is not None and next_stricter and next_stricter[0] in cls.precisions:
        stricter = Candidate(first.variant, dict(stricter_params or {}), autograd, next_stricter[0])
    return Ladder(first, runners, simplest, stricter, spaces, winner.get("speedup"))


def other_kinds(winner: dict, spaces: dict, budget: Budget, variants: dict) -> list[Candidate]:
    """Each other fused variant's best configuration at B (the entry's ``candidates``) timed within
    the budget's ``prune`` of the winner, fastest first: the study's runners-up are mostly the
    winner's variant, so without these a rung never raced a kind that was close at B and may win
    at another batch: cuBLAS picks its kernel per call's rows, a triton configuration keeps its
    tile. H200, 22 under bf16 at 8192² (torch.compile 1.03x and cuBLAS + epilogue 1.07x triton's
    time at B): at 128 and 256 rows ``compiled`` won (0.0493 and 0.0602 ms), where rung 64's
    triton tile had served 100 rows in 0.0791; at 1-32 rows the small triton tiles kept their rungs
    (cuBLAS + epilogue 1.23-1.26x). The simplest variants race at every rung anyway."""
    best = winner.get("median_ms")
    if best is None:
        return []
    held = studies.space_labels(spaces)
    timed = [(record["median_ms"], name, record["params"]) for name, record in (winner.get("candidates") or {}).items()
             if name != winner["variant"] and name in variants and variants[name].rank() > 1
             and isinstance(record, dict) and record.get("median_ms") is not None
             and record.get("outcome") in (Outcome.OK.value, Outcome.OUT_OF_REACH.value)
             and record["median_ms"] <= budget.prune * best
             and (name, studies.config_label(record["params"])) in held]
    return [Candidate(name, dict(params)) for _, name, params in sorted(timed, key=lambda t: t[0])]


def rung_candidates(ladder: Ladder, problem: Problem, shape: dict, device: str, precision: str,
                    budget: Budget, mode: str = "any", incumbent: Candidate | None = None) -> list[Candidate]:
    """What the rung at ``shape`` races, each valid there and once: the winner first (gated first
    where timings tie, and always under the ``full`` budget; its variant's first configuration
    there where its own does not hold the rung, ``_winner_at``). ``incumbent``: the table's entry
    at the rung (``_incumbent``), raced again so that a re-tune keeps it where it is still the
    fastest: re-tuned after `cublas_epilogue` took gemm_bn's bfloat16-model step at B, the eval
    step's rungs at 8 and 64 rows raced it and the simplest only and took `cublas_epilogue` at
    0.1183 and 0.1201 ms, where the table held `compiled` at 0.1082 and 0.1141 (H100, tuner's
    times; a training step's rungs race the other kinds at one row only, below). At a rung whose
    calls the runtime replays as CUDA graphs (``graphs.replayed_key``), only ``capturable``
    candidates where any is: the race times the GPU, and a replay costs the host one to three
    launches, while a call that cannot be captured pays its whole host path on top (H100,
    gemm_bn training 32×4096² bf16: a ``compiled`` entry, 32 µs of GPU time, took 411 µs of wall
    a call)."""
    device_type = (on := torch.device(device)).type
    variants = registry.variants(problem.name)
    seeds = []
    if not ladder.winner.autograd and shape[problem.batch_dim] < SMALL_BATCH:
        for name in ladder.spaces:
            like = ladder.winner.params if name == ladder.winner.variant else {}
            found = variants[name].small_batch_seeds(shape, device_type, precision, like)
            seeds += [Candidate(name, config) for config in found[:budget.rung_seeds]]
    stricter = []
    if ladder.stricter is not None:
        cls, at = variants[ladder.stricter.variant], ladder.stricter.precision
        params = ladder.stricter.params or next(iter(cls.configs_for(shape, device_type, at)), None)
        if params is not None:
            stricter = [dataclasses.replace(ladder.stricter, params=dict(params))]
    # A training step's rung races the other kinds at one row only: there the weight gradient is a
    # contraction of one, which cuBLAS runs on an sm75 kernel (107 µs at 8192² bf16) where the bf16
    # variants contract two rows (48), so `cublas_epilogue`'s step of 22's bfloat16 model took 0.1369
    # ms against 0.1648 for the winner at B, `compiled` (H100). At 8 rows `compiled` still led (0.1126
    # against 0.1315), and each step raced costs a rung seconds (a compile, a gate with gradients).
    runners = ladder.runners_up if not ladder.winner.autograd or shape[problem.batch_dim] == 1 else []
    held = [incumbent] if incumbent is not None and incumbent.variant in ladder.spaces else []
    chosen, seen = [], set()
    for candidate in [_winner_at(ladder.winner, variants, shape, device_type, precision), *runners, *held, *seeds,
                      *stricter, *ladder.simplest]:
        # by value: a table's entry lists its params in its own order
        same = (candidate.variant, tuple(sorted(candidate.params.items())), candidate.precision, candidate.autograd)
        if same not in seen and _valid(variants[candidate.variant], candidate.params, shape, device_type):
            chosen.append(candidate)
            seen.add(same)
    if graphs.replayed_key(shape[problem.batch_dim], on, ladder.winner.autograd, mode, problem.training_updates):
        capturable = [c for c in chosen if variants[c.variant].capturable]
        chosen = capturable or chosen
    return chosen


def _winner_at(winner: Candidate, variants: dict, shape: dict, device_type: str, precision: str) -> Candidate:
    """The winner at B, or where its configuration does not hold the rung's shape its variant's
    first configuration there: `cublas_epilogue`'s 32-column strip holds 1024 rows of gemm_bn,
    not 2048, and without the kind that won at B the training step's rung at 2048 rows went to
    eager (1.0685 ms, where `compiled` had taken 0.8836; H100, bfloat16 model)."""
    cls = variants[winner.variant]
    if _valid(cls, winner.params, shape, device_type):
        return winner
    first = next(iter(cls.configs_for(shape, device_type, winner.precision or precision)), None)
    return winner if first is None else dataclasses.replace(winner, params=dict(first))


def _valid(cls, params: dict, shape: dict, device_type: str) -> bool:
    try:
        check_params(cls, params, shape, device_type)
    except InputError:
        return False
    return True


@dataclasses.dataclass
class RungResult:
    batch: int
    entry: dict | None  # the rung's choice (``choose``'s entry), None where nothing passed
    rows: list[Row]  # every candidate raced, in order
    passed: set[str]  # labels of the candidates that passed the gate here


def run_rung(job: Job, candidates: list[Candidate], worker, trial_timeout: float, budget: Budget,
             on_candidate=None, fallbacks: frozenset[str] = frozenset()) -> RungResult:
    """Race ``candidates`` at ``job``'s shape: time each, then gate them fastest first, each only
    within the budget's reach of the best gated so far (every one, in order, where the reach is
    infinite); then re-time the best few against eager and choose. Timing first spends the gate,
    most of a candidate's seconds, where it can matter: at small batches a fused training step
    can trail eager's far (gemm_bn train at batch 64, H100: 1.9 ms of mostly host time against
    0.21), and its gradient check cost 10-24 s a rung. The candidates labelled in ``fallbacks``
    (``Ladder.fallbacks``) race only where no other passed."""
    variants = registry.variants(job.problem)
    racing = [i for i, c in enumerate(candidates) if c.label() not in fallbacks]
    results, passed = _race(job, candidates, racing, worker, trial_timeout, budget, on_candidate)
    if not passed:
        later = [i for i in range(len(candidates)) if i not in racing]
        results.update(_race(job, candidates, later, worker, trial_timeout, budget, on_candidate)[0])
        passed = {candidates[i].label() for i in later if results[i].outcome is Outcome.OK}
    for i in range(len(candidates)):
        if i not in results:
            results[i] = TrialResult(Outcome.OUT_OF_REACH, "not raced: a fallback, and another candidate passed")
            if on_candidate is not None:
                on_candidate(candidates[i], results[i])
    rows = [Row(c.variant, variants[c.variant].rank(), c.params, results[i], 1, precision=c.precision)
            for i, c in enumerate(candidates)]
    autograd = bool(candidates) and candidates[0].autograd
    entry = choose(job, rows, worker, trial_timeout, autograd=autograd)
    return RungResult(job.shape[registry.get_problem(job.problem).batch_dim], entry, rows, passed)


def _race(job: Job, candidates: list[Candidate], indices: list[int], worker, trial_timeout: float, budget: Budget,
          on_candidate) -> tuple[dict[int, TrialResult], set[str]]:
    """``run_rung``'s race of ``candidates[i]`` for i in ``indices``: each one's result, by index,
    and the labels of those that passed."""
    if math.isinf(budget.reach):
        order, first = list(indices), {i: None for i in indices}
    else:
        first = {i: worker.call("evaluate", (job, candidates[i], None, False), trial_timeout) for i in indices}
        order = sorted(indices, key=lambda i: _timed_ms(first[i]))
    results, passed, best = {}, set(), None
    for i in order:
        candidate, timed = candidates[i], first[i]
        if timed is not None and timed.outcome is not Outcome.OUT_OF_REACH:  # it failed before any gate
            result = timed
        elif timed is not None and best is not None and timed.timing.median_ms > budget.reach * best:
            result = dataclasses.replace(timed, reason=f"{timed.timing.median_ms:.4g} ms, beyond the gated best's "
                                         f"reach ({budget.reach * best:.4g} ms): not gated")
        else:  # gated on the timing it has, if any
            result = worker.call("evaluate", (job, candidate, None, True, getattr(timed, "timing", None)),
                                 trial_timeout)
        if result.outcome is Outcome.OK:
            passed.add(candidate.label())
            best = result.timing.median_ms if best is None else min(best, result.timing.median_ms)
        results[i] = result
        if on_candidate is not None:
            on_candidate(candidate, result)
    return results, passed


def _timed_ms(result) -> float:
    """A time-only result's median, for ordering (a candidate that failed first sorts last)."""
    timing = getattr(result, "timing", None)
    return math.inf if result.outcome is not Outcome.OUT_OF_REACH or timing is None else timing.median_ms


def gated_batches(label: str, tuned_batch: int | None, results: list[RungResult]) -> list[int]:
    """The batches where the candidate ``label`` passed the gate: the tuned one (given where it is the
    winner at B, gated there by the search) and each rung's."""
    batches = {r.batch for r in results if label in r.passed}
    return sorted(batches | ({tuned_batch} if tuned_batch is not None else set()))


def best_per_variant(rows: list[Row]) -> list[Row]:
    """Each variant's gated row with the lowest time (else its first row): an entry's ``candidates``
    record one configuration per variant."""
    best: dict[str, Row] = {}
    for row in rows:
        held = best.get(row.variant)
        if held is None or (row.ok and (not held.ok or row.timing.median_ms < held.timing.median_ms)):
            best[row.variant] = row
    return list(best.values())


@dataclasses.dataclass
class Searched:
    """What the search at B left for the batch classes: its results, the spaces, the study's name and
    whether the table's entries were kept (nothing new measured); where nothing was searched
    (``classes_only``), the ranking the entry at B recorded (``recorded_ranking``)."""

    results: dict
    spaces: dict
    study: str
    kept: bool
    recorded: list[tuple[str, dict]] = dataclasses.field(default_factory=list)

    def ranked(self) -> list[tuple[str, dict]]:
        """Every timed (variant, configuration), fastest first; without results, ``recorded``."""
        if not self.results:
            return list(self.recorded)
        labels = studies.space_labels(self.spaces)
        timed = sorted((r.timing.median_ms, key) for key, r in self.results.items()
                       if r.outcome in (Outcome.OK, Outcome.OUT_OF_REACH) and key in labels)
        return [(key[0], labels[key]) for _, key in timed]


def recorded_ranking(entry: dict, spaces: dict) -> list[tuple[str, dict]]:
    """The configurations an entry's tune recorded (``candidates``: each variant's best, with its
    time), fastest first, those ``spaces`` still holds: the runners-up of a classes-only run, which
    searched nothing (H100: without them the rungs of gemm_bn training bf16 16384×4096² raced
    triton's small tiles, eager and simplified, never cublas_epilogue)."""
    held = studies.space_labels(spaces)
    timed = [(record["median_ms"], name, record["params"]) for name, record in (entry.get("candidates") or {}).items()
             if isinstance(record, dict) and record.get("outcome") == Outcome.OK.value
             and record.get("median_ms") is not None and (name, studies.config_label(record["params"])) in held]
    return [(name, dict(params)) for _, name, params in sorted(timed, key=lambda t: t[0])]


def cover(prob, shape, job, key, fingerprint, table, entries, worker, plan, searched: Searched,
          label: str) -> list[tuple]:
    """Race each batch class's candidates for the forward and the autograd entry (``entries``, the
    tune's at B); return the table items to record: the rungs' choices, and the entries at B with the
    batches where their configuration passed the gate (``gated_batches``), widened by ``bridge``."""
    work = _plan(prob, shape, job, key, fingerprint, table, entries, get_budget(plan.budget), searched, plan.rungs)
    total = sum(len(candidates) for *_, rungs in work for _, candidates in rungs)
    items, unserved = [], []
    compiling = _submit(prob, job, work)  # what ``compile_ahead`` submitted is waited for, not compiled again
    with TrialProgress(total, 0, f"{label} batch classes", enabled=plan.progress and total > 0) as bar:
        for (entry, dkey, ladder, rungs), compiled in zip(work, compiling):
            done = []
            for (at, candidates), rung_compiled in zip(rungs, compiled):
                def said(candidate, result, batch=at[prob.batch_dim]):
                    bar.advance(f"batch {batch}: {candidate.label()} {result.outcome.value}")

                rung_compiled.wait()
                budget, batch = get_budget(plan.budget), at[prob.batch_dim]
                done.append(run_rung(dataclasses.replace(job, shape=at), candidates, worker, plan.trial_timeout,
                                     budget, said, ladder.fallbacks(batch, budget)))
            raced = _rung_items(prob, shape, dkey, fingerprint, ladder, done, searched.study, job.seed)
            unserved += [unserved_rung(label, dkey, rung) for rung in done if rung.entry is None]
            passed = gated_batches(ladder.winner.label(), shape[prob.batch_dim], done)
            if searched.kept:  # the rungs left as they were keep what they found
                passed = sorted(set(passed) | set(entry.get("gated_batches") or ()))
            elif plan.rungs is not None:  # so do the rungs ``--rungs`` left out
                raced_here = {r.batch for r in done}
                passed = sorted(set(passed) | {b for b in entry.get("gated_batches") or () if b not in raced_here})
            entry["gated_batches"] = passed
            kept = _kept_rungs(table, fingerprint, prob, shape, dkey, job.mode)
            raced_at = {parse_shape_key(item[2])[prob.batch_dim]: item[4] for item in raced}
            widened = bridge(prob, shape, job, dkey, {**kept, **raced_at, shape[prob.batch_dim]: entry}, worker,
                             plan.trial_timeout)
            # A raced rung is recorded with its widened range anyway; a kept one only where it widened.
            items += raced + [(fingerprint, prob.name, shape_key(rung_shape(prob, shape, b)), dkey.to_str(), kept[b])
                              for b in sorted(widened & kept.keys() - raced_at.keys())]
            if widened or total:
                items.append((fingerprint, prob.name, shape_key(shape), dkey.to_str(), entry))
    for line in unserved:  # after the bar: said, not lost in it
        print(f"autofuse: {line}")
    return items


def unserved_rung(label: str, dkey, rung: RungResult) -> str:
    """What a tune says of a rung where no candidate passed: its batches go to the nearest rung
    that has an entry (correct there, ungated here), and why each candidate failed. A tune that
    left rungs out without a word had looked complete in its summary (22 for a bfloat16 model,
    H200: every candidate at 8 to 2048 rows incorrect, eager's own forward among them)."""
    failed = [f"{Candidate(row.variant, row.params).label()}: {row.result.outcome.value} "
              f"({next(iter((row.result.reason or '').splitlines()), '')[:160]})"
              for row in rung.rows if row.result is not None and row.result.outcome is not Outcome.OUT_OF_REACH]
    return (f"{label} ({dkey.to_str()}): no candidate passed at batch {rung.batch}; the nearest batch class "
            f"with an entry serves there. " + ("; ".join(failed) or "every candidate was out of reach"))


def compile_ahead(prob, shape, job, key, fingerprint, table, winner: dict, plan, searched: Searched) -> None:
    """Submit the compiles of the forward's rungs as soon as its ``winner`` at B is chosen, and,
    where its variant trains, those of the autograd rungs for the same configuration (the
    autograd entry's first try, and most often its winner): the pool is idle while the worker
    compiles and gates the autograd entry's training step (kb2-99 fp32, H200: 18-24 s), and the
    batch classes then waited 5.5 s for their first rung's compiles. ``cover`` submits the same
    compiles again, and waits for these (``prewarm.submit``); a speculation the autograd entry
    does not take costs the pool alone."""
    trains = plan.autograd_entry and registry.variants(prob.name)[winner["variant"]].supports_autograd
    _submit(prob, job, _plan(prob, shape, job, key, fingerprint, table, (winner, winner if trains else None),
                             get_budget(plan.budget), searched, plan.rungs))


def _submit(prob, job, work) -> list[list[prewarm.Pending]]:
    """Submit every rung's new specializations (batches of 1 and not a multiple of 16, the small
    tiles) to the compile pool (the autograd rungs' with their backward kernels, which one process
    compiles in turn), in the order the rungs race: the worker waits for a rung's alone, and races
    the first rungs while the pool compiles the later ones. Compiled one after another in the
    worker, kb2-99's tune spent about 30 s of its 128 on an H100's host on them; compiled in
    parallel before any race, 17 of the 44 s its batch classes took on an H200's; overlapped with
    the races, its batch classes took 38 s against 45 (H200, one seed, one host)."""
    return [[prewarm.submit(prob.name, job.device, job.dtype, job.mode, job.precision,
                            [prewarm.Compile(c.variant, c.params, shape, dkey.autograd) for c in candidates
                             if c.precision is None
                             for shape in trial_shapes(dataclasses.replace(job, shape=at), c.variant, c.params)],
                            job.log) for at, candidates in rungs] for entry, dkey, ladder, rungs in work]


def bridge(prob, shape, job, dkey, family: dict[int, dict], worker, trial_timeout: float) -> set[int]:
    """Gate each entry of ``family`` (batch → entry, one key's) whose configuration may serve only
    where it was gated (``only_where_gated``) at the geometric midpoint towards each neighbouring
    entry, where it is not gated around that batch already, and add the midpoints where it passed to
    its ``gated_batches``; return the batches whose entries changed.

    Without this, a batch between two rungs whose winners differ and are restricted has no entry
    that may serve it: tf32's scaled_fp16 rungs at 8 ([1, 8]) and 64 ([64]) left 9-63 and 65-511
    to the reference (22, 99 and gemm_bn 16384 train, H100). With both neighbours gated at the
    midpoint, the nearest entry (``dispatch``: nearest in ratio) is gated around every batch between.
    """
    variants, order, widened = registry.variants(prob.name), sorted(family), set()
    for lo, hi in zip(order, order[1:]):
        mid = round(math.sqrt(lo * hi))
        if not lo < mid < hi:
            continue
        for batch in (lo, hi):
            entry = family[batch]
            if gated_around(entry, mid) or variants[entry["variant"]].only_where_gated(entry["params"]) is None:
                continue
            candidate = Candidate(entry["variant"], dict(entry["params"]), dkey.autograd, entry.get("runs_at"))
            result = worker.call("evaluate", (dataclasses.replace(job, shape=rung_shape(prob, shape, mid)),
                                              candidate, None, True), trial_timeout)
            if result.outcome is Outcome.OK:
                entry["gated_batches"] = sorted(set(entry.get("gated_batches") or [batch]) | {mid})
                widened.add(batch)
    return widened


def _kept_rungs(table, fingerprint, prob, shape, dkey, mode) -> dict[int, dict]:
    """batch → the table's entry there that is one of this family's rungs (``rung_of`` its tuned shape)."""
    kept = {}
    for batch in rung_batches(prob, shape, mode, dkey.precision, dkey.autograd):
        held = _held(table, fingerprint, prob, rung_shape(prob, shape, batch), dkey)
        if held is not None and not bad_entry(held) and held.get("rung_of") == shape_key(shape):
            kept[batch] = held
    return kept


def _held(table, fingerprint, prob, shape: dict, dkey) -> dict | None:
    """The table's entry at ``shape`` and ``dkey``; None where it holds none or cannot be read."""
    try:
        return table.lookup(fingerprint_key(fingerprint), prob.name, shape_key(shape), dkey)
    except TableError:
        return None


def _plan(prob, shape, job, key, fingerprint, table, entries, budget: Budget, searched: Searched,
          only: tuple[int, ...] | None = None) -> list[tuple]:
    """(entry at B, its dispatch key, its ladder, [(rung shape, candidates)]) for each entry of the
    tune; ``only``: the rungs at those batches alone."""
    work = []
    for entry, autograd in zip(entries, (False, True)):
        if entry is None:
            continue
        dkey = dataclasses.replace(key, autograd=autograd)
        ladder = build_ladder(prob.name, entry, [] if autograd else searched.ranked(), searched.spaces,
                              _stricter_params(table, fingerprint, prob, shape, dkey, entry), job.precision,
                              budget, autograd)
        rungs = [rung_shape(prob, shape, b) for b in rung_batches(prob, shape, job.mode, job.precision, autograd)
                 if only is None or b in only]
        held = [(at, _held(table, fingerprint, prob, at, dkey)) for at in rungs]  # each a read of the table
        work.append((entry, dkey, ladder,
                     [(at, rung_candidates(ladder, prob, at, job.device, job.precision, budget, job.mode,
                                           _incumbent(there, dkey)))
                      for at, there in held if not _rung_done(there, shape, searched)]))
    return work


def _incumbent(held: dict | None, dkey) -> Candidate | None:
    """The candidate of ``held``, the entry the table holds at a rung (an earlier tune's choice
    there), or None where it holds none that can serve."""
    if held is None or bad_entry(held):
        return None
    return Candidate(held["variant"], dict(held.get("params") or {}), dkey.autograd, held.get("runs_at"))


def _rung_items(prob, shape, dkey, fingerprint, ladder, done, study_name, seed) -> list[tuple]:
    """The table items of the rungs' choices: ordinary entries at their batch, marked ``rung_of``."""
    variants, items = registry.variants(prob.name), []
    stamp = {"rung_of": shape_key(shape), "study": study_name, "seed": seed,
             "step": "forward+backward" if dkey.autograd else "forward",
             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    for rung in done:
        if rung.entry is None:
            continue
        entry = rung.entry
        mine = Candidate(entry["variant"], entry["params"], dkey.autograd, entry.get("runs_at")).label()
        tuned = shape[prob.batch_dim] if mine == ladder.winner.label() else None
        entry.update(stamp, trials=len(rung.rows), source_hash=variants[entry["variant"]].source_hash(),
                     gated_batches=gated_batches(mine, tuned, done),
                     candidates=candidate_records(best_per_variant(rung.rows)))
        items.append((fingerprint, prob.name, shape_key(rung_shape(prob, shape, rung.batch)), dkey.to_str(), entry))
    return items


def _stricter_params(table, fingerprint, prob, shape, dkey, entry) -> dict | None:
    """The configuration of ``entry``'s variant that the table holds at the next stricter precision
    for this shape (the batch classes' fallback for a restricted winner), or None."""
    stricter = serving_order(dkey.precision)[1:2]
    if not stricter:
        return None
    held = _held(table, fingerprint, prob, shape, dataclasses.replace(dkey, precision=stricter[0]))
    if held is None or bad_entry(held) or held["variant"] != entry["variant"]:
        return None
    return dict(held.get("params") or {})


def _rung_done(held: dict | None, shape, searched: Searched) -> bool:
    """Whether the rung need not run, from ``held``, the entry the table holds at its batch: one
    tuned there directly (a search beats a rung's race), or, where nothing new was measured, this
    study's rung entry."""
    if held is None or bad_entry(held) or held.get("provisional"):
        return False
    if "rung_of" not in held:
        return True
    return searched.kept and held.get("rung_of") == shape_key(shape) and held.get("study") == searched.study
