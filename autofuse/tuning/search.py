"""One shape's search: ask Optuna for candidates, compile them together, measure them one at a time.

Trials are asked in batches (TPE's constant liar keeps a batch diverse); the batch's kernels
compile in parallel on the host while the device measures candidates one at a time in the
worker subprocess. Other processes tuning the same study are seen through
``autofuse.tuning.shared_study``: nothing they measured or are measuring is measured again.
The ``budget`` (``autofuse.tuning.budget``) says which candidates are gated, which variants are
drawn no more and when a stalled search stops; ``on_best`` hears of each new best gated candidate
(the tuner writes it to the table as a provisional entry).
"""

from __future__ import annotations

import math
import os
import threading
import time

import torch

from autofuse.core import registry
from autofuse.kernels.build import build_jobs, build_many
from autofuse.tuning import prewarm, timeline
from autofuse.tuning import study as studies
from autofuse.tuning.budget import BUDGETS, STALL_GAIN, Budget
from autofuse.tuning.gate import runs_at, tuner_cases
from autofuse.tuning.outcome import Candidate, Job, Outcome, TrialResult
from autofuse.tuning.progress import TrialProgress
from autofuse.tuning.shared_study import SharedStudy
from autofuse.tuning.timing import Timing
from autofuse.tuning.worker import IMPORT_COMPILE_STACK

# Suggestions asked per distinct candidate before the search stops looking for new ones.
MAX_ASKS_PER_TRIAL = 5
# Trials asked at once: their kernels compile in parallel (one nvcc per core, at most 8).
ASK_BATCH = max(1, min(8, os.cpu_count() or 1))
# Variants with at most this many configurations in a search's space have them all built as the
# search starts (``_build_ahead``): cublas_epilogue's 4-9, the CUDA kinds' one or two.
AHEAD_MAX_CONFIGS = 16


def search(study, spaces, job, worker, total, timeout, trial_timeout, progress, label,
           budget: Budget = BUDGETS["full"], on_best=None) -> dict:
    """Measure candidates until ``total`` distinct ones are measured (by any process, earlier
    sessions' included), the space is exhausted, ``timeout`` passes or the search stalls
    (``budget.stall``); return every result.

    A repeated suggestion is told its earlier result and does not count: on small categorical
    spaces TPE repeats itself often, and a trial budget spent on repeats measures nothing; nor
    does a suggestion of a pruned variant (``budget.prune``). While other processes' trials are
    in flight and the budget is not met, this one waits for them, so every process makes its
    final choice from the same results.
    """
    total = min(total, sum(len(c) for c in spaces.values()))
    progress_of = _Progress(budget, on_best, screen=len(spaces))
    if any(_is_triton(job, name) for name in spaces):
        prewarm.start(job.device, job.log)  # ready by the second batch, the first to compile in parallel
    building = _build_ahead(spaces, job)
    try:
        return _search_loop(study, spaces, job, worker, total, timeout, trial_timeout, progress, label, progress_of)
    finally:
        if building is not None:
            building.join()  # no nvcc outlives the search, half-written


def _search_loop(study, spaces, job, worker, total, timeout, trial_timeout, progress, label, progress_of) -> dict:
    """``search``'s asks and measurements, until it is done."""
    asks_left = MAX_ASKS_PER_TRIAL * total
    deadline = None if timeout is None else time.monotonic() + timeout
    swept_at = -1  # results when the asks last ran out: sweep again only after progress
    imports_wanted = _compiled_in(spaces, job)
    with SharedStudy(study) as shared, TrialProgress(total, 0, label, enabled=progress) as bar:
        view = shared.view()
        while True:
            bar.show(view.results)
            progress_of.see(view.results)
            room = total - len(view.results) - len(view.claims)
            expired = deadline is not None and time.monotonic() >= deadline
            if progress_of.stalled():
                return view.results
            if room > 0 and asks_left <= 0 and not expired and len(view.results) > swept_at:
                swept_at = len(view.results)
                asks_left = _enqueue_the_rest(study, spaces, view, room, progress_of)
            if room > 0 and asks_left > 0 and not expired:
                # A fresh study's first candidate (the likeliest winner's default) goes alone: its
                # provisional entry then comes before the first batch's builds (nvcc, seconds each).
                size = min(ASK_BATCH, room) if view.results else 1
                asks_left -= _measure_batch(shared, spaces, job, worker, total, size, min(asks_left, MAX_ASKS_PER_TRIAL * size),
                                            trial_timeout, bar, progress_of)
                if imports_wanted:  # after the first candidate, whose compile they would have slowed
                    worker.call(IMPORT_COMPILE_STACK, (job,), trial_timeout)
                    imports_wanted = False
            elif view.claims and len(view.results) < total and not expired:
                shared.wait()  # their results may end the search, or their failure free room
            else:
                return view.results
            view = shared.view()


