"""The quick budget: time first and gate only what can win, prune hopeless variants, stop a stalled
search, write a provisional entry at once, keep third-party output off the terminal; and modules
pick up table changes while they serve."""

import json
import pathlib
import subprocess
import sys

import optuna
import pytest
import torch
from helpers import use_test_plugins

import autofuse
from autofuse.core import plugins
from autofuse.serve.table import DispatchKey, DispatchTable, current_fingerprint, fingerprint_key, shape_key
from autofuse.serve.table_watch import WATCH
from autofuse.tuning import evaluate, search
from autofuse.tuning import study as studies
from autofuse.tuning.budget import BUDGETS, budget
from autofuse.tuning.outcome import Candidate, Job, Outcome, TrialResult
from autofuse.tuning.timing import Timing

SWEEP = pathlib.Path(__file__).parent / "data" / "sweep-matmul_gelu_softmax.json"
SMALL = {"batch_size": 16, "in_features": 48, "out_features": 40}
# A small space on which TPE repeats itself: kb2-99's test plugin "knobs" beside eager and simplified.
KNOBS = {"eager": [{}], "simplified": [{}], "knobs": [{"k": k} for k in range(8)]}
KNOB_TIMES = {("eager", "{}"): 1.2, ("simplified", "{}"): 0.86} | {
    ("knobs", json.dumps({"k": k})): 0.9 + 0.5 * (k % 3) for k in range(8)}


class ReachReplay:
    """Answers ``evaluate`` from recorded times as the worker does: out of reach past ``reach_ms``
    (timed, not gated), else gated; counts both."""

    def __init__(self, times: dict):
        self.times = times  # (variant, json of params) -> median ms
        self.timed = self.gated = 0

    def call(self, op, payload, timeout):
        job, candidate, reach_ms = payload
        self.timed += 1
        ms = self.times[(candidate.variant, json.dumps(candidate.params, sort_keys=True))]
        timing = Timing(ms, ms * 0.99, ms * 1.01, 10)
        if reach_ms is not None and ms > reach_ms:
            return TrialResult(Outcome.OUT_OF_REACH, "replayed", timing=timing)
        self.gated += 1
        return TrialResult(Outcome.OK, None, 1e-7, timing)


@pytest.fixture(autouse=True)
def _no_builds(monkeypatch):
    monkeypatch.setattr(search, "_prebuild", lambda candidates, job: None)


@pytest.fixture(scope="module")
def sweep():
    data = json.loads(SWEEP.read_text())
    times = {("cuda_templated", json.dumps(r["params"], sort_keys=True)): r["timing"]["median_ms"] for r in data["configs"]}
    return data, times


def _replay(spaces, times, seed, which, total=40):
    study = studies.open_study("replay", seed, optuna.storages.InMemoryStorage())
    studies.enqueue_starting_points(study, spaces)
    worker = ReachReplay(times)
    job = Job("matmul_gelu_softmax", SMALL, "cuda", "float32", "fp32", "any", seed)
    found = []
    results = search.search(study, spaces, job, worker, total, None, 60.0, False, "replay", BUDGETS[which],
                            on_best=lambda v, label, r: found.append((v, label, r.timing.median_ms)))
    best = min(r.timing.median_ms for r in results.values() if r.outcome is Outcome.OK)
    return best, worker, found


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_quick_reaches_the_sweep_best_gating_a_fraction_of_what_it_times(sweep, seed):
    data, times = sweep
    spaces = {"cuda_templated": [r["params"] for r in data["configs"]]}
    sweep_best = min(times.values())
    best, worker, found = _replay(spaces, times, seed, "quick", total=BUDGETS["quick"].max_trials)
    assert best <= 1.03 * sweep_best, f"seed {seed}: {best:.4f} ms against the sweep's {sweep_best:.4f}"
    assert worker.timed <= BUDGETS["quick"].max_trials
    assert worker.gated < worker.timed / 2, f"gated {worker.gated} of {worker.timed}: the gate should be the exception"
    assert [ms for _, _, ms in found] == sorted((ms for _, _, ms in found), reverse=True), "on_best: each a new best"


