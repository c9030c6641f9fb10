"""`autofuse bench` on CPU: every candidate measured side by side, ratios, JSON and Markdown."""

import json
import re

import pytest

import autofuse
from autofuse.bench.run import BF16_COPY, FLOOR, bench, load, markdown, save
from autofuse.bench.targets import FORWARD, TRAINING, Target, target_for
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
    assert f"![{charts[0].stem}](out/{charts[0].name})" in text
    elsewhere = markdown([report], "autofuse bench x", charts, tmp_path / "docs")  # a page outside the charts' tree
    assert f"![{charts[0].stem}](../out/{charts[0].name})" in elsewhere


def test_an_incorrect_variant_is_reported_not_timed(tmp_path, monkeypatch):
    from autofuse.core import registry

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
    (out / "harness").mkdir()
    (out / "harness" / "harness-fp32.md").write_text("## KernelBench's harness on the exported ModelNew\n\n| x |\n")
    (out / "table.json").write_text('{"schema": "autofuse-dispatch-table", "version": 1, "devices": {}}')  # benchmarks.sh keeps the tuned table there
    target = tmp_path / "B.md"
    assert main(["bench", "--from-out", "--out", str(out), "--markdown", str(target)]) == 0
    text = target.read_text()
    assert text.index("## Summary") < text.index("## Why\n\nThe cast of x") < text.index("## KernelBench's harness") \
        < text.index("## gemm_avgpool")
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
    assert "| bf16, any | 1.12 |" in summary


@pytest.mark.parametrize("ratio,target,behind,verdict", [
    (1.02, 1.03, {}, "met"), (1.03, 1.03, {}, "met"), (1.133, 1.10, {}, "missed by 3.0%"),
    (1.02, 1.03, {"torch.compile": 1.0001}, "0.01% slower than torch.compile"),
    (1.2, 1.10, {"eager": 1.05}, "missed by 9.1%; 5.00% slower than eager"),
    (1.21, Target(1.10, "torch.compile"), {}, "met (1.21x torch.compile)"),
    (1.0, Target(1.10, "torch.compile"), {"torch.compile": 1.0}, "missed by 10.0% (1.00x torch.compile); 0.00% slower than torch.compile"),
    (None, 1.10, {}, "-"), (1.2, None, {}, "-")])
def test_verdict_says_by_how_much_a_target_is_missed(ratio, target, behind, verdict):
    from autofuse.bench.report import _verdict

    assert _verdict(ratio, target, behind) == verdict


def _row(name, role, ms):
    from autofuse.bench.report import BenchRow
    from autofuse.tuning.timing import Timing

    return BenchRow(name, role, {}, Timing(ms, ms, ms, 3))


def test_the_verdict_names_every_baseline_not_beaten_and_the_summary_shows_each_over_the_floor():
    from autofuse.bench.report import BenchReport, _summary

    report = BenchReport("matmul_gelu_softmax", {"batch_size": 4}, "tf32", "any", {}, [
        _row("eager", "baseline", 1.2), _row("torch.compile", "baseline", 1.0),
        _row("torch.compile max-autotune", "baseline", 0.99), _row("autofuse dispatch", "dispatch", 1.01),
        _row(FLOOR, "floor", 1.0)])
    header, line = [l for l in _summary([report]) if l.startswith("| ")]
    assert header.endswith("| fastest variant | eager | torch.compile | torch.compile max-autotune |")
    assert "| 1.03 | 1.010 () | 1.00% slower than torch.compile; 2.02% slower than torch.compile max-autotune |" in line
    assert line.endswith("| - (-) | 1.200 | 1.000 | 0.990 |")
    report.rows = [r for r in report.rows if r.candidate != "torch.compile max-autotune"]
    report.row("autofuse dispatch").timing = _row("x", "x", 0.9).timing
    [line] = [l for l in _summary([report]) if l.startswith("| matmul")]
    assert "| met (not compared with torch.compile max-autotune) |" in line  # a comparison not made is said