def _enqueue_the_rest(study, spaces, view, room: int, progress: _Progress) -> int:
    """Enqueue up to ``room`` configurations that nobody has measured or is measuring, of
    variants still in the race, the best variant's first; return how many.

    On a small space TPE settles on its favourites and suggests them again and again, and the
    asks run out before the budget is met: a 10-configuration space with room for all 10 left
    one unmeasured in 4 of 10 seeds (one process; CI saw it with two sharing a PostgreSQL
    study), and a budget of 8 of those 10 measured 6 or 7 in 19 of 40 seeds. With ``--workers``
    the invoking process then searched what its workers left (seen once in CI). Enqueued
    again even where a trial dropped it unmeasured (``once=False``): the budget was full then.
    """
    taken = view.results.keys() | view.claims.keys()
    best = None if progress.best is None else progress.best[0][0]
    rest = [(name, config) for name, configs in spaces.items() for config in configs
            if (name, studies.config_label(config)) not in taken and progress.pruned(view.results, name) is None]
    rest.sort(key=lambda item: item[0] != best)  # stable: a variant's configurations keep their order
    for name, config in rest[:room]:
        studies.enqueue(study, name, config, once=False)
    return len(rest[:room])


class _Progress:
    """What the results so far say: the best gated time, the variants out of the race, a stall."""

    def __init__(self, budget: Budget, on_best, screen: int = 0):
        # The first ``screen`` results are the variants' defaults, one each: a stall is counted
        # after them (H100, 99 tf32: with 8 variants the defaults alone had "stalled" the search
        # after 2 triton trials).
        self.budget, self.on_best, self.screen = budget, on_best, screen
        self.best: tuple | None = None  # ((variant, label), result) of the best gated candidate
        self.seen = 0
        self.since_gain = 0  # measured trials since the best last gained STALL_GAIN
        self.gemm_floor = None  # cuBLAS's GEMM alone (``_beyond_the_gemm``): asked once, False if it cannot be

    def see(self, results: dict) -> None:
        """Follow ``results`` in the order they were measured (the study's trial order), so a
        resumed search picks up where the stall count and the best stood."""
        if len(results) == self.seen:
            return
        self.seen = len(results)
        best, since_gain, gain_at = None, 0, None
        for index, (key, result) in enumerate(results.items()):
            since_gain += index >= self.screen
            if result.outcome is not Outcome.OK:
                continue
            if best is None or result.timing.median_ms < best[1].timing.median_ms:
                best = (key, result)
            if gain_at is None or best[1].timing.median_ms < gain_at * (1 - STALL_GAIN):
                gain_at, since_gain = best[1].timing.median_ms, 0
        self.since_gain = since_gain
        if best is not None and (self.best is None or best[1].timing.median_ms < self.best[1].timing.median_ms):
            self.best = best
            if self.on_best is not None:
                self.on_best(best[0][0], best[0][1], best[1])

    @property
    def best_ms(self) -> float | None:
        return None if self.best is None else self.best[1].timing.median_ms

    def reach_ms(self) -> float | None:
        """Candidates slower than this are timed, not gated (None: gate every one)."""
        best = self.best_ms
        return None if best is None or self.budget.reach == float("inf") else self.budget.reach * best

    def pruned(self, results: dict, variant: str) -> tuple | None:
        """(key, result) of the variant's best measurement if it is out of the race, else None."""
        best = self.best_ms
        if best is None or self.budget.prune == float("inf") or variant == self.best[0][0]:
            return None
        mine = [(key, r) for key, r in results.items() if key[0] == variant and r.timing is not None]
        if not mine:
            return None
        fastest = min(mine, key=lambda item: item[1].timing.median_ms)
        return fastest if fastest[1].timing.median_ms > self.budget.prune * best else None

    def stalled(self) -> bool:
        return self.budget.stall is not None and self.best is not None and self.since_gain >= self.budget.stall


