"""``autofuse.tune``: search every admitted variant's configurations, keep the fastest correct one.

Per shape: an Optuna study proposes candidates, a worker subprocess builds, times and gates
each (a crash, hang or wrong answer is a recorded outcome), then the best few are re-timed
interleaved with eager in one run and the simplest one within the noise of the fastest wins.
The winner for inference, and the best autograd-capable variant for calls that need
gradients, are written to the dispatch table. Each new best gated candidate is written as a
provisional entry as soon as it is found (``_Provisional``), so a caller has a fused kernel
long before the search ends; the ``budget`` (``autofuse.tuning.budget``) bounds the search.
What the candidates print (Inductor, Triton, nvcc) goes to a log per key, not the terminal. Several processes may search one study at once
(``workers``, or machines sharing ``storage``): see ``search``, ``shared`` and ``parallel``;
each of the ``workers`` processes runs this module (``main``), which calls ``search_only``.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import pathlib
import random
import sys
import time
from collections.abc import Mapping, Sequence

import torch

from autofuse.core import registry
from autofuse.core.precision import check_dtype, check_precision, parse_dtype
from autofuse.core.problem import Problem
from autofuse.errors import AutofuseError, InputError, TableError
from autofuse.serve.dispatch import bad_entry
from autofuse.serve.table import DispatchKey, DispatchTable, current_fingerprint, fingerprint_key, shape_key
from autofuse.tuning import batch_classes, parallel, placement, timeline
from autofuse.tuning import study as studies
from autofuse.tuning.budget import Budget
from autofuse.tuning.budget import budget as get_budget
from autofuse.tuning.outcome import Outcome
from autofuse.tuning.search import search
from autofuse.tuning.selection import Row, candidate_records, choose
from autofuse.tuning.storage import open_storage
from autofuse.tuning.worker import Candidate, Job, Worker

MAX_DEFAULT_TRIALS = 40
# Configurations of one variant the autograd entry gates with gradients, fastest forward first,
# before it gives that variant up: a forward's best tiles can compile into a kernel whose stored
# tensors are wrong where its result is right (Triton 3.6 on an H100: 22's tf32 kernel with W by TMA
# passed the forward gate and stored logits that put x's gradient 0.37-0.8 off at 1024×8192²).
GRAD_TRIES = 3
# Another configuration of a variant whose trial median is within this of the variant's best is
# re-timed beside it in the final choice (``_near_ties``).
NEAR_TIE = 1.05


@dataclasses.dataclass
class TuneResult:
    problem: str
    shape: dict
    fingerprint: dict
    key: DispatchKey
    winner: dict | None  # the table entry written, None if nothing passed
    grad_winner: dict | None
    rows: list[Row]
    table_path: str
    seconds: float = 0.0  # wall time of this key's tune
    first_entry_s: float | None = None  # seconds until a provisional entry was written, if one was
    log_path: str | None = None  # what the candidates printed
    entries_s: float | None = None  # with batch classes: seconds until the key's own entries were written
    classes_only: bool = False  # only batch classes were added: winner and grad_winner are the table's


@dataclasses.dataclass(frozen=True)
class Plan:
    """How each shape is searched; what ``--workers`` processes receive (less ``backend``) as JSON."""

    n_trials: int | None
    timeout: float | None
    trial_timeout: float
    variants: list[str] | None
    storage: str | None  # the URL, for worker processes
    workers: int = 1
    autograd_entry: bool = True
    progress: bool = True
    budget: str = "quick"
    batch_classes: bool = True  # also gate and time the shape family's other batch classes
    classes_only: bool = False  # no search: add the batch classes of the entries the table holds
    rungs: tuple[int, ...] | None = None  # race only these batch classes (None: all of them)
    backend: object = dataclasses.field(default=None, compare=False)  # the opened storage

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "backend"}


def tune(problem: str, shape: Mapping[str, int] | None = None, *, device: str | None = None,
         dtype: str = "float32", precision: str = "fp32", mode: str | None = None,
         n_trials: int | None = None, timeout: float | None = None, table=None, seed: int | None = None,
         trial_timeout: float = 600.0, variants: list[str] | None = None, autograd_entry: bool = True,
         storage=None, workers: int = 1, progress: bool = True, budget: str = "quick",
         batch_classes: bool = True, classes_only: bool = False,
         rungs: Sequence[int] | None = None) -> list[TuneResult]:
    """Tune ``problem`` at ``shape`` (default: each of its default shapes, which on the CPU must be
    CPU-sized: ``placement``); see the module docstring.

    ``timeout`` bounds each shape's search in seconds (finishing the trial in flight);
    ``trial_timeout`` bounds one candidate. ``storage`` is a study storage URL
    (``autofuse.tuning.storage``; default: a journal file under $AUTOFUSE_HOME) that other processes
    and machines may share; ``workers`` processes search each shape at once, one per GPU (or
    all on the CPU), before this process makes the final choice. ``budget`` is "quick" or "full"
    (``autofuse.tuning.budget``). With ``batch_classes`` each shape's entries are also gated and timed
    at the family's other batch classes (``autofuse.tuning.batch_classes``), each written as an entry
    of its own. ``classes_only`` searches nothing: it adds the batch classes of the entries the table
    already holds for each shape's key (a key tuned before batch classes existed, or without them),
    the rungs' races alone, which the search at B would have been followed by anyway. ``rungs``
    races only the batch classes at those batches (each one of every shape's rungs), leaving the
    others as the table holds them: e.g. the ones the runtime replays as CUDA graphs, raced again
    after a change to how replays run. Returns one TuneResult per shape.
    """
    prob = registry.get_problem(problem)
    _check_limits(n_trials, timeout, trial_timeout)
    resolved = placement.resolve_device(device)
    shapes = placement.shapes_to_run(prob, shape, resolved, asked=device)
    settings = _settings(prob, resolved, dtype, precision, mode, seed)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InputError(f"workers must be an int >= 1, got {workers!r}")
    url = os.fspath(storage) if isinstance(storage, (str, os.PathLike)) else None
    if workers > 1 and storage is not None and url is None:
        raise InputError(f"workers > 1 need a storage URL that their processes can open too, got a {type(storage).__name__}")
    get_budget(budget)  # an unknown budget name fails here, before any work
    if classes_only and not (batch_classes and prob.batch_dim is not None):
        raise InputError(f"classes_only adds batch classes: it needs batch_classes on and a problem with a batch "
                         f"dimension ({prob.name}: {prob.batch_dim})")
    rungs = _check_rungs(prob, shapes, settings["mode"], settings["precision"], rungs, batch_classes)
    plan = Plan(n_trials, timeout, trial_timeout, variants, url, workers, autograd_entry, progress, budget,
                bool(batch_classes), bool(classes_only), rungs, backend=open_storage(storage))  # a bad URL fails here
    table = table if isinstance(table, DispatchTable) else DispatchTable(table)
    with Worker() as worker:
        worker.spawn()  # its start overlaps the first key's setup
        if classes_only:
            return [_add_classes(prob, s, settings, worker, table, plan) for s in shapes]
        return [_tune_shape(prob, s, settings, worker, table, plan) for s in shapes]


def _check_rungs(prob: Problem, shapes: list[dict], mode: str, precision: str, rungs,
                 classes_on: bool) -> tuple[int, ...] | None:
    """``rungs`` as a tuple, once each is a batch class of every shape to tune (before any work)."""
    if rungs is None:
        return None
    if not classes_on:
        raise InputError("rungs picks batch classes to race: it needs batch_classes on")
    if isinstance(rungs, (str, int)) or not rungs or not all(isinstance(b, int) and not isinstance(b, bool)
                                                             for b in rungs):
        raise InputError(f"rungs must be a non-empty list of batch sizes, got {rungs!r}")
    for shape in shapes:
        ladder = batch_classes.rung_batches(prob, shape, mode, precision)
        if missing := sorted(set(rungs) - set(ladder)):
            raise InputError(f"{prob.name} {prob.shape_str(shape)} has no batch class at {missing}: its rungs "
                             f"are {ladder}")
    return tuple(sorted(set(rungs)))


def _check_limits(n_trials, timeout, trial_timeout) -> None:
    """Refuse limits that measure nothing: 0 or -1 trials once ended 'no variant passed the
    correctness gate' with a -1/-1 progress bar, a trial timeout of 0 killed every candidate."""
    if n_trials is not None and (isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1):
        raise InputError(f"n_trials (--trials) must be an int >= 1, got {n_trials!r}")
    for name, flag, seconds in (("timeout", "--timeout", timeout), ("trial_timeout", "--trial-timeout", trial_timeout)):
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0):
            raise InputError(f"{name} ({flag}) must be a number > 0, got {seconds!r}")