def test_a_step_report_without_the_row_its_target_compares_with_says_so():
    from autofuse.bench.report import BenchReport, _summary

    report = BenchReport("gemm_bn", {"batch_size": 1024}, "tf32", "train", {}, [
        _row("eager", "baseline", 1.2), _row("torch.compile max-autotune", "baseline", 0.99),
        _row("autofuse dispatch", "dispatch", 0.8), _row(FLOOR, "floor", 0.7)], step=TRAINING)
    [line] = [l for l in _summary([report]) if l.startswith("| gemm_bn")]
    assert "| ≥ 1.1x torch.compile | " in line and "| not measured (no torch.compile timing) |" in line


@pytest.mark.parametrize("problem,step,precision,mode,shape,expected", [
    ("matmul_gelu_softmax", FORWARD, "fp32", "any", (1024, 8192, 8192), "0.50"),
    ("matmul_clamp_lse_mish", FORWARD, "ieee", "any", (4, 16, 8), "1.03"),
    ("gemm_bn", FORWARD, "bf16", "eval", (16384, 4096, 4096), "1.12"),
    ("gemm_bn", FORWARD, "tf32", "train", (1024, 8192, 8192), "1.06"),
    ("gemm_bn", FORWARD, "bf16", "train", (16384, 4096, 4096), "1.25"),
    ("gemm_bn", FORWARD, "tf32", "train", (512, 8192, 8192), None),  # no target at another shape
    ("gemm_avgpool_gelu_residual", FORWARD, "bf16", "any", (2048, 8192, 8192), "1.50"),
    ("gemm_bn", TRAINING, "bf16", "train", (1024, 8192, 8192), "≥ 1.1x torch.compile"),
    ("matmul_gelu_softmax", TRAINING, "fp32", "any", (1024, 8192, 8192), None),
    ("gemm_avgpool_gelu_residual", TRAINING, "fp32", "any", (2048, 8192, 8192), "≥ 50x eager"),
    ("kb_gemm_sigmoid_sum", FORWARD, "fp32", "any", (32, 24, 20), None),  # a plugin's or a file's problem
])
def test_targets_depend_on_problem_step_mode_shape_and_precision(problem, step, precision, mode, shape, expected):
    target = target_for(problem, step, precision, mode, dict(zip("bio", shape)))
    assert (target.text() if target else None) == expected


def test_forward_and_backward_reports_round_trip_through_save_load_and_markdown(tmp_path):
    table = tmp_path / "t.json"
    [tuned] = autofuse.tune("gemm_avgpool_gelu_residual", SMALL, device="cpu", table=table, seed=0, progress=False)
    reports = [r for step in (FORWARD, TRAINING) for r in bench(
        "gemm_avgpool_gelu_residual", SMALL, device="cpu", table=table, use_compile=False, rounds=2, step=step)]
    training = reports[1]
    assert training.step == TRAINING
    assert {r.candidate: r.role for r in training.rows} == {
        "eager": "baseline", "simplified": "variant", "autofuse dispatch": "dispatch", FLOOR: "floor"}
    assert all(r.timing is not None for r in training.rows)
    assert training.row("simplified").note == "tuned"  # from the autograd entry's own candidates
    assert training.row("autofuse dispatch").note == f"{tuned.grad_winner['variant']} (tuned)"  # the autograd=true entry
    # Forward: read x, write out. Then read the upstream gradient and x, write W's, b's and subtract's gradients.
    batch, n_in, n_out = SMALL.values()
    nbytes = 4 * (2 * batch * n_in + 2 * batch * n_in + n_out * n_in + 2 * n_out)
    assert training.row(FLOOR).note.startswith(f"copy of {nbytes / 1e6:.4g} MB")
    save(reports, tmp_path / "out")
    assert (tmp_path / "out" / "gemm_avgpool_gelu_residual-12-fp32-any-fwdbwd.json").exists()
    loaded = load(tmp_path / "out")
    assert [r.step for r in loaded] == [FORWARD, TRAINING]
    assert [r.to_dict() for r in loaded] == [r.to_dict() for r in reports]
    text = markdown(loaded, "autofuse bench x", [], tmp_path)
    forward, training_summary = text.split("## Summary: forward+backward (a training step), time over the floor")
    assert "| fp32, any | 1.50 |" in forward.split("## Summary: time over the floor")[1]
    assert "| fp32, any | ≥ 50x eager |" in training_summary.split("\n## ")[0]
    assert "## gemm_avgpool_gelu_residual batch_size=12,in_features=48,out_features=40 (fp32, any, forward+backward)" in text
    # Each table says when it ran (reports of several sessions share one page); older reports say they cannot.
    stamp = training.measured
    assert stamp is not None and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\dZ", stamp)
    assert f"Measured {stamp.replace('T', ' ')} UTC." in text.split("(fp32, any, forward+backward)")[1]
    old = tmp_path / "old"
    old.mkdir()
    data = json.loads((tmp_path / "out" / "gemm_avgpool_gelu_residual-12-fp32-any-fwdbwd.json").read_text())
    del data["measured"]
    (old / "report.json").write_text(json.dumps(data))
    [undated] = load(old)
    assert undated.measured is None
    assert "Measured before reports recorded when" in markdown([undated], "autofuse bench x", [], tmp_path)