def test_full_gates_every_candidate(sweep):
    data, times = sweep
    spaces = {"cuda_templated": [r["params"] for r in data["configs"]][:60]}
    _, worker, _ = _replay(spaces, times, 5, "full", total=20)
    assert worker.gated == worker.timed == 20


@pytest.mark.parametrize("seed", range(6))
def test_a_budget_that_covers_the_space_measures_all_of_it(seed):
    """TPE comes back to its favourites on a small space; a budget that holds every
    configuration still measures every one (CI once saw 9 of 10 measured)."""
    _, worker, _ = _replay(KNOBS, KNOB_TIMES, seed, "full", total=10)
    assert worker.timed == 10


@pytest.mark.parametrize("total", [7, 8, 9])
@pytest.mark.parametrize("seed", range(6))
def test_a_budget_below_the_space_is_met_when_tpe_repeats_itself(seed, total):
    """Once TPE's asks run out on repeats, the search enqueues what is left, up to the budget
    (it stopped short in 62 of 120 such searches: seeds 0-39, budgets 7-9 of 10)."""
    _, worker, _ = _replay(KNOBS, KNOB_TIMES, seed, "full", total=total)
    assert worker.timed == total


def test_a_hopeless_variant_is_drawn_no_more_and_a_stalled_search_stops():
    fast = [{"t": t} for t in range(30)]
    slow = [{"s": s} for s in range(30)]
    times = {("fast", json.dumps(c)): 1.0 + c["t"] * 1e-4 for c in fast}  # flat: nothing gains 1%
    times |= {("slow", json.dumps(c)): 50.0 for c in slow}
    _, worker, _ = _replay({"fast": fast, "slow": slow}, times, 0, "quick", total=40)
    assert worker.timed <= 2 + BUDGETS["quick"].stall, f"timed {worker.timed}: the search should stall out"


def test_the_variants_defaults_do_not_count_towards_a_stall():
    """Eight variants' defaults, none better than the first by 1%, then one variant's space: the
    search goes on past the defaults (with many variants they alone had stalled it)."""
    spaces = {f"v{i}": [{"c": 0}] for i in range(8)}
    spaces["v0"] = [{"c": c} for c in range(30)]
    times = {(f"v{i}", json.dumps({"c": 0})): 1.0 + 0.001 * i for i in range(8)}
    times |= {("v0", json.dumps({"c": c})): 1.0 + 1e-4 * c for c in range(1, 30)}
    _, worker, _ = _replay(spaces, times, 0, "quick", total=24)
    assert worker.timed >= 8 + BUDGETS["quick"].stall, f"timed {worker.timed}: the defaults counted as a stall"


def test_pruning_leaves_a_variant_after_its_first_measurement():
    fast = [{"t": t} for t in range(40)]
    slow = [{"s": s} for s in range(40)]
    times = {("fast", json.dumps(c)): 1.0 - c["t"] * 0.02 for c in fast}  # keeps improving: no stall
    times |= {("slow", json.dumps(c)): 50.0 for c in slow}
    study = studies.open_study("prune", 0, optuna.storages.InMemoryStorage())
    spaces = {"fast": fast, "slow": slow}
    studies.enqueue_starting_points(study, spaces)
    worker = ReachReplay(times)
    job = Job("matmul_gelu_softmax", SMALL, "cuda", "float32", "fp32", "any", 0)
    results = search.search(study, spaces, job, worker, 30, None, 60.0, False, "prune", BUDGETS["quick"])
    slow_measured = [key for key in results if key[0] == "slow"]
    assert len(slow_measured) == 1, f"the slow variant was measured {len(slow_measured)} times"


def test_evaluate_times_first_and_gates_only_within_reach():
    job = Job("matmul_gelu_softmax", SMALL, "cpu", "float32", "fp32", "any", 0)
    state = {}
    far = evaluate.evaluate(state, job, Candidate("eager", {}), 1e-9)
    assert far.outcome is Outcome.OUT_OF_REACH and far.timing is not None and far.error is None
    near = evaluate.evaluate(state, job, Candidate("eager", {}), 1e9)
    assert near.outcome is Outcome.OK and near.error is not None  # gated: its error was measured
    assert evaluate.evaluate(state, job, Candidate("eager", {})).outcome is Outcome.OK  # no reach: gated