def _settings(prob: Problem, device: str, dtype, precision, mode, seed) -> dict:
    """The job's settings; ``device`` is ``placement.resolve_device``'s."""
    check_precision(precision)
    check_dtype(parse_dtype(dtype), precision)
    if mode is None:
        mode = "train" if prob.mode_sensitive else "any"
    if mode not in (("train", "eval") if prob.mode_sensitive else ("any", "train", "eval")):
        raise InputError(f"mode must be 'train' or 'eval', got {mode!r}")
    mode = mode if prob.mode_sensitive else "any"
    seed = random.randrange(2**31) if seed is None else int(seed)
    return {"device": device, "dtype": dtype, "precision": precision, "mode": mode, "seed": seed}


def _spaces(prob: Problem, shape: dict, settings: dict, only: list[str] | None, budget: str = "quick",
            keep: list[tuple[str, dict]] = ()) -> dict[str, list[dict]]:
    """Valid configurations of every variant admitted for this key, by variant name: under a
    budget that does not search every configuration, each variant's ``quick_configs`` and the
    valid ones of ``keep`` (what the table holds for the key, measured again before a retune may
    replace it: ``studies.enqueue_starting_points``)."""
    device_type = torch.device(settings["device"]).type
    dtype = parse_dtype(settings["dtype"])
    table = registry.variants(prob.name)
    if only:
        unknown = [name for name in only if name not in table]
        if unknown:
            raise InputError(f"{prob.name} has no variant(s) {unknown}; known: {sorted(table)}")
        table = {name: table[name] for name in only}
    spaces, narrowed = {}, not get_budget(budget).every_config
    for name, variant in table.items():
        if variant.admits(device_type, dtype, settings["precision"], autograd=False) is None:
            configs = variant.configs_for(shape, device_type, settings["precision"])
            if narrowed:
                kept = [c for n, c in keep if n == name and c in configs]
                configs = variant.quick_configs(configs)
                configs += [c for c in kept if c not in configs]
            if configs:
                spaces[name] = configs
    if not spaces:
        raise InputError(f"no variant of {prob.name} is admitted on {device_type} at {settings['precision']} {settings['dtype']}")
    return spaces


