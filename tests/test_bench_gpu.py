"""On the GPU: `autofuse bench`'s bfloat16-model rows, its batch sweep and its wall times, compiled for real.

The CPU tests (test_bench_bfloat16_model.py, test_bench_sweep.py) check the rows' logic; these
check what only a GPU shows: the triton variants pass the gate on a bfloat16 model and are
timed, the weight-read floor comes from a plausible copy bandwidth, a wall time per call holds
the GPU time it waits for, and torch.compile's reduce-overhead (CUDA graphs) runs per batch.
"""

import pytest

from autofuse.bench.floors import COPY, WEIGHT_READ
from autofuse.bench.run import DISPATCH, FLOOR, bench
from autofuse.bench.sweep import bench_sweep
from autofuse.bench.sweep_report import REDUCE_OVERHEAD, WALL_PREFIX

pytestmark = pytest.mark.gpu
SHAPE = {"batch_size": 256, "in_features": 1024, "out_features": 1000}


@pytest.mark.parametrize("step", ["forward", "forward+backward"])
def test_the_triton_variant_is_gated_and_timed_on_a_bfloat16_model(tmp_path, step):
    [report] = bench("matmul_gelu_softmax", SHAPE, device="cuda", dtype="bfloat16", table=tmp_path / "t.json",
                     use_compile=False, rounds=2, step=step)
    triton = report.row("triton")
    assert triton is not None and triton.timing is not None, triton and triton.note
    assert report.row(FLOOR).timing is not None and report.row(DISPATCH).timing is not None
    # cublas_epilogue serves a bfloat16 model's forward only: its autograd keys are triton's
    cublas = report.row("cublas_epilogue")
    if step == "forward":
        assert cublas is not None and cublas.timing is not None, cublas and cublas.note
    else:
        assert cublas is None or cublas.timing is None


@pytest.mark.parametrize("dtype,precision", [("bfloat16", "bf16"), ("float32", "fp32")])
def test_the_sweep_times_wall_and_weight_read_at_small_batches(tmp_path, dtype, precision):
    shape = {"batch_size": 1024, "in_features": 4096, "out_features": 4096}
    [sweep] = bench_sweep("matmul_gelu_softmax", shape, [1, 32], device="cuda", dtype=dtype, precision=precision,
                          table=tmp_path / "t.json", rounds=3, wall=True)
    for point in sweep.points:
        rows = {r.candidate: r for r in point.rows}
        assert all(rows[name].timing is not None for name in (
            DISPATCH, "eager", "torch.compile", FLOOR, COPY, WEIGHT_READ, WALL_PREFIX + DISPATCH,
            WALL_PREFIX + "eager", WALL_PREFIX + "torch.compile", WALL_PREFIX + REDUCE_OVERHEAD, WALL_PREFIX + FLOOR)), \
            {name: r.note for name, r in rows.items()}
        gbps = rows[COPY].params["bytes"] / rows[COPY].timing.median_ms / 1e6
        assert 200 < gbps < 10_000, gbps  # an H100 copies at ~3 TB/s, an H200 ~4
        assert rows[WEIGHT_READ].params["bytes"] == 4096 * 4096 * (2 if dtype == "bfloat16" else 4)
        # A wall time waits for the call's GPU work (timed without the host, back to back): never less.
        assert rows[WALL_PREFIX + FLOOR].timing.median_ms >= 0.9 * rows[FLOOR].timing.median_ms
        assert rows[WALL_PREFIX + DISPATCH].timing.median_ms >= 0.9 * rows[DISPATCH].timing.median_ms
