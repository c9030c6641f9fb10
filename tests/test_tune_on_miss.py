"""Tune on miss: an untuned key is tuned in a background process and swapped in; the caller never waits."""

import json
import os
import subprocess
import sys
import time

import filelock
import pytest
import torch
from helpers import SMALL, init_args

import autofuse
from autofuse.serve import tune_on_miss as background
from autofuse.serve.dispatch import CallKey
from autofuse.serve.tune_on_miss import TuneOnMiss

B, IN, OUT = SMALL
PROBLEM = "gemm_avgpool_gelu_residual"


def module_for(budget, table, problem=PROBLEM, precision="fp32"):
    args, kwargs = init_args(problem, B, IN, OUT)
    return autofuse.get_module(problem, *args, table=table, precision=precision, tune_on_miss=budget, **kwargs)


def wait_for(condition, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.05)


def test_first_call_is_served_at_once_and_the_tuned_winner_is_swapped_in(tmp_path):
    table = tmp_path / "table.json"
    module, x = module_for(TuneOnMiss(trials=2, timeout_s=60, poll_s=0.2), table), torch.randn(B, IN)
    with torch.no_grad():
        start = time.monotonic()
        module(x)
        first_call = time.monotonic() - start
    module(x)  # the grad key misses too: the same tune writes its entry
    info = module.dispatch_info(x)
    # The tune is a new Python process importing torch (seconds): it cannot have finished.
    assert first_call < 0.5 and not table.exists(), first_call
    assert info["source"] == "no entry: reference" and "tune_on_miss" in info, info
    slowest, calls, deadline = 0.0, 0, time.monotonic() + 120
    with torch.no_grad():
        # The tune writes a provisional entry first, then its final one: wait for the final.
        while module.dispatch_info(x)["source"] != "tuned" or module.dispatch_info(x)["entry"].get("provisional"):
            start = time.monotonic()
            module(x)
            slowest, calls = max(slowest, time.monotonic() - start), calls + 1
            assert time.monotonic() < deadline, f"no switch within 120 s; {module.dispatch_info(x)}"
        info = module.dispatch_info(x)
    assert table.exists() and info["entry"]["trials"] >= 1, info
    assert calls > 10 and slowest < 0.5, (calls, slowest)  # served all along, never waiting on the tune
    wait_for(lambda: module.dispatch_info(x)["source"] == "tuned", 10, "the grad key's switch")
    wait_for(lambda: module.dispatch_info(x)["tune_on_miss"].startswith("done"), 30, "the tune's end")


@pytest.fixture
def fake_tunes(monkeypatch, tmp_path):
    """Background tunes that only sleep, logging their start and end, so bounds can be watched."""
    events = tmp_path / "events"
    script = ("import sys, time, pathlib; f = pathlib.Path(sys.argv[1]); name = sys.argv[2]; "
              "f.open('a').write(f'start {name}\\n'); time.sleep(1.0); f.open('a').write(f'end {name}\\n')")

    def command(spec):
        return [sys.executable, "-c", script, str(events), f"{spec['problem_name']}/{spec['precision']}"]
    monkeypatch.setattr(background, "tune_command", command)
    return events


def test_one_tune_per_key_and_at_most_concurrent_at_once(fake_tunes, tmp_path):
    budget = TuneOnMiss(trials=1, timeout_s=30, concurrent=1, poll_s=0.05)
    table, x = tmp_path / "table.json", torch.randn(B, IN)
    first, second = module_for(budget, table), module_for(budget, table)
    other = module_for(budget, table, precision="tf32")
    first(x), second(x), other(x)
    with torch.no_grad():
        first(x)  # the no-grad key of the same tune key: no second tune
    tunes = [t for m in (first, second) for t in m._autofuse.tunes.values()]
    assert len(tunes) == 3 and len({id(t) for t in tunes}) == 1  # grad and no-grad keys, two modules: one tune
    assert all(type(key) is CallKey for m in (first, second) for key in m._autofuse.tunes)
    wait_for(lambda: fake_tunes.exists() and fake_tunes.read_text().count("end") == 2, 30, "both fake tunes")
    events = fake_tunes.read_text().split()
    assert events == ["start", f"{PROBLEM}/fp32", "end", f"{PROBLEM}/fp32", "start", f"{PROBLEM}/tf32", "end", f"{PROBLEM}/tf32"]
    wait_for(lambda: first.dispatch_info(x)["tune_on_miss"].startswith("done"), 10, "the status")
    assert other.dispatch_info(x)["source"] == "no entry: reference"  # the fakes wrote nothing


def test_a_key_another_process_is_tuning_is_not_tuned_twice(tmp_path):
    directory = tmp_path / "tune-on-miss"
    directory.mkdir()
    spec = {"name": "k", "dir": str(directory), "concurrent": 1, "timeout": 5}
    with filelock.FileLock(str(directory / "k.lock")):
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "autofuse.serve.tune_on_miss", json.dumps(spec)],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == background.EXIT_BUSY, done.stdout + done.stderr
    assert "tuning this key" in done.stdout and time.monotonic() - start < 30


def test_the_environment_turns_it_on_with_a_budget(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOFUSE_TUNE_ON_MISS", "1")
    monkeypatch.setenv("AUTOFUSE_TUNE_TRIALS", "7")
    monkeypatch.setenv("AUTOFUSE_TUNE_TIMEOUT", "90")
    assert module_for(None, tmp_path / "t.json")._autofuse.budget == TuneOnMiss(trials=7, timeout_s=90.0)
    assert module_for(False, tmp_path / "t.json")._autofuse.budget is None
    monkeypatch.setenv("AUTOFUSE_TUNE_ON_MISS", "0")
    assert module_for(None, tmp_path / "t.json")._autofuse.budget is None
    monkeypatch.setenv("AUTOFUSE_TUNE_CONCURRENT", "two")
    with pytest.raises(autofuse.InputError, match="AUTOFUSE_TUNE_CONCURRENT must be an integer > 0, got 'two'"):
        module_for(True, tmp_path / "t.json")
    monkeypatch.setenv("AUTOFUSE_TUNE_ON_MISS", "sometimes")
    with pytest.raises(autofuse.InputError, match="AUTOFUSE_TUNE_ON_MISS"):
        module_for(None, tmp_path / "t.json")
    with pytest.raises(autofuse.InputError, match="trials must be a number > 0, got trials=0"):
        TuneOnMiss(trials=0)


def test_without_it_a_miss_starts_nothing(monkeypatch, tmp_path):
    monkeypatch.delenv("AUTOFUSE_TUNE_ON_MISS", raising=False)
    module, x = module_for(None, tmp_path / "t.json"), torch.randn(B, IN)
    module(x)
    assert not module._autofuse.tunes and "tune_on_miss" not in module.dispatch_info(x)
    assert not (tmp_path / "autofuse-home" / "tune-on-miss").exists() or not os.listdir(tmp_path / "autofuse-home" / "tune-on-miss")
