"""`autofuse bench` on CPU: every candidate measured side by side, ratios, JSON and Markdown."""

import json
import re

import pytest

import autofuse
from autofuse.bench.run import BF16_COPY, FLOOR, bench, load, markdown, save
from autofuse.bench.targets import FORWARD, TRAINING, target_for
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
    save([report], tmp_path / "out")
    data = json.loads((tmp_path / "out" / "gemm_avgpool_gelu_residual-12-fp32-any.json").read_text())
    assert {r["candidate"] for r in data["rows"]} == set(roles)
    text = markdown([report], "autofuse bench x", tmp_path / "out", tmp_path)
    assert "| gemm_avgpool_gelu_residual | 12×48×40 | any | forward |" in text and "CPU cores" in text
    assert "| simplified |" not in text  # per-variant rows stay in the JSON and the charts
    assert "[`out/`](out/)" in text
    elsewhere = markdown([report], "autofuse bench x", tmp_path / "out", tmp_path / "docs")  # a page outside that folder
    assert "[`../out/`](../out/)" in elsewhere


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
    assert list(out.glob("*.json")) and "| matmul_gelu_softmax | 4×16×8 | any | forward |" in md.read_text()
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
    # One table per precision, then how it was measured and how to reproduce it, then the analysis
    # and what KernelBench's harness wrote; no per-key sections.
    assert text.index("## fp32") < text.index("## bf16") < text.index("## How it was measured") \
        < text.index("## Reproduce") < text.index("## Why\n\nThe cast of x") < text.index("## KernelBench's harness")
    assert text.count("| gemm_avgpool_gelu_residual | 12×48×40 | any | forward |") == 2
    assert "| candidate |" not in text and "![" not in text
    assert f"autofuse bench --from-out --out {out} --markdown {target}" in text.split("## Reproduce")[1]
    assert main(["bench", "--from-out", "--out", str(out), "--markdown", str(target)]) == 0
    assert target.read_text() == text  # regenerating from the same reports changes nothing
    (out / "analysis.md").unlink()  # the analysis is optional
    assert main(["bench", "--from-out", "--out", str(out), "--markdown", str(target)]) == 0
    assert "## Why" not in target.read_text() and "## KernelBench's harness" in target.read_text()
    assert main(["bench", "--from-out", "--out", str(tmp_path / "empty")]) == 2  # no --markdown named


def test_bf16_bench_times_the_input_cast(tmp_path):
    [report] = bench("matmul_clamp_lse_mish", {"batch_size": 8, "input_size": 32, "hidden_size": 24}, device="cpu",
                     precision="bf16", table=tmp_path / "t.json", use_compile=False, rounds=2)
    cast = report.row("cast x to bf16")
    assert cast.role == "reference" and cast.timing is not None
    assert "| matmul_clamp_lse_mish | 8×32×24 | any | forward |" in markdown([report], "autofuse bench x", tmp_path, tmp_path)


def _row(name, role, ms):
    from autofuse.bench.report import BenchRow
    from autofuse.tuning.timing import Timing

    return BenchRow(name, role, {}, Timing(ms, ms, ms, 3))


H100 = {"kind": "cuda", "name": "NVIDIA H100 80GB HBM3", "sm_count": 132, "capability": "9.0", "cuda": "13.0",
        "torch": "2.11.0+cu130"}
SUMMARY_HEADER = ("| problem | shape | mode | step | eager | torch.compile default | max-autotune-no-cudagraphs | "
                  "autofuse dispatch | cuBLAS-alone floor | time over floor | speedup vs compile |")


def _report(precision, eager, compiled, autotuned, dispatch, floor, *, problem="matmul_gelu_softmax", mode="any",
            step=FORWARD, shape=(1024, 8192, 8192), measured="2026-11-24T20:04Z", floor_note="cuBLAS GEMM alone"):
    from autofuse.bench.report import BenchReport

    rows = [_row(name, role, ms) for name, role, ms in (
        ("eager", "baseline", eager), ("torch.compile", "baseline", compiled),
        ("torch.compile max-autotune", "baseline", autotuned), ("triton", "variant", dispatch),
        ("autofuse dispatch", "dispatch", dispatch), (FLOOR, "floor", floor)) if ms is not None]
    next(r for r in rows if r.candidate == FLOOR).note = floor_note
    return BenchReport(problem, dict(zip(("batch_size", "in_features", "out_features"), shape)), precision, mode, H100,
                       rows, step, measured)


