"""`autofuse bench --batches` on CPU: one shape family at many batches, which entry served each, wall times."""

import time

import pytest

import autofuse
from autofuse.bench.floors import COPY, WEIGHT_READ
from autofuse.bench.report import BenchRow, sweep_section
from autofuse.bench.run import DISPATCH, FLOOR
from autofuse.bench.sweep import bench_sweep, time_wall
from autofuse.bench.sweep_report import WALL_PREFIX, SweepPoint, SweepReport, load_sweeps, save_sweeps
from autofuse.cli import main
from autofuse.tuning.timing import Timing

SMALL = {"batch_size": 12, "in_features": 48, "out_features": 40}


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    table = tmp_path_factory.mktemp("sweep") / "t.json"
    autofuse.tune("matmul_gelu_softmax", SMALL, device="cpu", table=table, seed=0, progress=False,
                  variants=["eager", "simplified"], n_trials=2, autograd_entry=False)
    return table


def test_each_batch_says_which_entry_served_it(table):
    [sweep] = bench_sweep("matmul_gelu_softmax", SMALL, [1, 7, 12, 25], device="cpu", table=table, use_compile=False, rounds=2)
    assert [p.batch for p in sweep.points] == [1, 7, 12, 25] and sweep.family == "×48×40"
    served = {p.batch: p.row(DISPATCH).note for p in sweep.points}
    # The tune at 12 also wrote its batch classes' entries (1, 8 and 24): each batch names the one that served it.
    assert served[12].endswith("(tuned)") and served[1].endswith("(tuned)"), served
    assert "nearest batch (batch_size=8," in served[7] and "nearest batch (batch_size=24," in served[25], served
    for point in sweep.points:
        assert {r.candidate: r.role for r in point.rows} == {"eager": "baseline", DISPATCH: "dispatch", FLOOR: "floor"}
        assert all(r.timing is not None for r in point.rows)
    [untuned] = bench_sweep("matmul_gelu_softmax", SMALL, [3], device="cpu", table=table.parent / "none.json",
                            use_compile=False, rounds=1)
    assert untuned.points[0].row(DISPATCH).note == "eager (no entry: reference)"


def test_wall_rows_and_the_weight_read_floor(table):
    [sweep] = bench_sweep("matmul_gelu_softmax", SMALL, [1, 32], device="cpu", table=table, use_compile=False,
                          rounds=2, wall=True)
    for point in sweep.points:
        walls = [r for r in point.rows if r.role == "wall"]
        assert [r.candidate for r in walls] == [WALL_PREFIX + name for name in (DISPATCH, "eager", FLOOR)]
        assert all(r.timing is not None and r.timing.reps == 2 * 10 for r in walls)
        copied, read = point.row(COPY), point.row(WEIGHT_READ)
        assert read.params["bytes"] == 48 * 40 * 4  # fp32: W's float32 bytes
        assert read.timing.median_ms == pytest.approx(copied.timing.median_ms * read.params["bytes"] / copied.params["bytes"])
        assert point.ratio(DISPATCH, WEIGHT_READ) > 0
    [bf16] = bench_sweep("matmul_gelu_softmax", SMALL, [1], device="cpu", dtype="bfloat16", table=table,
                         use_compile=False, rounds=1, wall=True)
    assert bf16.points[0].row(WEIGHT_READ).params["bytes"] == 48 * 40 * 2 and bf16.dtype == "bfloat16"


def test_training_mode_batchnorm_skips_batch_1_and_the_training_step_sweeps(tmp_path):
    shape = {"batch_size": 16, "in_features": 24, "out_features": 16}
    [sweep] = bench_sweep("gemm_bn", shape, [1, 3], device="cpu", table=tmp_path / "t.json", use_compile=False,
                          rounds=1, step="forward+backward", wall=True)
    first, second = sweep.points
    assert first.rows == [] and "batch >= 2" in first.note
    assert second.row(DISPATCH).timing is not None and second.row(WALL_PREFIX + DISPATCH).timing is not None
    assert second.row(WEIGHT_READ) is None  # the weight-read floor is a forward's
    assert second.row(FLOOR).note.startswith("cuBLAS forward GEMM + weight-gradient GEMM")


def test_time_wall_includes_everything_the_call_waits_for():
    timings = time_wall({"sleep": lambda: time.sleep(0.003), "nothing": lambda: None}, "cpu", rounds=2, per_round=3)
    assert timings["sleep"].median_ms >= 3.0 and timings["sleep"].reps == 6
    assert timings["nothing"].median_ms < 1.0


