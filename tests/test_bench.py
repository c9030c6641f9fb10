"""`autofuse bench` on CPU: every candidate measured side by side, ratios, JSON and Markdown."""

import json

import pytest

import autofuse
from autofuse.bench import FLOOR, bench, markdown, save
from autofuse.cli import main

SMALL = {"batch_size": 12, "in_features": 48, "out_features": 40}


def test_bench_measures_baselines_variants_dispatch_and_floor(tmp_path):
    table = tmp_path / "t.json"
    autofuse.tune("gemm_avgpool_gelu_residual", SMALL, device="cpu", table=table, seed=0, progress=False)
    [report] = bench("gemm_avgpool_gelu_residual", SMALL, device="cpu", table=table, use_compile=False, rounds=4)
    roles = {row.candidate: row.role for row in report.rows}
    assert roles == {"eager": "baseline", "simplified": "variant", "autofuse dispatch": "dispatch", FLOOR: "floor"}
    assert all(row.timing is not None and row.timing.reps == 12 for row in report.rows)
    assert report.row("simplified").note == "tuned"
    assert "(tuned)" in report.row("autofuse dispatch").note
    assert report.ratio(report.row("eager"), "eager") == 1.0
    assert report.ratio(report.row(FLOOR), FLOOR) == 1.0
    charts = save([report], tmp_path / "out")
    data = json.loads((tmp_path / "out" / "gemm_avgpool_gelu_residual-12-fp32-any.json").read_text())
    assert {r["candidate"] for r in data["rows"]} == set(roles)
    text = markdown([report], "autofuse bench x", charts, tmp_path)
    assert "| simplified | - |" in text and "CPU cores" in text


def test_an_incorrect_variant_is_reported_not_timed(tmp_path, monkeypatch):
    from autofuse import registry

    simplified = registry.get_variant("matmul_gelu_softmax", "simplified")
    monkeypatch.setattr(simplified, "forward", lambda self, model, x: model.linear(x) * 0)
    [report] = bench("matmul_gelu_softmax", SMALL, device="cpu", table=tmp_path / "t.json", use_compile=False, rounds=2)
    row = report.row("simplified")
    assert row.timing is None and row.note.startswith("incorrect:")


def test_cli_bench_writes_json_and_markdown(tmp_path, capsys):
    out, md = tmp_path / "out", tmp_path / "BENCH.md"
    assert main(["bench", "kb2-99", "--shape", "batch_size=4,in_features=16,out_features=8", "--device", "cpu",
                 "--no-compile", "--rounds", "2", "--out", str(out), "--markdown", str(md)]) == 0
    assert "x floor" in capsys.readouterr().out
    assert list(out.glob("*.json")) and "## matmul_gelu_softmax" in md.read_text()
    assert main(["bench"]) == 2 and "--all" in capsys.readouterr().err


def test_markdown_is_rewritten_from_saved_reports_of_several_runs(tmp_path):
    out = tmp_path / "out"
    for precision in ("fp32", "bf16"):  # two runs into one folder, as one per precision on the GPU
        save(bench("gemm_avgpool_gelu_residual", SMALL, device="cpu", precision=precision, use_compile=False, rounds=2), out)
    (out / "analysis.md").write_text("## Why\n\nThe cast of x costs what it costs.\n")
    (out / "table.json").write_text('{"schema": "autofuse-dispatch-table", "version": 1, "devices": {}}')  # benchmarks.sh keeps the tuned table there
    target = tmp_path / "B.md"
    assert main(["bench", "--from-out", "--out", str(out), "--markdown", str(target)]) == 0
    text = target.read_text()
    assert text.index("## Summary") < text.index("## Why\n\nThe cast of x") < text.index("## gemm_avgpool")
    assert "(fp32, any)" in text and "(bf16, any)" in text
    assert text.count("| eager | - |") == 2
    summary = text.split("## Summary: time over the floor")[1].split("\n## ")[0]
    assert summary.count("| gemm_avgpool_gelu_residual |") == 2 and "| fp32, any | 1.50 |" in summary
    assert main(["bench", "--from-out", "--out", str(tmp_path / "empty")]) == 2  # no --markdown named


def test_bf16_bench_shows_the_input_cast_and_the_verdict_against_the_target(tmp_path):
    [report] = bench("matmul_clamp_lse_mish", {"batch_size": 8, "input_size": 32, "hidden_size": 24}, device="cpu",
                     precision="bf16", table=tmp_path / "t.json", use_compile=False, rounds=2)
    cast = report.row("cast x to bf16")
    assert cast.role == "reference" and cast.timing is not None
    summary = markdown([report], "autofuse bench x", [], tmp_path).split("## Summary")[1].split("\n## ")[0]
    assert "| bf16, any | 1.15 |" in summary


@pytest.mark.parametrize("ratio,target,behind,verdict", [
    (1.02, 1.03, {}, "met"), (1.03, 1.03, {}, "met"), (1.133, 1.10, {}, "missed by 3.0%"),
    (1.02, 1.03, {"torch.compile": 1.0001}, "0.01% slower than torch.compile"),
    (1.2, 1.10, {"eager": 1.05}, "missed by 9.1%; 5.00% slower than eager"),
    (None, 1.10, {}, "-"), (1.2, None, {}, "-")])
def test_verdict_says_by_how_much_a_target_is_missed(ratio, target, behind, verdict):
    from autofuse.bench import _verdict

    assert _verdict(ratio, target, behind) == verdict


def test_a_dispatch_that_does_not_beat_a_baseline_is_no_met_target():
    from autofuse.bench import BenchReport, BenchRow, _summary
    from autofuse.timing import Timing

    def row(name, role, ms):
        return BenchRow(name, role, {}, Timing(ms, ms, ms, 3))
    report = BenchReport("matmul_gelu_softmax", {"batch_size": 4}, "fp32", "any", {}, [
        row("eager", "baseline", 1.2), row("torch.compile", "baseline", 1.0),
        row("autofuse dispatch", "dispatch", 1.01), row(FLOOR, "floor", 1.0)])
    [line] = [l for l in _summary([report]) if l.startswith("| matmul_gelu_softmax")]
    assert "| 1.03 | 1.010 () | 1.00% slower than torch.compile |" in line
