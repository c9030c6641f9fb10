"""Several processes tuning one study: --workers, --storage (journal, SQLite, PostgreSQL), dead processes."""

import collections
import os
import random
import subprocess
import sys
import threading
import time

import optuna
import pytest
from helpers import use_test_plugins

import autofuse
from autofuse.core import plugins
from autofuse.serve.table import DispatchTable
from autofuse.tuning import parallel
from autofuse.tuning import shared_study as shared
from autofuse.tuning.storage import masked, open_storage

PROBLEM = "matmul_gelu_softmax"
VARIANTS = "eager,simplified,knobs"  # only these: an installed plugin's variants would add configurations
CONFIGS = 10  # eager, simplified and knobs k=0..7
POSTGRES_URL = os.environ.get("AUTOFUSE_TEST_POSTGRES_URL")


@pytest.fixture
def knobs(monkeypatch):
    """The `knobs` test variant (eight configurations) registered, here and in subprocesses."""
    use_test_plugins(monkeypatch, "knob_variants")
    yield
    monkeypatch.delenv("AUTOFUSE_PLUGINS")
    plugins.reset_plugin_manager()


def _tune(shape: str, storage: str, table, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "autofuse.cli", "tune", PROBLEM, "--device", "cpu", "--shape", shape,
                             "--storage", storage, "--table", str(table), "--variants", VARIANTS, "--no-progress",
                             "--no-autograd-entry", "--no-batch-classes",  # one entry per table
                             "--budget", "full",  # quick's prune and stall would let CPU timing noise cut the count
                             *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(procs) -> list[str]:
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out
    return outputs


def _study(storage: str, shape: str) -> optuna.Study:
    [name] = [n for n in optuna.get_all_study_names(open_storage(storage)) if f"|{shape}|" in n]
    return optuna.load_study(study_name=name, storage=open_storage(storage))


def _measured_by(study: optuna.Study) -> dict:
    """(variant, config) -> the workers ("host:pid") that measured it, repeats left out."""
    by = collections.defaultdict(list)
    for trial in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,)):
        if not trial.user_attrs["repeat"]:
            by[shared.key_of(trial)].append(trial.user_attrs["worker"])
    return dict(by)


def _check_table(table, study: optuna.Study) -> dict:
    """The table's entry is this study's choice: an OK candidate with its measured configuration."""
    [(_, problem, _, _, entry)] = list(DispatchTable(table).entries())
    assert problem == PROBLEM and entry["study"] == study.study_name
    ok = {shared.key_of(t) for t in study.trials if t.user_attrs.get("outcome") == "ok"}
    label = ",".join(f"{k}={v}" for k, v in entry["params"].items()) or "default"
    assert (entry["variant"], label) in ok, (entry, ok)
    return entry


@pytest.mark.slow
def test_two_tuner_processes_share_one_postgresql_study(knobs, tmp_path):
    if not POSTGRES_URL:
        pytest.skip("AUTOFUSE_TEST_POSTGRES_URL is not set: no PostgreSQL server to tune against (.ci/run starts one)")
    shape = f"batch_size={random.randrange(8, 4096)},in_features=24,out_features=16"  # a study of its own
    for name in optuna.get_all_study_names(open_storage(POSTGRES_URL)):
        if f"|{shape}|" in name:
            optuna.delete_study(study_name=name, storage=open_storage(POSTGRES_URL))
    table = tmp_path / "table.json"
    procs = [_tune(shape, POSTGRES_URL, table, "--seed", str(seed)) for seed in (1, 2)]
    outputs = _finish(procs)
    study = _study(POSTGRES_URL, shape)
    by = _measured_by(study)
    assert len(by) == CONFIGS and all(len(who) == 1 for who in by.values()), by  # all measured, none twice
    assert {int(w.rpartition(":")[2]) for who in by.values() for w in who} == {p.pid for p in procs}
    entry = _check_table(table, study)
    assert any(f"winner: {entry['variant']}" in out for out in outputs), outputs


@pytest.mark.slow
def test_workers_split_the_search_and_the_parent_chooses(knobs, tmp_path):
    shape, storage, table = "batch_size=16,in_features=24,out_features=16", str(tmp_path / "s.journal"), tmp_path / "t.json"
    [proc] = [_tune(shape, storage, table, "--workers", "2", "--trials", "8")]
    [out] = _finish([proc])
    study = _study(storage, shape)
    by = _measured_by(study)
    workers = {w for who in by.values() for w in who}
    assert 8 <= len(by) <= 9 and all(len(who) == 1 for who in by.values()), by  # budget 8, +1 in flight at most
    assert len(workers) == 2 and f"{shared.HOST}:{proc.pid}" not in workers, workers
    _check_table(table, study)
    assert "winner:" in out


def test_workers_on_sqlite_through_the_api(knobs, tmp_path):
    [result] = autofuse.tune(PROBLEM, {"batch_size": 8, "in_features": 24, "out_features": 16}, device="cpu",
                             table=tmp_path / "t.json", storage=f"sqlite:///{tmp_path}/s.db", workers=2,
                             n_trials=4, variants=["knobs"], autograd_entry=False, progress=False)
    assert result.winner["variant"] == "knobs" and sum(row.trials for row in result.rows) >= 4


def _claiming(study, worker: str, alive: float) -> optuna.Trial:
    trial = study.ask()
    trial.suggest_categorical("variant", ["eager"])
    trial.suggest_categorical("eager.config", ["default"])
    trial.set_user_attr("worker", worker)
    trial.set_user_attr("alive", alive)
    return trial