def _sweep(batch_times: dict) -> SweepReport:
    points = []
    for batch, (dispatch, floor, wall_dispatch, wall_floor, weight) in batch_times.items():
        rows = [BenchRow(name, role, {}, Timing(ms, ms, ms, 3), note) for name, role, ms, note in (
            (DISPATCH, "dispatch", dispatch, "triton (nearest batch (batch_size=1024,n=8))"), ("eager", "baseline", 9.0, ""),
            (FLOOR, "floor", floor, ""), (WEIGHT_READ, "floor", weight, ""),
            (WALL_PREFIX + DISPATCH, "wall", wall_dispatch, ""), (WALL_PREFIX + FLOOR, "wall", wall_floor, ""))]
        points.append(SweepPoint(batch, rows))
    return SweepReport("matmul_gelu_softmax", {"batch_size": 1024, "n": 8}, "batch_size", "bfloat16", "bf16", "any",
                       "forward", {"kind": "cuda", "name": "H100"}, points + [SweepPoint(2, [], "not measured: why")])


def test_the_table_has_a_row_per_batch_and_marks_the_small_batch_targets():
    text = "\n".join(sweep_section([_sweep({1: (0.06, 0.05, 0.30, 0.10, 0.04), 8: (0.07, 0.05, 0.30, 0.10, 0.04),
                                             32: (0.05, 0.05, 0.12, 0.10, 0.045)})]))
    assert "### matmul_gelu_softmax batch_size×8 (bf16, bfloat16 model, any)" in text
    assert ("| 1 | triton (nearest batch (batch_size=1024,n=8)) | 0.0600 | 9.0000 | - | 0.0500 | 0.3000 | - | - | - | "
            "0.1000 | 1.200 | 3.000 (target 1.5: missed by 100.0%) | 1.500 (target 1.25: missed by 20.0%) |") in text
    assert "| 8 | triton (nearest batch (batch_size=1024,n=8)) |" in text and "| 1.400 | 3.000 | 1.750 |" in text  # no targets at 8
    assert "| 32 |" in text and "| 1.000 | 1.200 | 1.111 |" in text  # met: no mark
    assert "| 2 | not measured: why |" in text
    assert sweep_section([]) == []


def test_a_training_batchnorm_sweep_holds_batch_2_to_the_batch_1_targets():
    """gemm_bn in training cannot run batch 1: its sweeps measure 2, which the targets then mark."""
    sweep = _sweep({2: (0.06, 0.05, 0.30, 0.10, 0.04), 3: (0.06, 0.05, 0.30, 0.10, 0.04)})
    sweep.points = [p for p in sweep.points if p.rows]
    assert "| 2 | triton" in "\n".join(sweep.markdown()) and "target 1.25" not in "\n".join(sweep.markdown())
    sweep.problem, sweep.mode = "gemm_bn", "train"
    assert sweep.target_batches() == (2, 32)
    text = "\n".join(sweep.markdown())
    assert text.count("(target 1.25: missed by 20.0%)") == 1 and text.count("(target 1.5: missed") == 1, text
    sweep.mode = "eval"
    assert sweep.target_batches() == (1, 32)


def test_sweeps_round_trip_and_render_with_the_reports(tmp_path, table):
    sweeps = bench_sweep("matmul_gelu_softmax", SMALL, [2, 12], device="cpu", table=table, use_compile=False, rounds=1)
    save_sweeps(sweeps, tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").glob("*.json")] == ["matmul_gelu_softmax-sweep-x48-x40-fp32-any.json"]
    [loaded] = load_sweeps(tmp_path / "out")
    assert loaded.to_dict() == sweeps[0].to_dict()
    target = tmp_path / "B.md"
    assert main(["bench", "--from-out", "--out", str(tmp_path / "out"), "--markdown", str(target)]) == 0
    text = target.read_text()
    assert text.index("## Batch sweeps") < text.index("### matmul_gelu_softmax batch_size×48×40 (fp32, any)") \
        < text.index("## How it was measured")


def test_cli_sweep_and_its_errors(tmp_path, capsys):
    base = ["bench", "kb2-99", "--shape", "batch_size=4,in_features=16,out_features=8", "--device", "cpu", "--no-compile",
            "--rounds", "1", "--out", str(tmp_path / "out")]
    assert main(base + ["--batches", "1,5", "--wall", "--markdown", str(tmp_path / "S.md")]) == 0
    assert "| 5 | eager (no entry: reference) |" in capsys.readouterr().out
    assert "wall / floor's wall" in (tmp_path / "S.md").read_text()
    assert main(base + ["--wall"]) == 2 and "--batches" in capsys.readouterr().err
    assert main(base + ["--batches", "0,4"]) == 2 and "ints >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base + ["--batches", "1,x"])
    assert "comma-separated ints" in capsys.readouterr().err