def _key_setup(prob, shape, settings, plan, table: DispatchTable | None = None
               ) -> tuple[dict, Job, dict, DispatchKey, list[tuple[str, dict]]]:
    """The shape's search space, job, fingerprint, (forward) dispatch key, and the (variant,
    configuration) pairs ``table`` holds for the key (in the space whatever the budget)."""
    # Read in this process: a rerun whose trials are all done then never starts a worker.
    fingerprint = current_fingerprint(settings["device"])
    key = DispatchKey(settings["dtype"], settings["precision"], settings["mode"], autograd=False)
    recorded = _recorded_configs(table, fingerprint, prob, shape, key)
    spaces = _spaces(prob, shape, settings, plan.variants, plan.budget, recorded)
    job = Job(prob.name, shape, settings["device"], settings["dtype"], settings["precision"], settings["mode"],
              settings["seed"], log=str(log_path(prob.name, shape, settings)))
    return spaces, job, fingerprint, key, recorded


def _open(prob, shape, settings, plan, table: DispatchTable | None = None):
    """The shape's search space, job, fingerprint, dispatch key, study name and study.

    A new study measures first what ``table`` holds for the key (see ``enqueue_starting_points``).
    """
    spaces, job, fingerprint, key, recorded = _key_setup(prob, shape, settings, plan, table)
    # Nothing process-specific (such as the seed) goes into the name: cooperating processes share the study.
    name = "|".join([prob.name, shape_key(shape), key.to_str(), fingerprint_key(fingerprint),
                     studies.space_hash(registry.variants(prob.name), spaces)])
    study = studies.open_study(name, settings["seed"], plan.backend)
    studies.enqueue_starting_points(study, _likely_fastest_first(spaces, registry.variants(prob.name)), recorded)
    return spaces, job, fingerprint, key, name, study