def test_a_live_claim_holds_and_a_dead_one_is_failed(tmp_path):
    study = optuna.create_study(storage=open_storage(str(tmp_path / "s.journal")))
    live = _claiming(study, "elsewhere:1", time.time())
    assert shared.SharedStudy(study).view().claims == {("eager", "default"): live.number}
    silent = _claiming(study, "elsewhere:2", time.time() - shared.GRACE_S - 1)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    crashed = _claiming(study, f"{shared.HOST}:{int(gone.stdout)}", time.time())  # its pid no longer exists
    assert shared.SharedStudy(study).view().claims == {("eager", "default"): live.number}
    states = {t.number: t.state for t in study.trials}
    assert states[silent.number] == states[crashed.number] == optuna.trial.TrialState.FAIL
    assert states[live.number] == optuna.trial.TrialState.RUNNING


def test_an_interrupted_search_leaves_no_running_trial(tmp_path):
    study = optuna.create_study(storage=open_storage(str(tmp_path / "s.journal")))
    with pytest.raises(KeyboardInterrupt), shared.SharedStudy(study) as mine:
        mine.ask()
        raise KeyboardInterrupt
    [trial] = study.trials
    assert trial.state == optuna.trial.TrialState.FAIL and "stopped" in trial.user_attrs["skipped"]


@pytest.mark.parametrize("url", ["journal:///{tmp}/a.journal", "journal:{tmp}/b.journal", "{tmp}/c.journal",
                                 "sqlite:///{tmp}/d.db"])
def test_storage_forms_open(url, tmp_path):
    storage = open_storage(url.format(tmp=tmp_path))
    optuna.create_study(study_name="x", storage=storage).optimize(lambda t: t.suggest_float("a", 0, 1), n_trials=1)
    assert len(optuna.load_study(study_name="x", storage=open_storage(url.format(tmp=tmp_path))).trials) == 1


@pytest.mark.parametrize("url", ["http://example.com/db", "sqlite://", "journal:", "studies.db", "redis://host/0"])
def test_bad_storage_urls_name_the_accepted_forms(url):
    with pytest.raises(autofuse.StorageError, match="postgresql://user:password@host"):
        open_storage(url)


def test_storage_errors_hide_the_password_and_say_what_to_install(monkeypatch):
    assert "s3cret" not in masked("postgresql://me:s3cret@db.example:5432/tune")
    with pytest.raises(autofuse.StorageError, match="cannot be opened") as error:
        open_storage("postgresql://me:s3cret@127.0.0.1:1/tune")  # nothing listens on port 1
    assert "s3cret" not in str(error.value)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "psycopg2" else real(name, *a))
    with pytest.raises(autofuse.StorageError, match=r"autofuse\[distributed\]"):
        open_storage("postgresql://me@127.0.0.1/tune")


def test_the_cli_reports_a_bad_storage_url(capsys):
    from autofuse.cli import main

    assert main(["tune", PROBLEM, "--device", "cpu", "--shape", "batch_size=8,in_features=16,out_features=16",
                 "--storage", "ftp://nowhere"]) == 2
    assert "not a form autofuse accepts" in capsys.readouterr().err


def test_a_decision_waits_for_lower_trials_to_be_labelled(tmp_path):
    """Two processes (two SharedStudy views of one study) suggest the same configuration; the
    higher-numbered trial must see the lower one's claim even when it reads first."""
    study = optuna.create_study(storage=open_storage(str(tmp_path / "s.journal")))
    with shared.SharedStudy(study) as first, shared.SharedStudy(study) as second:
        low = first.ask()
        low.suggest_categorical("variant", ["eager"])  # suggested, not yet labelled
        high = second.ask()
        high.suggest_categorical("variant", ["eager"])
        high.set_user_attr("config", "default")
        assert second.view().claims == {} and second.view().unlabelled == [low.number]
        threading.Timer(0.3, low.set_user_attr, ("config", "default")).start()
        started = time.monotonic()
        view = second.view(settled_below=high.number)
        assert view.claims == {("eager", "default"): low.number} and time.monotonic() - started >= 0.25
        assert first.view(settled_below=low.number).claims == {("eager", "default"): high.number}  # nothing below


def test_an_unlabelled_trial_without_a_sign_of_life_is_failed(tmp_path, monkeypatch):
    study = optuna.create_study(storage=open_storage(str(tmp_path / "s.journal")))
    stray = study.ask()  # as if its process died between asking and labelling, on another host
    monkeypatch.setattr(shared, "GRACE_S", 0.0)
    with shared.SharedStudy(study) as mine:
        assert mine.view(settled_below=stray.number + 1).unlabelled == []
    assert study.trials[0].state == optuna.trial.TrialState.FAIL


@pytest.mark.parametrize("preset, expected", [(None, str(max(1, (os.cpu_count() or 1) // 3))), ("5", "5")])
def test_workers_share_the_cores_for_nvcc(monkeypatch, preset, expected):
    """Three CPU workers each get cores / 3 nvcc jobs, unless the user set AUTOFUSE_BUILD_JOBS."""
    if preset is None:
        monkeypatch.delenv("AUTOFUSE_BUILD_JOBS", raising=False)
    else:
        monkeypatch.setenv("AUTOFUSE_BUILD_JOBS", preset)
    envs = []

    class Finished:
        returncode = 0

        def __init__(self, argv, env):
            envs.append(env)

        def poll(self):
            return 0

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(parallel.subprocess, "Popen", Finished)
    spec = {"settings": {"device": "cpu", "seed": 0}, "plan": {}}
    parallel.search(spec, 3, optuna.create_study(), total=4, label="test", progress=False, command=["search"])
    assert [env["AUTOFUSE_BUILD_JOBS"] for env in envs] == [expected] * 3