def test_the_training_step_gates_variants_with_gradients(tmp_path, monkeypatch):
    """A variant right in the forward but wrong in the backward is timed forward, refused forward+backward."""
    from autofuse.core import registry

    simplified = registry.get_variant("matmul_gelu_softmax", "simplified")
    right = simplified.forward

    def doubled_gradient(self, model, x):
        y = right(self, model, x)
        return y + (y - y.detach())  # the same values, twice the gradient
    monkeypatch.setattr(simplified, "forward", doubled_gradient)
    kwargs = dict(device="cpu", table=tmp_path / "t.json", use_compile=False, rounds=2)
    [forward] = bench("matmul_gelu_softmax", SMALL, **kwargs)
    [training] = bench("matmul_gelu_softmax", SMALL, step=TRAINING, **kwargs)
    assert forward.row("simplified").timing is not None
    assert training.row("simplified").timing is None and "gradient of" in training.row("simplified").note
    assert training.row(FLOOR).note == "cuBLAS forward GEMM + weight-gradient GEMM alone (float32 FMA)"


def test_compile_rows_and_the_bf16_copy_are_timed(tmp_path):
    """torch.compile in both modes (compiled inside the precision's math mode) and, under bf16,
    the compiled bf16 copy; a compiled training step too. Tiny, but real compiles on the CPU (~20 s)."""
    shape, kwargs = {"batch_size": 4, "in_features": 16, "out_features": 8}, dict(skip_variants=["simplified"], rounds=1)
    [forward] = bench("matmul_gelu_softmax", shape, device="cpu", precision="bf16", table=tmp_path / "t.json", **kwargs)
    [training] = bench("matmul_gelu_softmax", shape, device="cpu", precision="tf32", table=tmp_path / "t.json",
                       step=TRAINING, compile_modes=["default"], **kwargs)
    baselines = {r.candidate: r for r in forward.rows if r.role == "baseline"}
    assert set(baselines) == {"eager", "torch.compile", "torch.compile max-autotune", BF16_COPY}
    assert baselines["torch.compile max-autotune"].params == {"mode": "max-autotune-no-cudagraphs"}
    assert [r.candidate for r in training.rows if r.role == "baseline"] == ["eager", "torch.compile"]
    assert all(r.timing is not None for r in forward.rows + training.rows), [r.note for r in forward.rows + training.rows]
    with pytest.raises(autofuse.InputError, match="torch.compile modes"):
        bench("matmul_gelu_softmax", shape, device="cpu", compile_modes=["fastest"])