def test_the_budget_name_is_checked():
    assert budget("quick") is BUDGETS["quick"]
    with pytest.raises(autofuse.InputError, match="budget must be one of"):
        budget("fastest")
    with pytest.raises(autofuse.InputError, match="budget must be one of"):
        autofuse.tune("matmul_gelu_softmax", SMALL, device="cpu", budget="fastest")


def test_quick_searches_compiled_in_mode_default_static_only_and_full_in_every_mode(tmp_path, with_compiled):
    """The other modes and symbolic sizes compiled for far longer and never won
    (``CompiledVariant.quick_configs``);
    a configuration the table holds for the key is searched whatever the budget, so a quick retune
    measures it again before it may replace it."""
    from autofuse.core import registry
    from autofuse.tuning import tuner

    settings = {"device": "cpu", "dtype": "float32", "precision": "fp32", "mode": "any", "seed": 1}
    prob, shape = registry.get_problem("matmul_gelu_softmax"), dict(SMALL)
    modes = lambda budget, keep=(): {(c["mode"], c["dynamic"])  # noqa: E731
                                     for c in tuner._spaces(prob, shape, settings, None, budget, keep)["compiled"]}
    assert modes("quick") == {("default", False)}
    assert modes("full") == {(m, d) for m in ("default", "max-autotune-no-cudagraphs") for d in (False, True)}
    held = {"mode": "max-autotune-no-cudagraphs", "dynamic": False}
    assert modes("quick", [("compiled", held)]) == {("default", False), ("max-autotune-no-cudagraphs", False)}
    assert modes("quick", [("compiled", {"mode": "no-such-mode", "dynamic": False})]) == {("default", False)}
    # The table holds it: tune's study starts with it.
    table = DispatchTable(tmp_path / "t.json")
    fp, key = current_fingerprint("cpu"), DispatchKey("float32", "fp32", "any", False)
    table.record(fp, prob.name, shape_key(shape), key, {"variant": "compiled", "params": held, "median_ms": 1.0})
    plan = tuner.Plan(None, None, 60.0, None, None)
    spaces, *_, recorded = tuner._key_setup(prob, shape, settings, plan, table)
    assert ("compiled", held) in recorded and held in spaces["compiled"]


# -- provisional entries ---------------------------------------------------------------------
def _entry(ms, provisional, study="s1"):
    return {"variant": "eager", "params": {}, "median_ms": ms, "study": study,
            **({"provisional": True} if provisional else {})}


@pytest.mark.parametrize("previous, new_ms, written", [
    (None, 1.0, True),
    (_entry(0.5, provisional=False), 1.0, False),  # a finished, faster entry stands
    (_entry(2.0, provisional=False), 1.0, True),  # a finished, slower one is improved on
    (_entry(0.5, provisional=True), 1.0, True),  # a provisional one is always replaced
    (_entry(2.0, provisional=False, study="s2"), 1.0, False),  # the same study's final choice stands (a rerun)
])
def test_a_provisional_entry_never_replaces_a_finished_faster_one(tmp_path, previous, new_ms, written):
    table = DispatchTable(tmp_path / "t.json")
    fp, key = current_fingerprint("cpu"), DispatchKey("float32", "fp32", "any", False)
    if previous is not None:
        table.record(fp, "matmul_gelu_softmax", "b=1", key, previous)
    new = _entry(new_ms, True, study="s2")
    assert table.record_provisional(fp, "matmul_gelu_softmax", "b=1", key, new) is written
    now = table.lookup(fingerprint_key(fp), "matmul_gelu_softmax", "b=1", key)
    assert now["median_ms"] == (new_ms if written else previous["median_ms"])