def _likely_fastest_first(spaces: dict, variants: dict) -> dict:
    """``spaces`` with the most specialised kinds first (triton, then the CUDA kinds, cuBLAS's
    epilogue, simplified, eager), ``compiled`` after the hand-written ones: the defaults are
    measured in this order, so the first gated candidate, which becomes the provisional entry, is
    most often already a fused kernel near the final winner, and ``compiled``'s first call, which
    compiles a whole graph, comes after them."""
    order = sorted(spaces, key=lambda name: (variants[name].kind == "compiled", -variants[name].rank()))
    return {name: spaces[name] for name in order}


def _total(plan: Plan, spaces: dict) -> int:
    size = sum(len(c) for c in spaces.values())
    return plan.n_trials if plan.n_trials is not None else min(get_budget(plan.budget).max_trials, size)


def log_path(problem: str, shape: dict, settings: dict) -> pathlib.Path:
    """Where a key's candidates' output goes: ``$AUTOFUSE_HOME/logs/<problem>-<shape>-<key>.log``."""
    home = pathlib.Path(os.environ.get("AUTOFUSE_HOME") or "~/.cache/autofuse").expanduser()
    name = "-".join([problem, "_".join(str(v) for v in shape.values()), settings["dtype"], settings["precision"],
                     settings["mode"]])
    return home / "logs" / f"{name}.log"


def _tune_shape(prob, shape, settings, worker, table, plan: Plan) -> TuneResult:
    started = time.monotonic()
    with timeline.span(f"setup {prob.name} {prob.shape_str(shape)} (spaces, device, study)"):
        spaces, job, fingerprint, key, name, study = _open(prob, shape, settings, plan, table)
    budget = get_budget(plan.budget)
    total = _total(plan, spaces)
    before = len(studies.finished(study))
    label, timeout = f"{prob.name} {prob.shape_str(shape)}", plan.timeout
    # Read before the search: its provisional entries replace what the key held.
    held_before = _entries_before(table, fingerprint, prob, shape, key)
    provisional = _Provisional(table, fingerprint, prob, shape, key, name, started, spaces)
    if plan.workers > 1:
        parallel.search({"problem": prob.name, "shape": shape, "settings": settings, "plan": plan.to_json(), "study": name},
                        plan.workers, study, total, label, plan.progress, command=[sys.executable, "-m", "autofuse.tuning.tuner"])
        # What they left undone (a worker died, say) this process searches for itself.
        timeout = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
    with timeline.span(f"search {label} ({key.to_str()})"):
        results = search(study, spaces, job, worker, total, timeout, plan.trial_timeout,
                         plan.progress and plan.workers == 1, label, budget, provisional)
    rows = _rows(results, registry.variants(prob.name), spaces)
    by_speed = _timed_by_speed(results, spaces)
    n_done = len(studies.finished(study))
    recorded = _recorded(table, fingerprint, prob, shape, key, plan.autograd_entry)
    # Nothing new was measured and the table holds this study's choice: keep it (a rerun of a tuned
    # shape costs no device time).
    kept = (n_done == before and recorded is not None and recorded[0].get("study") == name
            and recorded[0].get("trials") == n_done and not recorded[0].get("provisional"))
    rescue = None  # where the results go if the table cannot be read
    if kept:
        winner, grad_winner = recorded
    else:
        ahead = (functools.partial(batch_classes.compile_ahead, prob, shape, job, key, fingerprint, table, plan=plan,
                                   searched=batch_classes.Searched(results, spaces, name, False))
                 if plan.batch_classes and prob.batch_dim is not None else None)
        with timeline.span(f"choice and autograd entry {label}"):
            winner, grad_winner = _finish(prob, job, rows, worker, plan.trial_timeout, plan.autograd_entry, n_done,
                                          name, by_speed, budget, _near_ties(results, rows, spaces), ahead)
        for note in _replaced_untried(held_before, prob, shape, winner, grad_winner):
            print(f"autofuse: {note}")
        rescue = _record(table, fingerprint, prob, shape, key, winner, grad_winner)
    entries_s = None  # with batch classes: when the key's own entries were written, before the classes' work
    if plan.batch_classes and winner is not None and prob.batch_dim is not None:
        entries_s = time.monotonic() - started
        with timeline.span(f"batch classes {label}"):
            items = batch_classes.cover(prob, shape, job, key, fingerprint, table, (winner, grad_winner), worker,
                                        plan, batch_classes.Searched(results, spaces, name, kept), label)
        _record_items(table, items, rescue)
    return TuneResult(prob.name, shape, fingerprint, key, winner, grad_winner, rows, str(table.path),
                      time.monotonic() - started, provisional.first_s, job.log, entries_s)