def test_markdown_is_one_summary_table_per_precision_with_the_method_and_the_command(tmp_path):
    reports = [_report("bf16", 0.40, 0.35, 0.34, 0.22, 0.17),
               _report("fp32", 2.74, 2.71, 2.70, 0.716, 2.68, mode="eval", problem="gemm_bn"),
               _report("fp32", 1.05, 1.03, 1.02, 0.30, 1.00, step=TRAINING, measured=None),
               _report("ieee", 2.74, 2.71, None, 2.70, 2.68)]
    text = markdown(reports, "autofuse bench --from-out --out benchmarks --markdown BENCHMARKS.md", tmp_path, tmp_path)
    # Precisions in the order of PRECISIONS (strictest first), each one table, forward rows first.
    assert text.index("## ieee") < text.index("## fp32") < text.index("## bf16") < text.index("## How it was measured")
    fp32 = text.split("## fp32")[1].split("\n## ")[0]
    assert SUMMARY_HEADER in fp32 and fp32.count("| gemm_bn |") + fp32.count("| matmul_gelu_softmax |") == 2
    assert ("| gemm_bn | 1024×8192×8192 | eval | forward | 2.7400 | 2.7100 | 2.7000 | 0.7160 | 2.6800 | 0.267 | 3.77x |"
            in fp32)
    assert fp32.index("| forward |") < fp32.index("| forward+backward |")
    # A mode not timed is a dash, and the speedup is over the faster torch.compile that was timed.
    assert "| matmul_gelu_softmax | 1024×8192×8192 | any | forward | 2.7400 | 2.7100 | - | 2.7000 | 2.6800 | 1.007 | 1.00x |" \
        in text.split("## ieee")[1]
    method = text.split("## How it was measured")[1].split("\n## ")[0]
    for needle in ("NVIDIA H100 80GB HBM3 (132 SMs, compute capability 9.0), CUDA 13.0, torch 2.11.0+cu130",
                   "CUDA events", "L2", "median", "p20-p80", "2026-11-24", "1 of 4 reports"):
        assert needle in method, needle
    assert "```\nautofuse bench --from-out --out benchmarks --markdown BENCHMARKS.md\n```" in text.split("## Reproduce")[1]
    assert "| candidate |" not in text and "2026-11-24T" not in text  # no per-key sections, no raw stamps


def test_a_missed_target_is_said_in_the_cell_it_concerns(tmp_path):
    forward = _report("bf16", 0.40, 0.35, 0.34, 0.2058, 0.1702, problem="gemm_bn", mode="eval")  # target 1.12
    training = _report("tf32", 1.6, 1.0, 0.99, 0.95, 0.7, problem="gemm_bn", mode="train", step=TRAINING)  # ≥ 1.1x torch.compile
    met = _report("fp32", 1.05, 1.03, 1.02, 0.28, 1.00)  # target 0.50
    text = markdown([forward, training, met], "autofuse bench x", tmp_path, tmp_path)
    assert "| 1.209 (target 1.12: missed by 8.0%) | 1.65x |" in text
    assert "| 1.357 | 1.04x (target ≥ 1.1x torch.compile: missed by 4.5% (1.05x torch.compile)) |" in text
    assert "| 0.280 | 3.64x |" in text


def test_a_bimodal_row_gives_the_ratio_of_p20s_beside_the_medians(tmp_path):
    """torch.compile's training step of a bfloat16 99 on the H100: p20-p80 0.44-1.28 ms, median
    0.87, against the dispatch's steady 0.47; by the medians 1.84x, by the p20s 0.94x."""
    from autofuse.tuning.timing import Timing

    noisy = _report("bf16", 0.47, 0.8714, None, 0.4745, 0.3557, step=TRAINING)
    noisy.row("torch.compile").timing = Timing(0.8714, 0.4418, 1.2821, 15)
    noisy.row("autofuse dispatch").timing = Timing(0.4745, 0.4718, 0.4790, 15)
    steady = _report("fp32", 1.05, 1.03, 1.02, 0.30, 1.00)
    text = markdown([noisy, steady], "autofuse bench x", tmp_path, tmp_path)
    assert "| 1.84x (bimodal; p20 over p20: 0.94x) |" in text
    assert "| 0.300 | 3.40x |" in text and text.count("bimodal;") == 1


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
    # From the autograd entry's own candidates where it raced simplified: it races the variants whose
    # forward came within the budget's grad_reach of the fastest, which on a loaded CPU simplified
    # sometimes missed (then the forward entry's configuration, said so).
    raced = "simplified" in (tuned.grad_winner.get("candidates") or {})
    assert training.row("simplified").note == ("tuned" if raced else "tuned for the forward")
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
    text = markdown(loaded, "autofuse bench x", tmp_path / "out", tmp_path)
    fp32 = text.split("## fp32")[1].split("\n## ")[0]
    assert "| gemm_avgpool_gelu_residual | 12×48×40 | any | forward |" in fp32
    assert "| gemm_avgpool_gelu_residual | 12×48×40 | any | forward+backward |" in fp32
    # The page says when the reports ran (reports of several runs share it); older reports say they cannot.
    stamp = training.measured
    assert stamp is not None and re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\dZ", stamp)
    assert f"measured {stamp[:10]} (UTC)" in text.split("## How it was measured")[1]
    old = tmp_path / "old"
    old.mkdir()
    data = json.loads((tmp_path / "out" / "gemm_avgpool_gelu_residual-12-fp32-any-fwdbwd.json").read_text())
    del data["measured"]
    (old / "report.json").write_text(json.dumps(data))
    [undated] = load(old)
    assert undated.measured is None
    assert "1 of 1 reports predate" in markdown([undated], "autofuse bench x", tmp_path, tmp_path)


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