def _measure_batch(shared, spaces, job, worker, total, size, asks, trial_timeout, bar, progress) -> int:
    """Ask trials until ``size`` of them are new (nobody measured or measures them, and their
    variant is in the race) or ``asks`` are spent, compile the new ones' kernels together, then
    measure them one at a time; return the asks spent.

    Asked ``size`` alone, a batch held as few new candidates as its repeats and pruned variants
    left (TPE as tuned on kb2-99's space with a stand-in worker, four seeds: 0-7 in a batch of 8
    after the first), and a lone new Triton candidate compiles in the worker (``prewarm.begin``):
    the last four trials of kb2-99's search compiled one after another, 14 s of its 69 (H200).
    The asks not yet told wait as running trials, which TPE's constant liar steers away from."""
    batch, new = [], {}
    view = shared.view()
    with timeline.span("ask trials") as said:
        while len(new) < size and len(batch) < max(asks, 1):
            trial = shared.ask()
            name, config = studies.suggest(trial, spaces)
            # The claim other processes read (a configuration spans several params); at once, since
            # they wait for it before deciding about their higher-numbered trials.
            trial.set_user_attr("config", studies.config_label(config))
            batch.append((trial, name, config))
            key = (name, studies.config_label(config))
            if key not in view.results and key not in view.claims and progress.pruned(view.results, name) is None:
                new.setdefault(key, (name, config))
        said.append(f"({len(batch)} asked, {len(new)} new)")
    _prebuild(list(new.values()), job)
    for trial, name, config in batch:
        key = (name, studies.config_label(config))
        view = shared.view(settled_below=trial.number)  # re-read: others may have measured or claimed it meanwhile
        bar.show(view.results)
        progress.see(view.results)
        pruned = progress.pruned(view.results, name)
        if key in view.results:  # a repeat: told the earlier result, measures nothing
            _tell(shared, trial, key, view.results[key], repeat=True)
        elif pruned is not None:  # told the variant's best, so TPE learns to leave it; counts for nothing
            trial.set_user_attr("config", pruned[0][1])
            _tell(shared, trial, pruned[0], pruned[1], repeat=True)
        elif view.claims.get(key, trial.number) < trial.number:
            shared.drop(trial, f"trial {view.claims[key]} of another process measures {key}")
        elif view.ahead_of(trial.number) >= total:
            shared.drop(trial, f"the trial budget ({total}) was reached")
        elif progress.stalled():  # as the search would have stopped, had the batch been smaller
            shared.drop(trial, f"the search stalled ({progress.budget.stall} trials without a gain)")
        else:
            result = (_beyond_the_gemm(progress, job, worker, name, config, trial_timeout)
                      or worker.call("evaluate", (job, Candidate(name, config), progress.reach_ms()), trial_timeout))
            _tell(shared, trial, key, result)
    return len(batch)


def _beyond_the_gemm(progress, job, worker, name, config, trial_timeout) -> TrialResult | None:
    """``out_of_reach``, not built, for a candidate that multiplies through cuBLAS's GEMM
    (``Variant.bounded_by_gemm``) where that GEMM alone is beyond the budget's prune of the best
    gated time: it cannot come within reach (99 fp32 on an H100: torch.compile took 20 s to show
    2.74 ms beside triton's 0.76, and cuBLAS's fp32 GEMM alone takes 2.6). Else None."""
    best, budget = progress.best_ms, progress.budget
    cls = registry.variants(job.problem).get(name)
    if best is None or math.isinf(budget.prune) or cls is None or not cls.bounded_by_gemm(config):
        return None
    if progress.gemm_floor is None:
        progress.gemm_floor = worker.call("gemm_floor", (job,), trial_timeout) or False
    floor = progress.gemm_floor
    if not isinstance(floor, Timing) or floor.median_ms <= budget.prune * best:
        return None
    # Recorded with the bound as its time (the ranking, TPE and ``pruned`` read it as the best this
    # variant could do, which already puts it out of the race), the reason saying so.
    return TrialResult(Outcome.OUT_OF_REACH, f"not built: the time shown is its bound, cuBLAS's GEMM alone, "
                       f"beyond {budget.prune:g}x the best gated ({best:.4g} ms)", timing=floor)


