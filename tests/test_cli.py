"""The `autofuse` command: list, tune, show, and its errors."""

import json
import subprocess
import sys

import pytest
from helpers import record

from autofuse.cli import main
from autofuse.serve.table import DispatchTable


def test_list_shows_every_problem_and_variant(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("gemm_bn", "gemm_avgpool_gelu_residual", "matmul_gelu_softmax", "matmul_clamp_lse_mish", "kb2-39"):
        assert name in out
    assert out.count("simplified") >= 4


def test_tune_then_show(tmp_path, capsys):
    table = str(tmp_path / "t.json")
    assert main(["tune", "kb2-22", "--shape", "batch_size=5,in_features=33,out_features=17", "--device", "cpu",
                 "--table", table, "--no-progress", "--seed", "2"]) == 0
    out = capsys.readouterr().out
    assert "winner:" in out and "outcome" in out and "eager" in out
    # The wall time splits into the key's own entries and its batch classes (1, 10): what each cost.
    assert "its batch classes" in out.split("tuned in ")[1], out
    assert json.load(open(table))["schema"] == "autofuse-dispatch-table"
    assert main(["show", "--table", table]) == 0
    shown = capsys.readouterr().out
    assert "matmul_clamp_lse_mish" in shown and "batch_size=5,input_size=33,hidden_size=17" in shown


def test_errors_exit_2_with_a_message(capsys, tmp_path):
    assert main(["tune", "gemm_bm"]) == 2
    assert "known problems" in capsys.readouterr().err
    assert main(["tune", "gemm_bn", "--shape", "batch_size=4,in_features=8", "--device", "cpu"]) == 2
    assert "missing ['out_features']" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    assert main(["show", "--table", str(bad)]) == 2
    assert "left intact" in capsys.readouterr().err


def test_the_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "autofuse.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "tune" in out.stdout


SMALL_22 = "batch_size=5,in_features=33,out_features=17"


def test_tune_into_a_deeply_nested_table_reports_it_and_keeps_the_result_beside_it(tmp_path, capsys):
    # It raised RecursionError (issue 32); other corrupt tables were reported like this.
    table = tmp_path / "t.json"
    table.write_text("[" * 100_000 + "]" * 100_000)
    assert main(["tune", "kb2-22", "--shape", SMALL_22, "--device", "cpu", "--table", str(table), "--variants", "eager",
                 "--trials", "1", "--no-autograd-entry", "--no-progress", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "nested" in out and "rescued" in out, out
    assert table.read_text() == "[" * 100_000 + "]" * 100_000


def test_a_rerun_does_not_keep_a_recorded_entry_whose_time_is_not_a_number(tmp_path, capsys):
    # A rerun with nothing new to measure keeps the recorded entry; one edited to a string time
    # was printed with a ValueError traceback (issue 32). It is measured and written again instead.
    table = tmp_path / "t.json"
    command = ["tune", "kb2-22", "--shape", SMALL_22, "--device", "cpu", "--table", str(table), "--variants", "eager",
               "--trials", "1", "--no-autograd-entry", "--no-progress", "--no-batch-classes", "--seed", "1"]
    assert main(command) == 0
    table.write_text(table.read_text().replace('"median_ms": ', '"median_ms": "fast", "was": '))
    assert main(command) == 0
    assert "winner: eager" in capsys.readouterr().out
    entries = [entry for *_, entry in DispatchTable(table).entries()]
    assert len(entries) == 1 and isinstance(entries[0]["median_ms"], float), entries


BAD_RECORDS = {
    "params not an object": {'"params": {}': '"params": "x"'},
    "no variant": {'"variant": "simplified"': '"was": "simplified"'},
    "no variant, faster": {'"variant": "simplified"': '"was": "simplified"', '"median_ms": 1.0': '"median_ms": 1e-09'},
}


@pytest.mark.parametrize("edits", BAD_RECORDS.values(), ids=BAD_RECORDS.keys())
def test_a_tune_over_a_bad_recorded_entry_replaces_it(edits, tmp_path, capsys):
    # A new study measures the recorded entry's configuration first, and a new winner slower
    # than the entry it replaces is announced: reading params that are not an object raised a
    # ValueError, an entry without a variant a KeyError (issue 32).
    table = tmp_path / "t.json"
    record("matmul_clamp_lse_mish", 5, 33, 17, path=table)
    text = table.read_text()
    for old, new in edits.items():
        assert old in text
        text = text.replace(old, new)
    table.write_text(text)
    assert main(["tune", "kb2-22", "--shape", SMALL_22, "--device", "cpu", "--table", str(table), "--variants", "eager",
                 "--trials", "1", "--no-autograd-entry", "--no-progress", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "winner: eager" in out and "the recorded one was unusable" in out, out
