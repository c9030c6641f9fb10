"""`autofuse bench --dtype bfloat16` on CPU: a bfloat16 model's rows, its table keys, its report and targets."""

import json

import pytest
import torch

import autofuse
from autofuse.bench.run import BF16_COPY, DISPATCH, FLOOR, bench, load, markdown, save
from autofuse.bench.targets import FORWARD, TRAINING, target_for
from autofuse.cli import main

SMALL = {"batch_size": 12, "in_features": 48, "out_features": 40}
ODD = {"batch_size": 1, "in_features": 33, "out_features": 17}


@pytest.fixture(scope="module")
def bf16_table(tmp_path_factory):
    """A table whose only entries are a bfloat16 model's, at SMALL (forward and autograd)."""
    table = tmp_path_factory.mktemp("bf16") / "t.json"
    autofuse.tune("matmul_gelu_softmax", SMALL, device="cpu", dtype="bfloat16", precision="bf16", table=table,
                  seed=0, progress=False, variants=["eager", "simplified"], n_trials=2)
    return table


@pytest.mark.parametrize("step", [FORWARD, TRAINING])
def test_a_bfloat16_model_is_benched_on_its_own_keys(bf16_table, step):
    [report] = bench("matmul_gelu_softmax", SMALL, device="cpu", dtype="bfloat16", table=bf16_table, use_compile=False,
                     rounds=2, step=step)
    assert (report.dtype, report.precision) == ("bfloat16", "bf16")  # bf16 implied by the dtype
    assert {r.candidate: r.role for r in report.rows} == {
        "eager": "baseline", "simplified": "variant", DISPATCH: "dispatch", FLOOR: "floor"}  # no cast of x, no bf16 copy
    assert all(r.timing is not None for r in report.rows), [r.note for r in report.rows]
    assert report.row("simplified").note.startswith("tuned")  # from a dtype=bfloat16 entry: the table has no other
    assert report.row(DISPATCH).note.endswith("(tuned)")
    assert report.row(FLOOR).note.endswith("(bf16 operands and result)")
    assert "bfloat16 model" in report.title


def test_a_float32_model_on_the_same_table_misses_the_bfloat16_entries(bf16_table):
    [report] = bench("matmul_gelu_softmax", SMALL, device="cpu", precision="bf16", table=bf16_table, use_compile=False,
                     rounds=1)
    assert report.dtype == "float32" and report.row(DISPATCH).note == "eager (no entry: reference)"
    assert report.row("simplified").note == "default configuration (not tuned)"
    assert report.row("cast x to bf16") is not None  # a float32 model's input is cast; a bfloat16 model's is not


def test_the_dispatch_runs_the_bfloat16_model_in_bfloat16(monkeypatch, tmp_path):
    from autofuse.bench import setup as bench_setup

    seen = []
    original = bench_setup.dispatch_module
    monkeypatch.setattr(bench_setup, "dispatch_module", lambda s, t: seen.append(original(s, t)) or seen[-1])
    [report] = bench("matmul_clamp_lse_mish", ODD, device="cpu", dtype="bfloat16", table=tmp_path / "t.json",
                     use_compile=False, rounds=1)
    [module] = seen
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    assert report.row(DISPATCH).timing is not None


def test_float32_and_bfloat16_reports_keep_apart_in_files_and_sections(bf16_table, tmp_path):
    kwargs = {"device": "cpu", "table": bf16_table, "use_compile": False, "rounds": 1}
    reports = bench("matmul_gelu_softmax", SMALL, precision="bf16", **kwargs) + bench(
        "matmul_gelu_softmax", SMALL, dtype="bfloat16", **kwargs)
    save(reports, tmp_path / "out")
    names = sorted(p.name for p in (tmp_path / "out").glob("*.json"))
    assert names == ["matmul_gelu_softmax-12-bf16-any.json", "matmul_gelu_softmax-12-bf16-bfloat16-any.json"]
    assert json.loads((tmp_path / "out" / names[1]).read_text())["dtype"] == "bfloat16"
    loaded = load(tmp_path / "out")
    assert sorted(r.dtype for r in loaded) == ["bfloat16", "float32"]
    text = markdown(loaded, "autofuse bench x", tmp_path / "out", tmp_path)
    plain, model = text.split("## bf16\n")[1].split("\n## ")[0], text.split("## bf16, bfloat16 model\n")[1].split("\n## ")[0]
    assert text.index("## bf16\n") < text.index("## bf16, bfloat16 model")
    assert plain.count("| matmul_gelu_softmax | 12×48×40 |") == model.count("| matmul_gelu_softmax | 12×48×40 |") == 1


