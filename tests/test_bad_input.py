"""The `autofuse` command answers a user's mistake in one line (exit 2, no traceback), before any
work starts; issue 32 lists each case and the traceback or silent run it gave."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import PLUGIN_DIR, record

from autofuse.bench import run as bench_run
from autofuse.cli import main
from autofuse.core import plugins
from autofuse.tuning import tuner

SMALL = "batch_size=5,in_features=33,out_features=17"  # kb2-22's names


def one_line_error(capsys, *expected: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("autofuse: error: ") and err.count("\n") == 1, err
    for text in expected:
        assert text in err, err
    return err


@pytest.fixture
def no_work(monkeypatch):
    """A tune or bench that gets as far as measuring a shape fails the test at once, instead of
    spending minutes on a shape it should have refused."""
    def refuse(*args, **kwargs):
        raise AssertionError("work started on a shape that should have been refused")
    monkeypatch.setattr(tuner, "_tune_shape", refuse)
    monkeypatch.setattr(bench_run, "_bench_shape", refuse)


# -- export -------------------------------------------------------------------------

def test_export_creates_missing_folders_like_tune(tmp_path, capsys):
    out = tmp_path / "new" / "folder" / "model_new.py"
    assert main(["export", "gemm_bn", "--kernelbench", str(out)]) == 0
    assert "class ModelNew" in out.read_text()


def test_bench_markdown_into_a_missing_folder_creates_it(tmp_path, capsys):
    # A FileNotFoundError traceback after the whole bench had run, like export's (issue 32).
    target = tmp_path / "new" / "BENCH.md"
    assert main(["bench", "kb2-22", "--shape", SMALL, "--device", "cpu", "--no-compile", "--rounds", "1",
                 "--out", str(tmp_path / "out"), "--markdown", str(target)]) == 0
    assert "matmul_clamp_lse_mish" in target.read_text()


def test_export_to_a_path_that_cannot_be_written_says_why(capsys):
    assert main(["export", "gemm_bn", "--kernelbench", "/proc/x.py"]) == 2
    one_line_error(capsys, "/proc/x.py")


def test_export_over_a_table_with_an_unparsable_key_warns_and_writes(tmp_path, capsys):
    # Its summary parsed every dispatch key and raised ValueError on a hand-edited one (issue 32).
    table, out = tmp_path / "t.json", tmp_path / "model_new.py"
    record("matmul_clamp_lse_mish", 5, 33, 17, path=table)
    table.write_text(table.read_text().replace("autograd=false", "autograd=maybe"))
    assert main(["export", "kb2-22", "--kernelbench", str(out), "--table", str(table)]) == 0
    assert "autograd=maybe" in capsys.readouterr().out and out.exists()


# -- devices and shapes ---------------------------------------------------------------

@pytest.mark.parametrize("command", ["tune", "bench"])
def test_a_cuda_device_without_cuda_is_one_line(command, monkeypatch, capsys, no_work):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([command, "kb2-22", "--shape", SMALL, "--device", "cuda"]) == 2
    one_line_error(capsys, "cuda", "is_available() is False")


@pytest.mark.parametrize("command", ["tune", "bench"])
def test_a_device_torch_does_not_know_is_one_line(command, capsys, no_work):
    assert main([command, "kb2-22", "--shape", SMALL, "--device", "gpu"]) == 2  # torch.device raised RuntimeError
    one_line_error(capsys, "cpu, cuda or cuda:N", "'gpu'")


@pytest.mark.parametrize("command", ["tune", "bench"])
def test_without_a_gpu_the_gpu_sized_default_shapes_are_refused_naming_a_cpu_sized_one(command, monkeypatch, capsys,
                                                                                       no_work):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([command, "gemm_bn"]) == 2
    one_line_error(capsys, "no CUDA GPU", "16384", "--device cpu --shape batch_size=37,in_features=1000,out_features=777")


@pytest.mark.parametrize("command", ["tune", "bench"])
def test_on_the_cpu_asked_for_the_default_shapes_are_refused_too(command, capsys, no_work):
    assert main([command, "gemm_bn", "--device", "cpu"]) == 2
    err = one_line_error(capsys, "--shape batch_size=37,in_features=1000,out_features=777")
    assert "no CUDA GPU" not in err


# -- trials ---------------------------------------------------------------------------

@pytest.mark.parametrize("trials", ["0", "-1"])
def test_fewer_than_one_trial_is_refused_and_nothing_claims_a_table(trials, tmp_path, capsys, no_work):
    table = tmp_path / "t.json"
    assert main(["tune", "kb2-22", "--shape", SMALL, "--device", "cpu", "--trials", trials, "--table", str(table)]) == 2
    one_line_error(capsys, f"(--trials) must be an int >= 1, got {trials}")
    assert not table.exists()


@pytest.mark.parametrize("command, option, value, says", [
    ("tune", "--timeout", "-5", "timeout (--timeout) must be a number > 0, got -5.0"),
    ("tune", "--timeout", "0", "timeout (--timeout) must be a number > 0, got 0.0"),
    ("tune", "--trial-timeout", "0", "trial_timeout (--trial-timeout) must be a number > 0, got 0.0"),
    ("bench", "--rounds", "0", "rounds (--rounds) must be an int >= 1, got 0"),
])
def test_other_counts_and_durations_out_of_range_are_refused(command, option, value, says, capsys, no_work):
    # --trial-timeout 0 killed every candidate and ended 'no variant passed the correctness gate';
    # --rounds 0 raised StatisticsError from the timing.
    assert main([command, "kb2-22", "--shape", SMALL, "--device", "cpu", option, value]) == 2
    one_line_error(capsys, says)


def test_a_tune_where_nothing_passes_names_no_table_as_written(tmp_path, capsys, monkeypatch):
    # It printed "table: PATH" under "nothing was recorded", a path that was never written (issue 32).
    monkeypatch.setattr(tuner, "_tune_shape", lambda prob, shape, settings, worker, table, plan: tuner.TuneResult(
        prob.name, shape, {"kind": "cpu", "name": "x", "cores": 1, "torch": "t"},
        tuner.DispatchKey("float32", "fp32", "any", False), None, None, [], str(table.path)))
    table = tmp_path / "t.json"
    assert main(["tune", "kb2-22", "--shape", SMALL, "--device", "cpu", "--table", str(table)]) == 0
    out = capsys.readouterr().out
    assert f"nothing was recorded in {table}" in out and "table:" not in out, out


# -- show -----------------------------------------------------------------------------

def test_show_of_a_missing_table_says_it_is_missing(tmp_path, capsys):
    missing = tmp_path / "typo.json"
    assert main(["show", "--table", str(missing)]) == 2
    one_line_error(capsys, str(missing), "no such file")


# -- bench --no-compile -----------------------------------------------------------------

def test_bench_without_compile_leaves_the_compiled_variant_out(monkeypatch, tmp_path):
    monkeypatch.delenv("AUTOFUSE_BLOCK_PLUGINS", raising=False)  # conftest blocks `compiled`
    plugins.reset_plugin_manager()
    benched = []

    def variant_row(setup, cls, entries):
        benched.append(cls.name)
        return bench_run.BenchRow(cls.name, "variant", {}, note="not run here"), None

    monkeypatch.setattr(bench_run, "_variant_row", variant_row)
    try:
        bench_run.bench("kb2-22", {"batch_size": 5, "input_size": 33, "hidden_size": 17}, device="cpu",
                        table=tmp_path / "t.json", rounds=1, use_compile=False)
    finally:
        monkeypatch.undo()
        plugins.reset_plugin_manager()
    assert "simplified" in benched and "compiled" not in benched, benched


# -- Ctrl-C ---------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    path = pathlib.Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


@pytest.mark.skipif(not pathlib.Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists(),
                    reason="needs Linux's /proc/PID/task/PID/children to see the worker start")
def test_ctrl_c_during_a_tune_prints_the_clean_message_and_nothing_else(tmp_path):
    # Ctrl-C reaches the terminal's whole process group: the tune and its worker subprocess.
    # The worker printed a BrokenPipeError (or ConnectionResetError) traceback after the message.
    # The test plugin's `knobs` (eight configurations, each built in AUTOFUSE_TEST_BUILD_S seconds)
    # keeps the tune running whatever budget and machine: it is mid-search when Ctrl-C comes.
    env = {**os.environ, "AUTOFUSE_PLUGINS": "knob_variants", "AUTOFUSE_TEST_BUILD_S": "2",
           "PYTHONPATH": os.pathsep.join([PLUGIN_DIR, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "autofuse.cli", "tune", "kb2-99", "--shape", "batch_size=64,in_features=256,out_features=192",
         "--device", "cpu", "--table", str(tmp_path / "t.json"), "--no-progress", "--variants", "knobs", "--seed", "1",
         "--budget", "full"],
        start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        # Ctrl-C as a terminal delivers it: a runner started in the background of a non-interactive
        # shell (`cmd &`) passes SIGINT on ignored, and Python then leaves it ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # The worker is spawned as the tune starts; its first candidate opens the key's log.
        logs = pathlib.Path(os.environ["AUTOFUSE_HOME"]) / "logs"
        deadline = time.monotonic() + 60
        while not (_children(proc.pid) and any(logs.glob("*.log"))) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _children(proc.pid) and any(logs.glob("*.log")), "the tune's worker took no candidate within 60 s"
        time.sleep(1.0)  # mid-search
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "autofuse: interrupted" in err, err


# -- show of bad entries --------------------------------------------------------------------

def test_show_prints_a_bad_entry_as_it_is_and_says_what_is_wrong(tmp_path, capsys):
    # Formatting a string median raised ValueError, and an unparsable dispatch key too (issue 32).
    table = tmp_path / "t.json"
    record("matmul_clamp_lse_mish", 5, 33, 17, path=table, median_ms="fast", speedup="big", error="none", params="x")
    table.write_text(table.read_text().replace("autograd=false", "autograd=maybe"))
    assert main(["show", "--table", str(table)]) == 0
    out = capsys.readouterr().out
    assert "'fast'" in out and "autograd=maybe" in out and "its median_ms must be a finite number" in out, out