def _add_classes(prob, shape, settings, worker, table, plan: Plan) -> TuneResult:
    """``classes_only``: the batch classes of the entries ``table`` holds for the shape's key, raced
    as after a search (``batch_classes.cover``), the ranking being the one the entry recorded (each
    variant's best at B, ``batch_classes.recorded_ranking``): each rung races the entry's
    configuration, the next fastest recorded, the small-batch seeds, the simplest variants and, for
    a winner restricted to where it was gated, its variant at the next stricter precision."""
    started = time.monotonic()
    spaces, job, fingerprint, key, _ = _key_setup(prob, shape, settings, plan, table)
    label = f"{prob.name} {prob.shape_str(shape)}"
    recorded = _recorded(table, fingerprint, prob, shape, key, plan.autograd_entry)
    if recorded is None:
        alone = plan.autograd_entry and _recorded(table, fingerprint, prob, shape, key, False) is not None
        raise InputError(f"{label} ({key.to_str()}): " + (
            "the table holds the forward entry but no autograd entry beside it: add the forward's batch classes "
            "alone (--no-autograd-entry), or tune the key" if alone else
            "the table holds no usable entry for this key to add batch classes to: tune it first "
            "(without --batch-classes-only)"))
    variants = registry.variants(prob.name)
    for entry in recorded:
        if entry is not None and entry.get("source_hash") != variants[entry["variant"]].source_hash():
            raise InputError(f"{label}: the table's {entry['variant']} entry is stale (its source changed since "
                             "it was measured): tune the key again, batch classes and all")
    winner, grad_winner = recorded
    items = batch_classes.cover(prob, shape, job, key, fingerprint, table, (winner, grad_winner), worker, plan,
                                batch_classes.Searched({}, spaces, winner.get("study") or label, False,
                                                       batch_classes.recorded_ranking(winner, spaces)), label)
    _record_items(table, items)
    return TuneResult(prob.name, shape, fingerprint, key, winner, grad_winner, [], str(table.path),
                      time.monotonic() - started, None, job.log, None, classes_only=True)