def test_a_bfloat16_models_memory_floor_moves_half_the_bytes(tmp_path):
    shape = {"batch_size": 8, "in_features": 30, "out_features": 20}
    kwargs = {"device": "cpu", "table": tmp_path / "t.json", "use_compile": False, "rounds": 1, "precision": "bf16"}
    floors = [bench("gemm_avgpool_gelu_residual", shape, dtype=dtype, **kwargs)[0].row(FLOOR).note
              for dtype in ("float32", "bfloat16")]
    nbytes = 4 * (8 * 30 + 8 * 30)  # read x, write out (x's shape: the residual), float32
    assert floors == [f"copy of {nbytes / 1e6:.4g} MB (read + write)", f"copy of {nbytes / 2e6:.4g} MB (read + write)"]


def test_a_bfloat16_model_needs_bf16(tmp_path, capsys):
    with pytest.raises(autofuse.InputError, match="bfloat16 inputs need precision='bf16'"):
        bench("matmul_gelu_softmax", SMALL, device="cpu", dtype="bfloat16", precision="tf32", use_compile=False)
    with pytest.raises(autofuse.InputError, match="dtype must be one of"):
        bench("matmul_gelu_softmax", SMALL, device="cpu", dtype="float16", use_compile=False)
    argv = ["bench", "kb2-99", "--shape", "batch_size=4,in_features=16,out_features=8", "--device", "cpu", "--no-compile",
            "--dtype", "bfloat16", "--out", str(tmp_path / "out")]
    assert main(argv + ["--precision", "fp32"]) == 2 and "precision='bf16'" in capsys.readouterr().err
    assert main(argv + ["--rounds", "1"]) == 0 and "(bf16, bfloat16 model, any)" in capsys.readouterr().out


def test_compile_rows_compile_the_bfloat16_model(tmp_path):
    """torch.compile of the bfloat16 model itself (~10 s of real compiles on the CPU); no float32 copy row."""
    shape = {"batch_size": 4, "in_features": 16, "out_features": 8}
    [report] = bench("matmul_gelu_softmax", shape, device="cpu", dtype="bfloat16", table=tmp_path / "t.json",
                     compile_modes=["default"], skip_variants=["simplified"], rounds=1)
    assert [r.candidate for r in report.rows if r.role == "baseline"] == ["eager", "torch.compile"]
    assert report.row(BF16_COPY) is None and report.row("torch.compile").timing is not None


@pytest.mark.parametrize("problem,step,mode,shape,expected", [
    ("matmul_clamp_lse_mish", FORWARD, "any", (1024, 8192, 8192), "1.06"),
    ("matmul_gelu_softmax", FORWARD, "any", (1024, 8192, 8192), "1.12"),
    ("gemm_bn", FORWARD, "eval", (16384, 4096, 4096), "1.08"),
    ("gemm_bn", FORWARD, "train", (1024, 8192, 8192), "1.12"),
    ("gemm_bn", FORWARD, "train", (16384, 4096, 4096), "1.15"),
    ("gemm_bn", FORWARD, "train", (512, 8192, 8192), None),
    ("gemm_bn", TRAINING, "train", (1024, 8192, 8192), "≥ 1x torch.compile"),
    ("matmul_gelu_softmax", TRAINING, "any", (1024, 8192, 8192), "≥ 1x torch.compile"),
    ("gemm_avgpool_gelu_residual", FORWARD, "any", (2048, 8192, 8192), None),  # issue 34 sets none
])
def test_a_bfloat16_model_has_targets_of_its_own(problem, step, mode, shape, expected):
    target = target_for(problem, step, "bf16", mode, dict(zip("bio", shape)), dtype="bfloat16")
    assert (target.text() if target else None) == expected