def test_a_tune_writes_a_provisional_entry_then_its_final_one(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFUSE_HOME", str(tmp_path))
    seen = []
    real = DispatchTable.record_provisional

    def spy(self, *args):
        written = real(self, *args)
        seen.append((args[-1]["variant"], written, self.lookup(fingerprint_key(args[0]), *args[1:4])))
        return written

    monkeypatch.setattr(DispatchTable, "record_provisional", spy)
    [result] = autofuse.tune("matmul_gelu_softmax", SMALL, device="cpu", table=tmp_path / "t.json", seed=1,
                             variants=["eager", "simplified"], autograd_entry=False, progress=False)
    assert seen and seen[0][1] and seen[0][2]["provisional"] is True
    assert result.first_entry_s is not None and result.first_entry_s <= result.seconds
    final = DispatchTable(tmp_path / "t.json").lookup(fingerprint_key(result.fingerprint), "matmul_gelu_softmax",
                                                       shape_key(SMALL), result.key)
    assert final is not None and "provisional" not in final and final["trials"] >= 1


def test_what_candidates_print_goes_to_the_key_log_not_the_terminal(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("AUTOFUSE_HOME", str(tmp_path))
    use_test_plugins(monkeypatch, "noisy_variants")
    try:
        [result] = autofuse.tune("matmul_gelu_softmax", SMALL, device="cpu", table=tmp_path / "t.json", seed=2,
                                 variants=["noisy"], autograd_entry=False, progress=False)
    finally:
        monkeypatch.delenv("AUTOFUSE_PLUGINS")
        plugins.reset_plugin_manager()
    out, err = capfd.readouterr()
    assert "NOISY-VARIANT-OUTPUT" not in out + err
    log = pathlib.Path(result.log_path).read_text()
    assert "NOISY-VARIANT-OUTPUT stdout" in log and "NOISY-VARIANT-OUTPUT fd2" in log


# -- modules follow the table ------------------------------------------------------------------
def _write_entry(table_path, variant):
    fp = current_fingerprint("cpu")
    DispatchTable(table_path).record(fp, "matmul_gelu_softmax", "batch_size=4,in_features=6,out_features=5",
                                     DispatchKey("float32", "fp32", "any", False),
                                     {"variant": variant, "params": {}, "median_ms": 1.0})


def test_a_serving_module_picks_up_a_table_change(tmp_path):
    table = tmp_path / "t.json"
    _write_entry(table, "eager")
    model = autofuse.get_module("matmul_gelu_softmax", 6, 5, table=table).requires_grad_(False)
    x = torch.rand(4, 6)
    model(x)
    assert model.dispatch_info(x)["variant"] == "eager"
    _write_entry(table, "simplified")
    WATCH.check()  # what the watcher thread does every AUTOFUSE_TABLE_POLL seconds
    assert model.dispatch_info(x)["variant"] == "simplified"


def test_a_module_in_another_process_picks_up_what_this_one_writes(tmp_path):
    table = tmp_path / "t.json"
    _write_entry(table, "eager")
    script = f"""
import os, sys, time, torch, autofuse
model = autofuse.get_module("matmul_gelu_softmax", 6, 5, table={str(table)!r}).requires_grad_(False)
x = torch.rand(4, 6)
model(x)
print(model.dispatch_info(x)["variant"], flush=True)
sys.stdin.readline()  # the parent has rewritten the table
deadline = time.monotonic() + 20
while model.dispatch_info(x)["variant"] == "eager" and time.monotonic() < deadline:
    model(x)
    time.sleep(0.05)
print(model.dispatch_info(x)["variant"], flush=True)
"""
    env = {**__import__("os").environ, "AUTOFUSE_TABLE_POLL": "0.1"}
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        assert proc.stdout.readline().strip() == "eager"
        _write_entry(table, "simplified")
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "simplified"
    finally:
        proc.kill()
        proc.wait()


def test_a_provisional_entry_passes_the_replaced_entrys_records_on_to_the_final_one(tmp_path):
    """A retune of some variants keeps the other variants' records (``carried``): a provisional
    entry written between the old entry and the new one must not drop them."""
    table = DispatchTable(tmp_path / "t.json")
    fp, key = current_fingerprint("cpu"), DispatchKey("float32", "fp32", "any", False)
    old = {**_entry(2.0, provisional=False, study="s1"), "date": "2026-11-01",
           "candidates": {"cuda_tiled": {"params": {"tile": 32}, "outcome": "ok", "median_ms": 3.0}}}
    table.record(fp, "matmul_gelu_softmax", "b=1", key, old)
    table.record_provisional(fp, "matmul_gelu_softmax", "b=1", key, _entry(1.0, True, study="s2"))
    table.record(fp, "matmul_gelu_softmax", "b=1", key, {**_entry(0.9, False, study="s2"),
                                                          "candidates": {"eager": {"outcome": "ok", "median_ms": 0.9}}})
    final = table.lookup(fingerprint_key(fp), "matmul_gelu_softmax", "b=1", key)
    assert set(final["candidates"]) == {"eager", "cuda_tiled"}
    assert final["candidates"]["cuda_tiled"]["carried"] == "2026-11-01"


class _FloorWorker:
    def __init__(self, floor_ms):
        self.floor_ms, self.asked = floor_ms, 0

    def call(self, op, payload, timeout):
        from autofuse.tuning.timing import Timing

        assert op == "gemm_floor"
        self.asked += 1
        return Timing(self.floor_ms, self.floor_ms, self.floor_ms, 5)


def test_a_candidate_bounded_by_cublas_is_not_built_where_that_gemm_alone_is_out_of_reach(with_compiled):
    """torch.compile's default mode multiplies through cuBLAS: with cuBLAS's GEMM alone beyond the
    quick budget's prune of the best gated time it is recorded out of reach, not built (its bound
    as its time, asked of the worker once); within it, or under full, or for max-autotune, it is built."""
    from autofuse.tuning import search
    from autofuse.tuning.outcome import Job, Outcome, TrialResult
    from autofuse.tuning.timing import Timing

    job = Job("matmul_gelu_softmax", {"batch_size": 8, "in_features": 16, "out_features": 12}, "cpu", "float32",
              "fp32", "any", 0)
    progress = search._Progress(BUDGETS["quick"], None)
    worker = _FloorWorker(2.6)
    default = {"mode": "default", "dynamic": False}
    assert search._beyond_the_gemm(progress, job, worker, "compiled", default, 60) is None  # no best yet
    progress.best = (("triton", "x"), TrialResult(Outcome.OK, timing=Timing(0.76, 0.76, 0.76, 5)))
    skipped = search._beyond_the_gemm(progress, job, worker, "compiled", default, 60)
    assert skipped.outcome is Outcome.OUT_OF_REACH and skipped.timing.median_ms == 2.6
    assert skipped.reason.startswith("not built")
    assert search._beyond_the_gemm(progress, job, worker, "compiled", {"mode": "max-autotune", "dynamic": False}, 60) is None
    assert search._beyond_the_gemm(progress, job, worker, "eager", {}, 60) is None  # built: cheap, and not marked
    assert worker.asked == 1
    progress.best = (("triton", "x"), TrialResult(Outcome.OK, timing=Timing(1.5, 1.5, 1.5, 5)))
    assert search._beyond_the_gemm(progress, job, worker, "compiled", default, 60) is None  # 2.6 < 2 x 1.5
    full = search._Progress(BUDGETS["full"], None)
    full.best = progress.best
    assert search._beyond_the_gemm(full, job, _FloorWorker(100.0), "compiled", default, 60) is None


def test_the_worker_times_the_gemm_alone_where_the_problems_floor_is_a_gemm():
    from autofuse.tuning import evaluate
    from autofuse.tuning.outcome import Job

    shape = {"batch_size": 8, "in_features": 16, "out_features": 12}
    floor = evaluate.gemm_floor({}, Job("matmul_gelu_softmax", shape, "cpu", "float32", "bf16", "any", 0, budget_ms=5))
    assert floor.median_ms > 0 and floor.reps >= 1
    # 51's algebra removes the GEMM (its floor is memory): no GEMM bounds it
    assert evaluate.gemm_floor({}, Job("gemm_avgpool_gelu_residual", shape, "cpu", "float32", "fp32", "any", 0)) is None
