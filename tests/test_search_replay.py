"""The search, replayed on the CPU from an exhaustive sweep recorded on the GPU.

tests/data/sweep-matmul_gelu_softmax.json holds every valid cuda_templated configuration of
kb2-99 at (1024, 8192, 8192), gated and timed by the tuning worker on an H100
(benchmarks/gpu/tuning_quality.py). A replay worker answers trials from it, so the real study,
sampler and search loop run here exactly as on the device, minus the GPU.
"""

import json
import pathlib

import optuna
import pytest

from autofuse.tuning import search
from autofuse.tuning import study as studies
from autofuse.tuning.outcome import Outcome, TrialResult
from autofuse.tuning.worker import Job

SWEEP = pathlib.Path(__file__).parent / "data" / "sweep-matmul_gelu_softmax.json"
TRIALS = 40


class ReplayWorker:
    """Answers ``evaluate`` from the recorded sweep, and counts the calls."""

    def __init__(self, data):
        self.results = {json.dumps(r["params"], sort_keys=True): TrialResult.from_dict(r) for r in data["configs"]}
        self.calls = 0

    def call(self, op, payload, timeout):
        assert op == "evaluate"
        self.calls += 1
        return self.results[json.dumps(payload[1].params, sort_keys=True)]


@pytest.fixture(scope="module")
def sweep():
    data = json.loads(SWEEP.read_text())
    assert all(r["outcome"] == Outcome.OK.value for r in data["configs"]), "the recorded sweep should be all ok"
    best = min(r["timing"]["median_ms"] for r in data["configs"])
    return data, best


def _search(data, seed, enqueue_defaults):
    """Best time found by a 40-trial search, and how many distinct candidates it measured."""
    study = studies.open_study("replay", seed, optuna.storages.InMemoryStorage())
    spaces = {"cuda_templated": [r["params"] for r in data["configs"]]}
    if enqueue_defaults:
        studies.enqueue_starting_points(study, spaces)
    job = Job(data["problem"], data["shape"], "cuda", "float32", "fp32", "any", seed)
    worker = ReplayWorker(data)
    results = search.search(study, spaces, job, worker, TRIALS, None, 60.0, False, "replay")
    assert worker.calls == len(results) <= TRIALS, "a candidate was measured twice or the budget overrun"
    return min(r.timing.median_ms for r in results.values()), len(results)


@pytest.fixture(autouse=True)
def _no_builds(monkeypatch):
    monkeypatch.setattr(search, "_prebuild", lambda candidates, job: None)  # nothing to compile in a replay


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_tune_reaches_the_sweep_best_within_40_trials(sweep, seed):
    data, best = sweep
    found, measured = _search(data, seed, enqueue_defaults=True)
    assert found <= 1.03 * best, f"seed {seed}: best found {found:.4f} ms, sweep best {best:.4f} ms"
    assert measured == TRIALS


def test_the_search_finds_the_best_without_the_default_head_start(sweep):
    """The default happens to be the sweep's best, so the test above is easy; from random
    starts, per-parameter TPE still lands within 3% in most seeds. (The earlier scheme, one
    categorical over all 430 configurations, did so in 3 of 12 seeds: random search.)"""
    data, best = sweep
    ratios = [_search(data, seed, enqueue_defaults=False)[0] / best for seed in range(6)]
    assert sum(r <= 1.03 for r in ratios) >= 4, f"best found / sweep best per seed: {[round(r, 3) for r in ratios]}"


def test_a_suggested_combination_is_projected_onto_the_nearest_valid_configuration():
    configs = [{"bm": 128, "bk": 8}, {"bm": 64, "bk": 8}, {"bm": 64, "bk": 32}, {"bm": 32, "bk": 16}]
    axes = studies.parameter_axes(configs)
    assert axes == {"bm": [32, 64, 128], "bk": [8, 16, 32]}
    assert studies.nearest_config(configs, axes, {"bm": 64, "bk": 32}) == {"bm": 64, "bk": 32}  # valid: itself
    assert studies.nearest_config(configs, axes, {"bm": 128, "bk": 32}) == {"bm": 64, "bk": 32}  # one step away
    assert studies.nearest_config(configs, axes, {"bm": 32, "bk": 8}) == {"bm": 64, "bk": 8}  # a tie: the first listed


def test_every_suggestion_is_a_valid_configuration(sweep):
    data, _ = sweep
    configs = [r["params"] for r in data["configs"]]
    study = studies.open_study("valid", 0, optuna.storages.InMemoryStorage())
    for _ in range(30):
        trial = study.ask()
        _, config = studies.suggest(trial, {"cuda_templated": configs})
        assert config in configs
        study.tell(trial, 1.0)