def _build_ahead(spaces: dict[str, list[dict]], job: Job) -> threading.Thread | None:
    """Start building, on a thread, the kernel extensions (nvcc) of every configuration of each
    variant with at most ``AHEAD_MAX_CONFIGS`` in the space, with half the host's build jobs:
    built while the first candidate is measured alone, the batches find them built. Each batch
    built its own before (cold: 3.3-7.1 s each, two or three a search, on the critical path of
    an H100 host's bfloat16-model tunes). A larger space (cuda_templated's 430) is built as its
    trials are asked: a search measures a few dozen. None where nothing needs nvcc (a
    Triton-only space, the CPU)."""
    builds = [build for name, configs in spaces.items() if len(configs) <= AHEAD_MAX_CONFIGS
              for config in configs for build in _kernel_builds(job, name, config)]
    if not builds:
        return None

    def build_them():
        _lower_priority()
        with timeline.span(f"build {len(builds)} kernel extensions ahead (nvcc, or loaded), on a thread"):
            build_many(builds, max(1, build_jobs() // 2))
    thread = threading.Thread(target=build_them, name="autofuse-builds", daemon=True)
    thread.start()
    return thread


def _lower_priority() -> None:
    """Give the calling thread, and the threads and nvcc processes it starts, the host's leftover
    CPU (nice 10): on Linux the nice value is a thread's, inherited by what it starts. The builds
    ahead ran beside the first candidate's compile in the worker, which took 10.6 s instead of
    about 5 (H100 host, gemm_bn train bf16): the first provisional entry came 6-9 s later."""
    try:
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, min(19, os.getpriority(os.PRIO_PROCESS, me) + 10))
    except (AttributeError, OSError):  # not Unix, or not allowed: the builds run as they are
        pass


def _compiled_in(spaces: dict, job: Job) -> bool:
    """Whether a ``compiled`` kind is in the space of a CUDA job: its worker then imports
    torch.compile's stack while the tuner asks and builds (``worker._import_compile_stack``)."""
    variants = registry.variants(job.problem)
    return str(job.device).startswith("cuda") and any(
        getattr(variants.get(name), "kind", None) == "compiled" for name in spaces)


def _is_triton(job: Job, name: str) -> bool:
    return prewarm.is_triton(registry.variants(job.problem).get(name))


def _tell(shared, trial, key, result: TrialResult, repeat: bool = False) -> None:
    attrs = {"config": key[1], "outcome": result.outcome.value, "result": result.to_dict(), "repeat": repeat}
    # An out-of-reach candidate's time is real: TPE learns from it as from a gated one.
    timed = result.outcome in (Outcome.OK, Outcome.OUT_OF_REACH) and result.timing is not None
    shared.tell(trial, result.timing.median_ms if timed else studies.FAILED_VALUE_MS, attrs)


def _prebuild(candidates: list[tuple[str, dict]], job: Job) -> None:
    """Compile the candidates' kernels in parallel: Triton's at each shape the trial runs in the
    compile pool (``prewarm``), nvcc's here meanwhile; a failure is left for the worker to record.
    One after the other they took 11 s of kb2-22's bfloat16-model search on an H100 host, its two
    batches' nvcc builds (5.4-5.6 s each, cold) then the pool's compiles (5.7-5.8 s)."""
    pending = prewarm.begin(job.problem, job.device, job.dtype, job.mode, job.precision,
                            [(name, config, shape) for name, config in candidates
                             for shape in trial_shapes(job, name, config)], job.log)
    builds = [build for name, config in candidates for build in _kernel_builds(job, name, config)]
    if builds:
        with timeline.span(f"build {len(builds)} kernel extensions (nvcc, or loaded)"):
            build_many(builds)
    pending.wait()


def _kernel_builds(job: Job, variant: str, config: dict) -> list:
    """The nvcc builds configuration ``config`` of ``variant`` needs; none where they cannot be
    named (e.g. no nvcc: the worker records why)."""
    try:
        return registry.get_variant(job.problem, variant)(job.precision, **config).kernel_builds(job.device)
    except Exception:  # noqa: BLE001
        return []


def trial_shapes(job: Job, variant: str, config: dict) -> list[dict]:
    """The shapes a trial runs ``config`` at: the job's (timed and gated), then those of the
    gate's cases (``gate.tuner_cases``) where it runs the configuration (``gate.runs_at``)."""
    problem = registry.get_problem(job.problem)
    cls = registry.get_variant(job.problem, variant)
    shapes = [dict(job.shape)]
    for case in tuner_cases(problem, cls, config, job.shape, job.seed):
        if case.shape not in shapes and runs_at(cls, config, case.shape, torch.device(job.device).type):
            shapes.append(dict(case.shape))
    return shapes