class _Provisional:
    """``on_best`` of the search: each new best gated candidate becomes the key's table entry at
    once, marked ``provisional``, so a module serving the key (in this process or another: the
    table is watched, ``autofuse.serve.table_watch``) runs a fused kernel while the search goes
    on. It never replaces a finished entry that measured faster (``DispatchTable.record_provisional``);
    the tune's final choice replaces it."""

    def __init__(self, table, fingerprint, prob, shape, key, study_name, started, spaces):
        self.table, self.fingerprint, self.prob, self.shape, self.key = table, fingerprint, prob, shape, key
        self.study_name, self.started, self.labels = study_name, started, studies.space_labels(spaces)
        self.first_s: float | None = None

    def __call__(self, variant: str, label: str, result) -> None:
        params = self.labels.get((variant, label))
        if params is None:  # measured under another space (an earlier session's study)
            return
        timing = result.timing
        entry = {"variant": variant, "params": params, "median_ms": timing.median_ms, "p20_ms": timing.p20_ms,
                 "p80_ms": timing.p80_ms, "eager_ms": None, "speedup": None, "error": result.error,
                 "provisional": True, "step": "forward", "study": self.study_name,
                 "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "source_hash": registry.variants(self.prob.name)[variant].source_hash()}
        try:
            written = self.table.record_provisional(self.fingerprint, self.prob.name, shape_key(self.shape),
                                                    self.key.to_str(), entry)
        except TableError:
            return  # a corrupt table is reported when the final result is recorded
        if written and self.first_s is None:
            self.first_s = time.monotonic() - self.started


def search_only(problem: str, shape: dict, settings: dict, plan: dict, study: str) -> None:
    """One ``--workers`` process: search ``study`` alongside the others; the caller chooses."""
    prob = registry.get_problem(problem)
    plan = Plan(**plan)
    plan = dataclasses.replace(plan, backend=open_storage(plan.storage))  # None: the default journal
    spaces, job, _, _, name, opened = _open(prob, prob.normalize_shape(shape), settings, plan)
    if name != study:
        raise InputError(f"this worker's study {name!r} differs from its parent's {study!r}: its device "
                         f"({settings['device']}) or variants differ, so its timings would not be comparable")
    total = _total(plan, spaces)
    with Worker() as worker:
        search(opened, spaces, job, worker, total, plan.timeout, plan.trial_timeout, False, name, get_budget(plan.budget))


def _recorded_entries(table, fingerprint, prob, shape, key) -> tuple[dict | None, dict | None]:
    """The forward and autograd entries ``table`` holds for the key (None where it has none).
    Raises TableError for a table that cannot be read."""
    lookup = lambda k: table.lookup(fingerprint_key(fingerprint), prob.name, shape_key(shape), k)  # noqa: E731
    return lookup(key), lookup(dataclasses.replace(key, autograd=True))


def _recorded(table, fingerprint, prob, shape, key, autograd_entry):
    """(entry, autograd entry) already in the table for this key, or None."""
    try:
        entry, grad = _recorded_entries(table, fingerprint, prob, shape, key)
    except TableError:
        return None
    grad = grad if autograd_entry else None
    if entry is None or (autograd_entry and grad is None):
        return None
    if any(e is not None and bad_entry(e) for e in (entry, grad)):
        return None  # edited by hand, say: measured and written again (test_cli)
    return entry, grad


def _recorded_configs(table, fingerprint, prob, shape, key) -> list[tuple[str, dict]]:
    """(variant, params) of the forward and autograd entries ``table`` holds for the key."""
    if table is None:
        return []
    try:
        entries = _recorded_entries(table, fingerprint, prob, shape, key)
    except TableError:
        return []  # a corrupt table is reported when the result is recorded
    return [(entry["variant"], dict(entry.get("params") or {})) for entry in entries
            if entry is not None and not bad_entry(entry)]  # a bad one is replaced, not read (test_cli)


def _rows(results: dict, variants: dict, spaces: dict) -> list[Row]:
    """Each variant's best configuration: its fastest gated one, else its fastest timed one (out of
    reach, kept so the autograd entry may still gate it), else its most informative failure."""
    rows, labels = [], studies.space_labels(spaces)
    for name in spaces:
        mine = {label: r for (v, label), r in results.items() if v == name}
        ok = {label: r for label, r in mine.items() if r.outcome is Outcome.OK}
        timed = ok or {label: r for label, r in mine.items() if r.outcome is Outcome.OUT_OF_REACH}
        if timed:
            label = min(timed, key=lambda lab: timed[lab].timing.median_ms)
            rows.append(Row(name, variants[name].rank(), labels[(name, label)], timed[label], len(mine)))
        elif mine:
            rows.append(Row(name, variants[name].rank(), {}, next(iter(mine.values())), len(mine)))
        else:
            rows.append(Row(name, variants[name].rank(), {}, None, 0))
    return rows


def _timed_by_speed(results: dict, spaces: dict) -> dict[str, list[dict]]:
    """Each variant's timed configurations (gated, or out of the forward's reach), fastest first."""
    ranked, labels = {}, studies.space_labels(spaces)
    for name in spaces:
        timed = sorted((r.timing.median_ms, label) for (v, label), r in results.items()
                       if v == name and r.outcome in (Outcome.OK, Outcome.OUT_OF_REACH))
        ranked[name] = [labels[(name, label)] for _, label in timed if (name, label) in labels]
    return ranked


def _serves_gradients(variant, job) -> bool:
    """Whether ``variant`` may serve the key's autograd entry (a variant may serve a bfloat16 model's
    forward only, gemm_bn's cublas_epilogue)."""
    return variant.admits(torch.device(job.device).type, parse_dtype(job.dtype), job.precision, autograd=True) is None


def _near_ties(results: dict, rows: list[Row], spaces: dict) -> list[Row]:
    """Each variant's other gated configurations whose trial median is within ``NEAR_TIE`` of its
    best's, fastest first: re-timed beside it, since one trial's timing drifts with the moment it
    was taken. (kb2-99 at fp32, H200, one seed: the persistent TMA tile measured first, while the
    compile pool's processes started on the GPU, and lost to a non-persistent one at 0.748 ms;
    unseeded it had won at 0.727, and the rungs at 512 and 2048, re-timing both side by side,
    chose it again.)"""
    near, labels = [], studies.space_labels(spaces)
    for row in rows:
        if not row.ok:
            continue
        best, reach = studies.config_label(row.params), NEAR_TIE * row.result.timing.median_ms
        mine = sorted((r.timing.median_ms, label) for (v, label), r in results.items()
                      if v == row.variant and label != best and r.outcome is Outcome.OK and r.timing.median_ms <= reach)
        near += [Row(row.variant, row.rank, labels[(row.variant, label)], results[(row.variant, label)], row.trials)
                 for _, label in mine if (row.variant, label) in labels]
    return near


def _finish(prob, job, rows, worker, trial_timeout, autograd_entry, n_trials, study_name, by_speed=None,
            budget: Budget | None = None, near: list[Row] = (), on_winner=None):
    """Re-time the best few interleaved (``near`` beside ``rows``: other configurations of a
    variant close to its best), choose, and (optionally) choose among autograd-capable
    ones, each gated with gradients and timed as a training step (``autofuse.tuning.timed_call``). A variant
    whose fastest forward configuration fails with gradients is gated at its next fastest ones
    (``GRAD_TRIES`` in all, from ``by_speed``) before it is given up. With a ``budget``, only
    variants whose forward is within its ``grad_reach`` of the best forward take part. Where a
    ``near`` configuration wins, it replaces its variant's row in ``rows`` (the summary, the
    entry's candidates and the autograd entry's first try read it). ``on_winner`` hears of the
    forward's winner before the autograd entry is measured (``batch_classes.compile_ahead``)."""
    variants = registry.variants(prob.name)
    winner = choose(job, rows, worker, trial_timeout, autograd=False, near=near)
    if winner is not None:
        for i, row in enumerate(rows):
            if row.variant == winner["variant"] and row.params != winner["params"]:
                rows[i] = next(r for r in near if r.variant == row.variant and r.params == winner["params"])
        if on_winner is not None:
            on_winner(winner)
    grad_winner, grad_rows = None, []
    # Out-of-reach rows take part too: a slower forward can still make the faster training step.
    capable = [row for row in rows if row.result is not None and row.result.timing is not None
               and row.result.outcome in (Outcome.OK, Outcome.OUT_OF_REACH)
               and _serves_gradients(variants[row.variant], job)]
    if capable and budget is not None:
        fastest = min(row.result.timing.median_ms for row in capable)
        capable = [row for row in capable if row.result.timing.median_ms <= budget.grad_reach * fastest]
    if autograd_entry:
        for row in capable:
            tries = [row.params] + [c for c in (by_speed or {}).get(row.variant, []) if c != row.params]
            first = None  # the fastest configuration's failure, reported if none passes
            for params in tries[:GRAD_TRIES]:
                checked = worker.call("evaluate", (job, Candidate(row.variant, params, autograd=True)), trial_timeout)
                # Without the forward's re-timing (``final``, ``eager_ms``): a row the autograd
                # race does not re-time would record its forward's time as its training step's.
                checked_row = dataclasses.replace(row, params=params, result=checked, final=None, eager_ms=None)
                if checked.outcome is Outcome.OK:
                    grad_rows.append(checked_row)
                    break
                first = first or checked_row
            else:
                grad_rows.append(first)
        grad_winner = choose(job, grad_rows, worker, trial_timeout, autograd=True)
    stamp = {"trials": n_trials, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "seed": job.seed, "study": study_name}
    # Every variant's best, so `autofuse bench` can measure them all again; the autograd
    # entry's times are training steps (forward + backward), its candidates' too.
    for entry, timed, step in ((winner, rows, "forward"), (grad_winner, grad_rows, "forward+backward")):
        if entry is not None:
            entry.update(stamp, step=step, source_hash=variants[entry["variant"]].source_hash(), candidates=candidate_records(timed))
    return winner, grad_winner


def _entries_before(table, fingerprint, prob, shape, key) -> tuple[dict | None, dict | None]:
    """The forward and autograd entries the key held before this tune (None, None if unreadable)."""
    try:
        return _recorded_entries(table, fingerprint, prob, shape, key)
    except TableError:
        return None, None


def _replaced_untried(recorded, prob, shape, winner, grad_winner) -> list[str]:
    """What to say where this tune replaces an entry (``recorded``, as the key held them before the
    tune) whose winner it did not run and that had measured faster: the new entry stands (this
    tune's side-by-side choice), but a retune with a narrower ``--variants`` should not slow a key
    down unannounced (it did: gemm_bn's 16384 bf16 training forward, compiled 1.011 ms, replaced by
    triton's 1.102 on an H100)."""
    notes = []
    for previous, new, what in zip(recorded, (winner, grad_winner), ("entry", "autograd entry")):
        if previous and new and bad_entry(previous):
            notes.append(f"{prob.name} {shape_key(shape)} {what}: the recorded one was unusable "
                         f"({bad_entry(previous)}) and is replaced by {new['variant']}")
            continue
        if not previous or not new or previous["variant"] in new.get("candidates", {}):
            continue
        was, now = previous.get("median_ms"), new.get("median_ms")
        if isinstance(was, (int, float)) and isinstance(now, (int, float)) and was < now:
            notes.append(f"{prob.name} {shape_key(shape)} {what}: {previous['variant']} ({was:.4g} ms, tuned "
                         f"{str(previous.get('date', '?'))[:10]}) was not among the variants tuned now and is "
                         f"replaced by {new['variant']} ({now:.4g} ms); tune with --variants including "
                         f"{previous['variant']} to compare them side by side")
    return notes


def _record(table: DispatchTable, fingerprint, prob, shape, key, winner, grad_winner) -> DispatchTable | None:
    items = [(fingerprint, prob.name, shape_key(shape), k.to_str(), entry)
             for k, entry in ((key, winner), (dataclasses.replace(key, autograd=True), grad_winner)) if entry is not None]
    return _record_items(table, items)


def _record_items(table: DispatchTable, items: list[tuple], rescue: DispatchTable | None = None) -> DispatchTable | None:
    """Write ``items`` into ``table``, or where it cannot be read into ``rescue`` (made beside it if
    None, and returned: the tune's later items go there too)."""
    if not items:
        return rescue
    try:
        table.record_many(items)
        return rescue
    except TableError as exc:
        # The table on disk is someone's record: leave it intact, keep this run's result beside it.
        if rescue is None:
            stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
            rescue = DispatchTable(table.path.with_name(f"{table.path.stem}.rescued-{stamp}.json"))
            print(f"autofuse: {exc}\nautofuse: this run's results were written to {rescue.path} instead")
        rescue.record_many(items)
        return rescue


def main(argv: list[str]) -> int:
    """A ``--workers`` process (``python -m autofuse.tuning.tuner SPEC``): ``search_only(**SPEC)``."""
    try:
        search_only(**json.loads(argv[0]))
    except AutofuseError as exc:
        print(f"autofuse worker {os.getpid()}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
