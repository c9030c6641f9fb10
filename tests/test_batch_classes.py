"""Batch classes: a tune at batch B writes gated entries for its family's other batches, and the
runtime serves every batch from the nearest entry that passed the gate around it."""

import dataclasses
import json
import logging

import pytest
import torch
from helpers import assert_close, module_for, record, use_test_plugins

import autofuse
from autofuse.core import plugins, registry
from autofuse.kernels.triton import variant as triton_variant
from autofuse.serve import dispatch, graphs
from autofuse.serve.table import DispatchKey, DispatchTable
from autofuse.tuning import batch_classes
from autofuse.tuning.budget import BUDGETS

needs_triton = pytest.mark.skipif(triton_variant.triton_missing() is not None, reason="needs triton")
TUNED = {"batch_size": 16, "in_features": 48, "out_features": 40}
IN, OUT = 12, 10  # the hand-written tables' family


def entries_by_batch(path, problem="matmul_gelu_softmax", key="dtype=float32,precision=fp32,mode=any,autograd=false"):
    doc = json.loads(path.read_text())
    [device] = doc["devices"].values()
    return {int(skey.split(",")[0].split("=")[1]): by_key[key]
            for skey, by_key in device["problems"][problem].items() if key in by_key}


@pytest.mark.parametrize("problem, shape, mode, want", [
    ("matmul_gelu_softmax", 1024, "any", [1, 8, 64, 512, 2048]),
    ("gemm_bn", 1024, "train", [2, 8, 64, 512, 2048]),  # training BatchNorm needs two rows
    ("gemm_bn", 16384, "eval", [1, 8, 64, 512, 4096, 32768]),
    ("matmul_gelu_softmax", 16, "any", [1, 8, 32]),
    ("matmul_gelu_softmax", 1, "any", [2]),
])
def test_the_rungs_are_the_smallest_batch_powers_of_8_below_and_twice_the_tuned_one(problem, shape, mode, want):
    """The autograd ladder's; the forward's also stops at 32 where 32 lies strictly inside it."""
    prob = registry.get_problem(problem)
    tuned = {**TUNED, "batch_size": shape}
    for precision, extra in batch_classes.MEMORY_BOUND_RUNGS.items():
        assert batch_classes.rung_batches(prob, tuned, mode, precision, autograd=True) == want
        inside = [b for b in extra if batch_classes.smallest_batch(prob, mode) < b < shape]
        assert batch_classes.rung_batches(prob, tuned, mode, precision) == sorted(want + inside)


def test_the_forward_ladder_has_a_rung_at_32_where_tiles_of_32_rows_serve():
    prob = registry.get_problem("gemm_bn")
    for precision in ("fp32", "ieee"):
        assert batch_classes.rung_batches(prob, {**TUNED, "batch_size": 1024}, "train", precision) == [2, 8, 32, 64, 512,
                                                                                                      2048]
        assert batch_classes.rung_batches(prob, {**TUNED, "batch_size": 32}, "eval", precision) == [1, 8, 64]
        assert batch_classes.rung_batches(prob, {**TUNED, "batch_size": 33}, "eval", precision) == [1, 8, 32, 66]


def test_under_16_and_19_bit_products_the_forward_ladder_steps_through_the_memory_bound_hundreds():
    """bf16 and tf32 stay memory-bound to a few hundred rows, where neither 64's tile nor 512's serves."""
    prob = registry.get_problem("matmul_gelu_softmax")
    for precision in ("bf16", "tf32"):
        assert batch_classes.rung_batches(prob, {**TUNED, "batch_size": 1024}, "any", precision) == [
            1, 8, 32, 64, 128, 256, 512, 2048]
        assert batch_classes.rung_batches(prob, {**TUNED, "batch_size": 200}, "any", precision) == [1, 8, 32, 64, 128,
                                                                                                     400]
        assert batch_classes.rung_batches(prob, {**TUNED, "batch_size": 1024}, "any", precision, autograd=True) == [
            1, 8, 64, 512, 2048]


def test_a_small_rung_races_small_tiles_and_a_restricted_winner_its_stricter_precision():
    """A tf32 winner on 11-bit products (restricted to where it was gated) brings its variant at fp32
    along; below SMALL_BATCH the small-tile seeds come too; quick races fewer than full."""
    prob = registry.get_problem("matmul_gelu_softmax")
    tf32 = next(c for c in triton_variant.gemm_configs(48, "cpu") if c["operands"] == "round_host")
    spaces = {"triton": triton_variant.gemm_configs(48, "cpu"), "eager": [{}]}
    ranked = [("triton", c) for c in spaces["triton"][:5]]
    counts = {}
    for name, budget in BUDGETS.items():
        ladder = batch_classes.build_ladder(prob.name, {"variant": "triton", "params": tf32}, ranked, spaces, None,
                                            "tf32", budget, autograd=False)
        small = batch_classes.rung_candidates(ladder, prob, {**TUNED, "batch_size": 1}, "cpu", "tf32", budget)
        large = batch_classes.rung_candidates(ladder, prob, {**TUNED, "batch_size": 512}, "cpu", "tf32", budget)
        assert small[0].params == tf32 and small[0].precision is None  # the winner first
        stricter = [c for c in small if c.precision is not None]
        assert [(c.variant, c.precision) for c in stricter] == [("triton", "fp32")]
        assert triton_variant.OPERANDS[stricter[0].params["operands"]][0] == "fp32"
        assert any(c.params.get("block_n") == 32 for c in small)  # the interpreter's small tile
        assert not any(c.params.get("block_n") == 32 for c in large)
        assert any(c.variant == "eager" for c in small)
        counts[name] = len(small)
    assert counts["quick"] < counts["full"], counts


# -- dispatch over a family tuned with batch classes ---------------------------------

def write_family(monkeypatch):
    """A tf32 family tuned at 64: round_host (11-bit products, served only where gated) at 8, 64 and
    128, gated at those; at batch 1 it failed, and the rung serves the 3xTF32 split at fp32."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the triton kind is admitted on the CPU; nothing runs here
    configs = triton_variant.gemm_configs(IN, "cpu")
    tf32 = next(c for c in configs if c["operands"] == "round_host")
    fp32 = next(c for c in configs if c["operands"] == "split_host")
    rung = {"rung_of": f"batch_size=64,in_features={IN},out_features={OUT}"}
    for batch in (8, 64, 128):
        fields = {} if batch == 64 else rung
        record("matmul_gelu_softmax", batch, IN, OUT, variant="triton", precision="tf32", params=tf32,
               gated_batches=[8, 64, 128], **fields)
    record("matmul_gelu_softmax", 1, IN, OUT, variant="triton", precision="tf32", params=fp32, runs_at="fp32",
           gated_batches=[1], **rung)
    return tf32, fp32


@needs_triton
def test_each_batch_is_served_by_the_nearest_entry_gated_around_it(monkeypatch):
    tf32, fp32 = write_family(monkeypatch)
    module = module_for("matmul_gelu_softmax", precision="tf32")
    served = {}
    with torch.no_grad():
        for batch in (1, 3, 37, 63, 65, 128, 200):
            served[batch] = module.dispatch_info(torch.randn(batch, IN))
    assert (served[1]["source"], served[1]["precision"], served[1]["params"]) == ("tuned", "fp32", fp32)
    # 8 is nearer to 3 than 1 is, but its 11-bit products were gated at 8 and up: the rung at 1 serves.
    assert (served[3]["params"], served[3]["precision"]) == (fp32, "fp32"), served[3]
    assert "batch class of batch_size=64" in served[3]["source"] and "round_host" in served[3]["passed_over"][0]
    for batch in (37, 63, 65):
        assert (served[batch]["params"], served[batch]["precision"], served[batch]["served_from"]) == \
            (tf32, "tf32", f"batch_size=64,in_features={IN},out_features={OUT}"), served[batch]
    assert (served[128]["source"], served[128]["rung_of"]) == ("tuned", f"batch_size=64,in_features={IN},out_features={OUT}")
    assert served[200]["params"] == fp32, served[200]  # past every gated batch of round_host


def test_at_equal_distance_the_smaller_batch_serves_first_whatever_the_table_order():
    """16 lies as far from the rung at 8 as from 32; the table's sorted keys put 32 first."""
    key = "dtype=float32,precision=bf16,mode=any,autograd=false"
    shapes = {f"batch_size={b},in_features={IN},out_features={OUT}": {key: {"variant": f"at{b}"}}
              for b in (1024, 32, 64, 8)}
    order = dispatch._by_batch_distance(shapes, {"batch_size": 16, "in_features": IN, "out_features": OUT}, key,
                                        "batch_size")
    assert [entry["variant"] for _, entry in order] == ["at8", "at32", "at64", "at1024"]


def test_a_memory_bound_batch_goes_to_a_rung_whose_tile_takes_it_in_one_reading_of_the_weight():
    """37 rows are nearer the rung at 32 than at 64, but rung 32's 32-row tile takes them in two
    tiles, each reading the weight: rung 64's 64-row tile serves first (22 at bf16, H200: 0.0553
    ms against 0.0690). Where no memory-bound rung's tile takes the batch in one (100 rows), or the
    call is not memory-bound (200), the nearest serves as before."""
    key = "dtype=float32,precision=bf16,mode=any,autograd=false"
    rows = {1: 16, 8: 16, 32: 32, 64: 64, 512: 128, 1024: 128}
    shapes = {f"batch_size={b},in_features={IN},out_features={OUT}": {key: {"variant": f"at{b}", "rows": r}}
              for b, r in rows.items()}

    def order(batch, tile_rows=lambda entry: entry["rows"]):
        shape = {"batch_size": batch, "in_features": IN, "out_features": OUT}
        return [entry["variant"] for _, entry in dispatch._by_batch_distance(shapes, shape, key, "batch_size", tile_rows)]

    assert order(37) == ["at64", "at32", "at8", "at512", "at1024", "at1"]  # then as before: rung 64 may be restricted
    assert order(37, tile_rows=None)[0] == "at32"  # without tiles known: the nearest
    assert order(16)[:2] == ["at8", "at32"]  # rung 8's 16-row tile takes 16 rows: the tie rule
    assert order(100)[:2] == ["at64", "at32"]  # two tiles of 64 beat one of rung 512's (H200: 0.0785 against 0.0922)
    assert order(200)[0] == "at512"


def test_up_to_256_rows_a_call_the_nearest_tile_would_split_goes_to_a_memory_bound_rung_that_takes_it_in_one():
    """A bf16 ladder with rungs at 128 (a 128-row tile) and 256 (cuBLAS-based: no tile, it picks its
    kernel per call): 80 rows, nearer 64, go to rung 128's tile; 180, nearer 128, to rung 256; past
    256 rows, or where only a compute-bound rung (512) would take the call, the nearest serves."""
    key = "dtype=float32,precision=bf16,mode=any,autograd=false"
    rows = {1: 16, 8: 16, 32: 32, 64: 64, 128: 128, 256: None, 512: None, 1024: 128}
    shapes = {f"batch_size={b},in_features={IN},out_features={OUT}": {key: {"variant": f"at{b}", "rows": r}}
              for b, r in rows.items()}

    def order(batch, without=()):
        shape = {"batch_size": batch, "in_features": IN, "out_features": OUT}
        held = {k: v for k, v in shapes.items() if int(k.split(",")[0].split("=")[1]) not in without}
        return [entry["variant"] for _, entry in dispatch._by_batch_distance(held, shape, key, "batch_size",
                                                                              lambda entry: entry["rows"])]

    assert order(80)[:3] == ["at128", "at256", "at64"]
    assert order(180)[:2] == ["at256", "at128"]
    assert order(300)[0] == "at256"  # the nearest: no tile known
    assert order(40)[:2] == ["at64", "at128"]  # the nearest of those that take it in one first
    assert order(100, without=(128, 256))[:2] == ["at64", "at32"]  # rung 512's cuBLAS entry was made for 512 rows
    assert order(200, without=(256,))[0] == "at128"  # nothing up to 256 takes it in one: the nearest


@needs_triton
def test_the_runtime_reads_the_rows_per_tile_of_the_entries_configurations(monkeypatch):
    """Rungs at 16 (a 16-row tile) and 64 (a 32-row tile): 20 rows, nearer 16, go to rung 64's tile,
    which takes them in one; 12 rows stay at 16."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the triton kind is admitted on the CPU; nothing runs here
    configs = triton_variant.gemm_configs(IN, "cpu", 20)
    tile = {rows: next(c for c in configs if c["block_m"] == rows and c["operands"] == "split_host") for rows in (16, 32)}
    for batch, rows in ((16, 16), (64, 32)):
        record("matmul_gelu_softmax", batch, IN, OUT, variant="triton", params=tile[rows])
    module = module_for("matmul_gelu_softmax")
    with torch.no_grad():
        served = {batch: module.dispatch_info(torch.randn(batch, IN)) for batch in (12, 20)}
    assert served[20]["params"] == tile[32] and served[20]["served_from"].startswith("batch_size=64,"), served[20]
    assert served[12]["params"] == tile[16] and served[12]["served_from"].startswith("batch_size=16,"), served[12]


@needs_triton
def test_a_rung_that_runs_at_a_stricter_precision_is_built_at_it(monkeypatch):
    _, fp32 = write_family(monkeypatch)
    module = module_for("matmul_gelu_softmax", precision="tf32")
    with torch.no_grad():
        module.dispatch_info(torch.randn(1, IN))
    [variant] = [call for call in module._autofuse.ready.values() if getattr(call, "name", None) == "triton"]
    assert variant.precision == "fp32" and variant.params == fp32 and variant.mode() == "3xtf32"


@pytest.mark.parametrize("runs_at", ["bf16", "fast"])
def test_a_rung_that_would_run_looser_than_its_key_is_passed_over(runs_at, caplog):
    record("matmul_gelu_softmax", 8, IN, OUT, precision="tf32", runs_at=runs_at)
    module = module_for("matmul_gelu_softmax", precision="tf32")
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="autofuse"):
        info = module.dispatch_info(torch.randn(8, IN))
    assert info["variant"] == "eager" and info["source"].endswith("reference"), info
    assert "passing over the entry tuned (simplified)" in caplog.text and repr(runs_at) in caplog.text.replace(
        f"runs at {runs_at}", repr(runs_at)), caplog.text


def test_a_table_without_batch_classes_is_served_as_before():
    """Only the nearest batch's entry is tried: an old table whose nearest entry cannot serve
    falls back to the reference, as it did, not to a farther entry."""
    record("matmul_gelu_softmax", 8, IN, OUT, params={"no_such_param": 1})
    record("matmul_gelu_softmax", 64, IN, OUT)
    record("matmul_gelu_softmax", 32, IN, OUT + 1)  # another family
    module = module_for("matmul_gelu_softmax")
    with torch.no_grad():
        near_8, near_64 = module.dispatch_info(torch.randn(20, IN)), module.dispatch_info(torch.randn(40, IN))
    assert near_8["source"] == "unusable entry: reference", near_8
    family = f"batch_size=64,in_features={IN},out_features={OUT}"
    assert (near_64["variant"], near_64["source"]) == ("simplified", f"nearest batch ({family})")


# -- a tune writes them ------------------------------------------------------------------

@pytest.fixture
def batch_decoys(monkeypatch):
    use_test_plugins(monkeypatch, "batch_decoys")
    yield
    monkeypatch.delenv("AUTOFUSE_PLUGINS")
    plugins.reset_plugin_manager()


def test_a_variant_wrong_only_at_batch_one_never_serves_batch_one(batch_decoys, tmp_path):
    """It wins at 16 and at the rungs 8 and 32; at 1 the gate runs and fails it, and eager's rung
    entry serves. Without batch classes the entry at 16 would have served batch 1 (checked too).
    The full budget gates every candidate: under quick a decoy no faster than eager may go ungated
    on the CPU's noisy microseconds, and this is about what serves batch 1."""
    kwargs = dict(device="cpu", seed=3, variants=["wrong_at_batch_one", "eager"], autograd_entry=False, progress=False,
                  budget="full")
    [result] = autofuse.tune("matmul_gelu_softmax", TUNED, table=tmp_path / "t.json", **kwargs)
    assert result.winner["variant"] == "wrong_at_batch_one" and result.winner["gated_batches"] == [8, 16, 32]
    entries = entries_by_batch(tmp_path / "t.json")
    assert sorted(entries) == [1, 8, 16, 32]
    assert {b: entries[b]["variant"] for b in (1, 8, 32)} == {1: "eager", 8: "wrong_at_batch_one", 32: "wrong_at_batch_one"}
    for batch in (1, 8, 32):
        rung = entries[batch]
        assert rung["rung_of"] == "batch_size=16,in_features=48,out_features=40" and rung["eager_ms"] > 0
        assert rung["candidates"]["wrong_at_batch_one"]["outcome"] == ("incorrect" if batch == 1 else "ok")
    module = autofuse.get_module("matmul_gelu_softmax", 48, 40, table=tmp_path / "t.json")
    x = torch.rand(1, 48)
    reference = registry.get_problem("matmul_gelu_softmax").model(48, 40).double()
    reference.load_state_dict(module.state_dict())
    with torch.no_grad():
        assert module.dispatch_info(x)["variant"] == "eager"
        assert_close(module(x), reference(x.double()), registry.get_problem("matmul_gelu_softmax").tolerance("fp32"))
        served = {b: module.dispatch_info(torch.rand(b, 48))["variant"] for b in (3, 15, 17, 32, 37)}
    assert served == {3: "wrong_at_batch_one", 15: "wrong_at_batch_one", 17: "wrong_at_batch_one",
                      32: "wrong_at_batch_one", 37: "wrong_at_batch_one"}, served

    autofuse.tune("matmul_gelu_softmax", TUNED, table=tmp_path / "old.json", batch_classes=False, **kwargs)
    assert sorted(entries_by_batch(tmp_path / "old.json")) == [16]
    old = autofuse.get_module("matmul_gelu_softmax", 48, 40, table=tmp_path / "old.json")
    with torch.no_grad():
        assert old.dispatch_info(x)["variant"] == "wrong_at_batch_one"  # what the rungs prevent


class ScriptedWorker:
    """A worker whose candidates take the times and gate verdicts a test gives them, by variant name;
    it records what it was asked (gated or timed only)."""

    def __init__(self, times: dict, wrong=(), broken=()):
        self.times, self.wrong, self.broken, self.asked = times, set(wrong), set(broken), []

    def call(self, op, payload, timeout):
        from autofuse.tuning.outcome import Outcome, TrialResult

        if op == "retime":
            job, candidates, rounds = payload
            return {c.label(): self._timing(c.variant) for c in candidates}
        job, candidate, reach, *gate = payload
        gate = gate[0] if gate else True
        if gate and payload[4:] and payload[4] is not None:
            assert payload[4].median_ms == self.times[candidate.variant]  # gated on its first timing
        self.asked.append((candidate.variant, "gate" if gate else "time"))
        if candidate.variant in self.broken:
            return TrialResult(Outcome.RUNTIME_FAILED, "it crashed")
        timing = self._timing(candidate.variant)
        if not gate:
            return TrialResult(Outcome.OUT_OF_REACH, "timed only", timing=timing)
        if candidate.variant in self.wrong:
            return TrialResult(Outcome.INCORRECT, "wrong", 1.0)
        return TrialResult(Outcome.OK, None, 1e-7, timing)

    def _timing(self, variant):
        from autofuse.tuning.timing import Timing

        t = self.times[variant]
        return Timing(t, t, t, 10)


def race(worker, names, budget="quick"):
    from autofuse.tuning.outcome import Candidate, Job

    job = Job("matmul_gelu_softmax", dict(TUNED), "cpu", "float32", "fp32", "any", 0)
    candidates = [Candidate(name, {}) for name in names]
    return batch_classes.run_rung(job, candidates, worker, 60.0, BUDGETS[budget])


def test_a_quick_rung_times_all_then_gates_the_fastest_first():
    """The winner's configuration comes first but is slow here: eager, fastest, is gated first, and
    a candidate beyond the reach of eager's time is never gated. A fastest candidate that fails the
    gate hands the turn to the next; one that crashed is recorded as it crashed."""
    worker = ScriptedWorker({"triton": 1.9, "simplified": 0.24, "eager": 0.21})
    result = race(worker, ["triton", "simplified", "eager"])
    assert [a for a in worker.asked if a[1] == "gate"] == [("eager", "gate"), ("simplified", "gate")]
    assert [r.result.outcome.value for r in result.rows] == ["out_of_reach", "ok", "ok"]
    assert "beyond the gated best's reach" in result.rows[0].result.reason
    assert result.entry["variant"] == "eager" and result.passed == {"eager[]", "simplified[]"}

    worker = ScriptedWorker({"triton": 0.1, "simplified": 0.24, "eager": 0.21}, wrong={"triton"}, broken={"cuda_tiled"})
    result = race(worker, ["triton", "cuda_tiled", "simplified", "eager"])
    assert [a for a in worker.asked if a[1] == "gate"] == [("triton", "gate"), ("eager", "gate"), ("simplified", "gate")]
    assert [r.result.outcome.value for r in result.rows] == ["incorrect", "runtime_failed", "ok", "ok"]

    worker = ScriptedWorker({"triton": 1.9, "simplified": 0.24, "eager": 0.21})
    race(worker, ["triton", "simplified", "eager"], budget="full")  # every candidate gated, in order
    assert worker.asked == [("triton", "gate"), ("simplified", "gate"), ("eager", "gate")]


def test_at_a_compute_bound_rung_the_simplest_race_only_where_nothing_else_passes():
    """kb2-99 fp32 (H200): eager ran 3.3-3.8x the winner at B, and its timing at rungs 512 and 2048
    cost 3.5 s of a 33 s batch-class phase without ever coming within reach."""
    from autofuse.tuning.outcome import Candidate, Job

    ladder = batch_classes.Ladder(Candidate("triton", {}), [], [Candidate("simplified", {}), Candidate("eager", {})],
                                  None, {}, speedup=3.75)
    quick, full = BUDGETS["quick"], BUDGETS["full"]
    assert ladder.fallbacks(512, quick) == {"simplified[]", "eager[]"}
    assert ladder.fallbacks(64, quick) == set()  # memory-bound: eager may win there
    assert ladder.fallbacks(512, full) == set()  # every candidate gated
    near = dataclasses.replace(ladder, speedup=batch_classes.FALLBACK_SPEEDUP * quick.reach)
    assert near.fallbacks(512, quick) == set() and dataclasses.replace(ladder, speedup=None).fallbacks(512, quick) == set()

    job = Job("matmul_gelu_softmax", dict(TUNED), "cpu", "float32", "fp32", "any", 0)
    names = ["triton", "simplified", "eager"]
    candidates = [Candidate(name, {}) for name in names]
    worker = ScriptedWorker({"triton": 0.7, "simplified": 2.7, "eager": 2.75})
    said = []
    result = batch_classes.run_rung(job, candidates, worker, 60.0, quick, lambda c, r: said.append(c.variant),
                                    ladder.fallbacks(512, quick))
    assert worker.asked == [("triton", "time"), ("triton", "gate")] and result.entry["variant"] == "triton"
    assert [r.result.reason for r in result.rows[1:]] == ["not raced: a fallback, and another candidate passed"] * 2
    assert sorted(said) == sorted(names)  # each candidate's outcome is told, the progress bar's total met
    # Where the winner fails there, the fallbacks race as any candidate does.
    worker = ScriptedWorker({"triton": 0.7, "simplified": 2.7, "eager": 2.75}, wrong={"triton"})
    result = batch_classes.run_rung(job, candidates, worker, 60.0, quick, None, ladder.fallbacks(512, quick))
    assert worker.asked == [("triton", "time"), ("triton", "gate"), ("simplified", "time"), ("eager", "time"),
                            ("simplified", "gate"), ("eager", "gate")]
    assert result.entry["variant"] == "simplified" and result.passed == {"simplified[]", "eager[]"}


class GateAt:
    """A worker that gates any candidate, failing it at the batches given; it records (batch, params) asked."""

    def __init__(self, fails_at=()):
        self.fails_at, self.asked = set(fails_at), []

    def call(self, op, payload, timeout):
        from autofuse.tuning.outcome import Outcome, TrialResult

        job, candidate, reach, gate = payload
        assert op == "evaluate" and gate
        batch = job.shape["batch_size"]
        self.asked.append((batch, candidate.params["block_m"]))
        return TrialResult(Outcome.INCORRECT, "wrong", 1.0) if batch in self.fails_at else TrialResult(Outcome.OK, None, 1e-7)


def test_restricted_rungs_are_gated_at_the_midpoints_so_every_batch_between_has_an_entry():
    """tf32 on the shipped table (H100) before this: scaled_fp16 rungs at 8 (gated [1, 8]) and 64
    ([64]), different tiles, and 9-63 served by neither (``only_where_gated``). Each restricted
    entry is gated where its neighbour's range would meet it, the geometric midpoint; an entry that
    passes anywhere (eager) or already gated around the midpoint is not asked. A midpoint that fails
    stays out of the entry's range."""
    from autofuse.serve.dispatch import serving
    from autofuse.serve.table import DispatchKey
    from autofuse.tuning.outcome import Job

    prob = registry.get_problem("matmul_gelu_softmax")
    shape = {"batch_size": 1024, "in_features": 8192, "out_features": 8192}
    triton = registry.variants(prob.name)["triton"]
    tiles = triton.small_batch_seeds({**shape, "batch_size": 8}, "cuda", "tf32", {"operands": "scaled_fp16", "tma": True})
    tiles += [c for c in triton.configs_for(shape, "cuda", "tf32") if c["operands"] == "scaled_fp16"]
    restricted = lambda block_m: next(c for c in tiles if c["block_m"] == block_m)  # noqa: E731
    family = {1: {"variant": "triton", "params": restricted(16), "gated_batches": [1, 8]},
              8: {"variant": "triton", "params": restricted(16), "gated_batches": [1, 8]},
              64: {"variant": "triton", "params": restricted(64), "gated_batches": [64]},
              512: {"variant": "eager", "params": {}, "gated_batches": [512]},
              1024: {"variant": "triton", "params": restricted(128), "gated_batches": [512, 1024]},
              2048: {"variant": "triton", "params": restricted(128)}}
    key = DispatchKey("float32", "tf32", "any", autograd=False)
    job = Job("matmul_gelu_softmax", dict(shape), "cuda", "float32", "tf32", "any", 0)
    worker = GateAt(fails_at={181})
    widened = batch_classes.bridge(prob, shape, job, key, family, worker, 60.0)
    # 1-8 and 512-1024 are covered already; 1024-2048 meet at 1448, 8-64 at 23, 64-512 at 181 (fails).
    assert worker.asked == [(23, 16), (23, 64), (181, 64), (1448, 128), (1448, 128)]
    assert widened == {8, 64, 1024, 2048}
    assert [family[b]["gated_batches"] for b in (8, 64, 512, 1024, 2048)] == [
        [1, 8, 23], [23, 64], [512], [512, 1024, 1448], [1448, 2048]]

    shapes = {f"batch_size={b},in_features=8192,out_features=8192": {key.to_str(): e} for b, e in family.items()}
    for batch in (9, 22, 23, 24, 63):
        served, _ = serving(shapes, prob, {**shape, "batch_size": batch}, key, "cuda", lacking_ok=True)
        assert served.entry["params"]["block_m"] == (16 if batch < 23 else 64), (batch, served.source)
    served, _ = serving(shapes, prob, {**shape, "batch_size": 100}, key, "cuda", lacking_ok=True)
    assert served.entry["variant"] == "eager"  # past 64's gated range: eager's rung at 512 serves


def test_a_rerun_with_nothing_new_measures_no_rung_again(tmp_path, monkeypatch):
    from autofuse.tuning import worker as worker_module

    calls = []
    real_call = worker_module.Worker.call
    monkeypatch.setattr(worker_module.Worker, "call",
                        lambda self, op, payload, timeout: calls.append(op) or real_call(self, op, payload, timeout))
    kwargs = dict(device="cpu", seed=5, variants=["eager", "simplified"], autograd_entry=False, progress=False,
                  table=tmp_path / "t.json")
    autofuse.tune("matmul_gelu_softmax", TUNED, **kwargs)
    assert sorted(entries_by_batch(tmp_path / "t.json")) == [1, 8, 16, 32]
    calls.clear()
    autofuse.tune("matmul_gelu_softmax", TUNED, **kwargs)
    assert calls == [], calls
    assert DispatchTable(tmp_path / "t.json").load()["devices"]


def test_classes_only_adds_the_batch_classes_of_the_entry_the_table_holds_and_searches_nothing(tmp_path, monkeypatch):
    """A key tuned without batch classes, then ``classes_only``: the rungs 1, 8 and 32 appear, raced
    as after a search; the entry at 16 keeps what its tune measured and gains the batches its
    configuration passed; no candidate at 16 is measured again."""
    from autofuse.tuning import worker as worker_module

    table = tmp_path / "t.json"
    kwargs = dict(device="cpu", seed=5, variants=["eager", "simplified"], autograd_entry=False, progress=False,
                  table=table)
    [tuned] = autofuse.tune("matmul_gelu_softmax", TUNED, batch_classes=False, **kwargs)
    before = entries_by_batch(table)[16]
    assert sorted(entries_by_batch(table)) == [16] and "gated_batches" not in before
    shapes = []
    real_call = worker_module.Worker.call
    monkeypatch.setattr(worker_module.Worker, "call", lambda self, op, payload, timeout: shapes.append(
        payload[0].shape["batch_size"]) or real_call(self, op, payload, timeout))
    [added] = autofuse.tune("matmul_gelu_softmax", TUNED, classes_only=True, **kwargs)
    assert shapes and 16 not in shapes, shapes  # the rungs' races only
    entries = entries_by_batch(table)
    assert sorted(entries) == [1, 8, 16, 32]
    for batch in (1, 8, 32):
        assert entries[batch]["rung_of"] == "batch_size=16,in_features=48,out_features=40"
    after = entries[16]
    assert {k: v for k, v in after.items() if k != "gated_batches"} == before
    assert added.winner["variant"] == tuned.winner["variant"] and added.rows == [] and added.classes_only
    assert 16 in after["gated_batches"]


def test_rungs_races_only_the_batch_classes_named_and_keeps_the_others_and_their_gated_batches(tmp_path, monkeypatch):
    """The full budget gates every candidate at every rung: under quick, the winner at B may go ungated
    at rung 8 on the CPU's noisy microseconds (CI under load: its gated batches were 1, 16 and 32)."""
    from autofuse.tuning import worker as worker_module

    table = tmp_path / "t.json"
    kwargs = dict(device="cpu", seed=5, variants=["eager", "simplified"], autograd_entry=False, progress=False,
                  table=table, budget="full")
    autofuse.tune("matmul_gelu_softmax", TUNED, **kwargs)
    before = entries_by_batch(table)
    assert sorted(before) == [1, 8, 16, 32]
    shapes = []
    real_call = worker_module.Worker.call
    monkeypatch.setattr(worker_module.Worker, "call", lambda self, op, payload, timeout: shapes.append(
        payload[0].shape["batch_size"]) or real_call(self, op, payload, timeout))
    autofuse.tune("matmul_gelu_softmax", TUNED, classes_only=True, rungs=[1], **kwargs)
    after = entries_by_batch(table)
    assert shapes and set(shapes) == {1}, shapes
    assert after[8] == before[8] and after[32] == before[32]  # not raced: as the table held them
    assert after[1]["date"] >= before[1]["date"] and after[1]["rung_of"] == before[1]["rung_of"]
    # The entry at B keeps the batches its configuration passed at the rungs not raced again.
    kept = set(before[16]["gated_batches"]) - {1}
    assert kept <= set(after[16]["gated_batches"]) and 8 in kept


def test_rungs_must_be_batch_classes_of_the_shape(tmp_path):
    kwargs = dict(device="cpu", variants=["eager"], progress=False, table=tmp_path / "t.json")
    with pytest.raises(autofuse.InputError, match=r"no batch class at \[16\]: its rungs are \[1, 8, 32\]"):
        autofuse.tune("matmul_gelu_softmax", TUNED, rungs=[1, 16], **kwargs)
    with pytest.raises(autofuse.InputError, match="needs batch_classes on"):
        autofuse.tune("matmul_gelu_softmax", TUNED, rungs=[1], batch_classes=False, **kwargs)
    for wrong in ("1,8", []):
        with pytest.raises(autofuse.InputError, match="non-empty list of batch sizes"):
            autofuse.tune("matmul_gelu_softmax", TUNED, rungs=wrong, **kwargs)


def test_classes_only_refuses_a_key_the_table_does_not_hold(tmp_path):
    kwargs = dict(device="cpu", variants=["eager"], progress=False, table=tmp_path / "t.json", classes_only=True)
    with pytest.raises(autofuse.InputError, match="holds no usable entry"):
        autofuse.tune("matmul_gelu_softmax", TUNED, autograd_entry=False, **kwargs)
    autofuse.tune("matmul_gelu_softmax", TUNED, device="cpu", variants=["eager"], progress=False, seed=1,
                  table=tmp_path / "t.json", autograd_entry=False, batch_classes=False)
    with pytest.raises(autofuse.InputError, match="no autograd entry beside it"):
        autofuse.tune("matmul_gelu_softmax", TUNED, **kwargs)
    with pytest.raises(autofuse.InputError, match="needs batch_classes on"):
        autofuse.tune("matmul_gelu_softmax", TUNED, device="cpu", table=tmp_path / "t.json", classes_only=True,
                      batch_classes=False)


# -- on the GPU ---------------------------------------------------------------------------

GPU_CASES = [("matmul_gelu_softmax", "any"), ("matmul_clamp_lse_mish", "any"), ("gemm_bn", "train"), ("gemm_bn", "eval")]


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("problem, mode", GPU_CASES)
def test_the_small_batch_tiles_pass_the_gate_on_the_gpu(problem, mode, precision):
    """The small-tile seeds at odd small batches, K = 1000 (the masked K tail), against float64.

    Two outcomes are the gate's to refuse, not failures: tf32's 11-bit products at any small batch
    (H100: gemm_bn eval at batch 7 put 25 of 5439 outputs past the tf32 tolerance; they serve only
    where gated, ``only_where_gated``), and a training BatchNorm's running variance at its smallest
    batch (2) under bf16, whose two-sample variance cancels (H100: 9 of 777 past the tolerance on
    large inputs). A rung whose seeds fail races its other candidates and the reference."""
    from autofuse.tuning.gate import check_cases, check_variant

    prob, cls = registry.get_problem(problem), registry.get_variant(problem, "triton")
    smallest = batch_classes.smallest_batch(prob, mode)
    for batch in (smallest, 7, 37, 100):
        shape = dict(zip(prob.dims, (batch, 1000, 777)))
        for params in cls.small_batch_seeds(shape, "cuda", precision, triton_variant.DEFAULTS[precision])[:3]:
            check = check_variant(cls(precision, **params), prob, check_cases(prob, shape, 1), "cuda",
                                  dtype=torch.float32, mode=mode)
            refusable = precision == "tf32" or (precision == "bf16" and mode == "train" and batch == smallest)
            if refusable and not check.ok and "off by more than" in check.reason:
                continue  # accuracy, which the gate refuses; a crash raises and a broken contract fails below
            assert check.ok, f"{problem} {mode} {precision} batch {batch} {params}: {check.reason}"


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("precision", ["tf32", "fp32", "bf16"])
def test_a_gpu_tune_serves_every_batch_from_1_to_2b_with_a_gated_entry(tmp_path, precision):
    """A tune at 256 writes rungs at 1, 8, 32, 64 and 512 (and 128 under tf32 and bf16); every batch
    from 1 to 512 is then served by a table entry (never "no entry" or "unusable entry": the
    reference untuned), within the precision's tolerance of float64."""
    shape = {"batch_size": 256, "in_features": 1024, "out_features": 1024}
    table = tmp_path / "t.json"
    [result] = autofuse.tune("matmul_gelu_softmax", shape, device="cuda", precision=precision, table=table, seed=1,
                             variants=["triton", "cublas_epilogue", "eager"], autograd_entry=False, progress=False,
                             n_trials=6)
    key = f"dtype=float32,precision={precision},mode=any,autograd=false"
    entries = entries_by_batch(table, key=key)
    assert sorted(entries) == [1, 8, 32, 64] + ([128] if precision != "fp32" else []) + [256, 512], sorted(entries)
    print(f"\n{precision}: tuned in {result.seconds:.0f} s; " + "; ".join(
        f"{b}: {e['variant']} {e.get('runs_at', '')} {e['median_ms']:.4g} ms (eager {e['eager_ms']:.4g})"
        for b, e in sorted(entries.items())))
    prob = registry.get_problem("matmul_gelu_softmax")
    module = autofuse.get_module("matmul_gelu_softmax", 1024, 1024, table=table, precision=precision).cuda()
    for batch in (1, 2, 3, 8, 37, 100, 128, 200, 255, 257, 512):
        x = torch.rand(batch, 1024, device="cuda")
        with torch.no_grad():
            info, out = module.dispatch_info(x), module(x)
        assert "reference" not in info["source"], (batch, info)
        reference = prob.model(1024, 1024).double().cuda()
        reference.load_state_dict(module.state_dict())
        with torch.no_grad():
            want = reference(x.double())
        assert_close(out, want, prob.tolerance(precision), what=f"batch {batch} ({info['source']}, {info['variant']})")


def _gaps_script():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "gpu" / "batch_class_gaps.py"
    spec = importlib.util.spec_from_file_location("batch_class_gaps", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_the_gaps_script_lists_tuned_keys_without_batch_classes_and_the_tunes_that_add_them(tmp_path, capsys):
    """benchmarks/gpu/batch_class_gaps.py: a forward key tuned alone is listed with the tune that adds
    its batch classes without a search (same shape, dtype, precision and mode, the variants it
    raced; its autograd entry's too where the table holds one); one with rungs that serve every
    batch is not, nor is an autograd entry (its classes come with its forward key's). A key with
    rungs that leave batches unserved is listed after them: tf32 operands gated at 8 and at 64 only,
    different tiles, before ``bridge`` gated them between."""
    script = _gaps_script()
    tuned, rung = "batch_size=1024,in_features=64,out_features=32", "batch_size=1,in_features=64,out_features=32"
    alone = "dtype=float32,precision=tf32,mode=train,autograd=false"
    laddered = "dtype=float32,precision=fp32,mode=train,autograd=false"
    holed = "dtype=float32,precision=tf32,mode=eval,autograd=false"
    triton = registry.variants("gemm_bn")["triton"]
    small = {"batch_size": 8, "in_features": 64, "out_features": 32}
    tiles = triton.small_batch_seeds(small, "cuda", "tf32", {"operands": "scaled_fp16", "tma": True})[:1] + [
        c for c in triton.configs_for({**small, "batch_size": 1024}, "cuda", "tf32") if c["operands"] == "scaled_fp16"]

    def entry(variant, params=None, **extra):
        return {"variant": variant, "params": params or {}, "candidates": {"eager": {}, variant: {}}, **extra}

    def at(batch):
        return f"batch_size={batch},in_features=64,out_features=32"

    doc = {"schema": 1, "version": 1, "devices": {"cuda|X": {"fingerprint": {}, "problems": {"gemm_bn": {
        tuned: {alone: entry("triton"), laddered: entry("eager"), alone.replace("false", "true"): entry("eager"),
                holed: entry("triton", tiles[-1], gated_batches=[512, 1024, 2048])},
        rung: {laddered: entry("eager", rung_of=tuned), holed: entry("triton", tiles[0], rung_of=tuned, gated_batches=[1, 8])},
        at(8): {holed: entry("triton", tiles[0], rung_of=tuned, gated_batches=[1, 8])},
        at(64): {holed: entry("triton", tiles[1], rung_of=tuned, gated_batches=[64, 512])},
        at(512): {holed: entry("triton", tiles[-1], rung_of=tuned, gated_batches=[512, 1024, 2048])},
        at(2048): {holed: entry("triton", tiles[-1], rung_of=tuned, gated_batches=[512, 1024, 2048])}}}}}}
    table = tmp_path / "table.json"
    table.write_text(json.dumps(doc))
    assert script.main(["--table", str(table), "--budget", "quick"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"2 tuned forward keys without batch classes or with unserved batches in {table}")
    assert out.index(f"gemm_bn at batch 1024, {alone}:") < out.index(f"gemm_bn at batch 1024, {holed}:")
    assert "precision=fp32" not in out
    assert script.unserved(doc["devices"]["cuda|X"]["problems"]["gemm_bn"], "gemm_bn", tuned,
                           DispatchKey.from_str(holed)) == list(range(9, 64))
    for b in (8, 64):  # the midpoint, 23, gated on both sides
        doc["devices"]["cuda|X"]["problems"]["gemm_bn"][at(b)][holed]["gated_batches"] += [23]
    table.write_text(json.dumps(doc))
    assert script.main(["--table", str(table), "--budget", "quick"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("1 tuned forward keys") and holed not in out
    assert (f"autofuse tune gemm_bn --shape {tuned} --dtype float32 --precision tf32 --mode train "
            f"--variants eager,triton --batch-classes-only --table {table} --no-progress --budget quick") in out
    del doc["devices"]["cuda|X"]["problems"]["gemm_bn"][tuned][alone.replace("false", "true")]
    table.write_text(json.dumps(doc))
    assert script.main(["--table", str(table)]) == 0
    assert "--batch-classes-only --no-autograd-entry" in capsys.readouterr().out


def test_the_gaps_script_keeps_to_the_gpu_it_is_asked_for(tmp_path, capsys):
    """``--gpu NAME``: only the device sections whose name holds NAME are listed (a run on one GPU
    cannot mend another's keys); a NAME no section holds is an error, not an empty listing."""
    script = _gaps_script()
    tuned = "batch_size=1024,in_features=64,out_features=32"
    fp32, tf32 = (f"dtype=float32,precision={p},mode=train,autograd=false" for p in ("fp32", "tf32"))
    doc = {"schema": 1, "version": 1, "devices": {
        f"cuda|NVIDIA {gpu}|sm_90": {"fingerprint": {}, "problems": {"gemm_bn": {tuned: {
            key: {"variant": "eager", "params": {}, "candidates": {"eager": {}}}}}}}
        for gpu, key in (("H100 80GB HBM3", fp32), ("H200", tf32))}}
    table = tmp_path / "table.json"
    table.write_text(json.dumps(doc))
    assert script.main(["--table", str(table)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 tuned forward keys") and fp32 in out and tf32 in out
    assert script.main(["--table", str(table), "--gpu", "H200"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("1 tuned forward keys") and tf32 in out and fp32 not in out
    with pytest.raises(SystemExit):
        script.main(["--table", str(table), "--gpu", "A100"])
    assert "no device of" in capsys.readouterr().err


def test_the_gaps_script_lists_ladders_that_lack_a_rung_and_the_tune_that_races_only_those(tmp_path, capsys):
    """A family tuned before its ladder had a rung at 32: ``--missing-rungs`` lists it with a
    ``--rungs 32`` tune of its forward entry; a rung there, or an entry tuned there directly, ends
    that; an autograd entry (whose ladder has no 32) is never listed; the default listing is not
    changed by it (every batch is served). Under bf16 the ladder has since gained 128 and 256 too."""
    script = _gaps_script()
    key, grad = "dtype=float32,precision=fp32,mode=any,autograd=false", "dtype=float32,precision=fp32,mode=any,autograd=true"

    def at(batch):
        return f"batch_size={batch},in_features=64,out_features=32"

    def entry(**extra):
        return {"variant": "eager", "params": {}, "candidates": {"eager": {}, "simplified": {}}, **extra}

    family = {at(1024): {key: entry(), grad: entry()}}
    for batch in (1, 8, 64, 512, 2048):
        family[at(batch)] = {key: entry(rung_of=at(1024)), grad: entry(rung_of=at(1024))}
    doc = {"schema": 1, "version": 1, "devices": {"cuda|X": {"fingerprint": {}, "problems": {
        "matmul_gelu_softmax": family}}}}
    table = tmp_path / "table.json"
    table.write_text(json.dumps(doc))
    assert script.missing_rungs(doc) == [("matmul_gelu_softmax", at(1024), key, ["eager", "simplified"], [32])]
    assert script.main(["--table", str(table), "--missing-rungs"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"1 tuned forward keys whose batch classes lack rungs in {table}"), out
    assert (f"autofuse tune matmul_gelu_softmax --shape {at(1024)} --dtype float32 --precision fp32 "
            f"--variants eager,simplified --batch-classes-only --no-autograd-entry --rungs 32 --table {table}") in out
    assert script.main(["--table", str(table)]) == 0
    assert capsys.readouterr().out.startswith("0 tuned forward keys without batch classes")
    family[at(32)] = {key: entry()}  # tuned there directly: as good as a rung
    assert script.missing_rungs(doc) == []
    half = key.replace("fp32", "bf16")
    for by_key in family.values():
        by_key[half] = by_key.pop(key)
    assert script.missing_rungs(doc) == [("matmul_gelu_softmax", at(1024), half, ["eager", "simplified"], [128, 256])]


def test_the_gaps_script_lists_step_rungs_timed_before_a_date_and_the_tune_that_races_them_again(tmp_path, capsys):
    """``--timed-before``: a family whose training-step rungs at 8 and 512 rows were timed before the
    date (one without a date counts as before) is listed with a ``--rungs 8,512`` tune that keeps its
    autograd entry; its forward rungs' dates, the entry at B's and another family's do not list it;
    by default the date is the timer's fix (HOST_PACED_UNTIL). The tuned keys' own step entries
    timed before it are listed apart."""
    script = _gaps_script()
    key = "dtype=float32,precision=bf16,mode=any,autograd=false"
    grad = key.replace("false", "true")
    old, new = "2026-11-27T18:29:47+00:00", "2026-12-06T10:40:00+00:00"

    def at(batch):
        return f"batch_size={batch},in_features=64,out_features=32"

    def entry(date, **extra):
        return {"variant": "eager", "params": {}, "candidates": {"simplified": {}}, "date": date, **extra}

    family = {at(1024): {key: entry(old), grad: entry(old)}}
    for batch in (1, 8, 64, 512, 2048):
        family[at(batch)] = {key: entry(old, rung_of=at(1024)), grad: entry(new, rung_of=at(1024))}
    family[at(8)][grad]["date"] = old
    del family[at(512)][grad]["date"]
    other = {"batch_size=1024,in_features=64,out_features=64": {key: entry(old), grad: entry(old)}}
    doc = {"schema": 1, "version": 1, "devices": {"cuda|X": {"fingerprint": {}, "problems": {
        "matmul_gelu_softmax": {**family, **other}}}}}
    table = tmp_path / "table.json"
    table.write_text(json.dumps(doc))
    assert script.timed_before(doc, script.HOST_PACED_UNTIL) == [
        ("matmul_gelu_softmax", at(1024), key, ["eager", "simplified"], [8, 512])]
    assert script.timed_before(doc, "2026-11-01") == [
        ("matmul_gelu_softmax", at(1024), key, ["eager", "simplified"], [512])]
    assert script.main(["--table", str(table), "--timed-before"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"1 tuned forward keys whose training-step rungs were timed before {script.HOST_PACED_UNTIL}")
    assert (f"autofuse tune matmul_gelu_softmax --shape {at(1024)} --dtype float32 --precision bf16 "
            f"--variants eager,simplified --batch-classes-only --rungs 8,512 --table {table}") in out
    # the tuned keys' own step entries, which no --rungs tune re-times: both families', then one fresh
    assert script.tuned_steps_timed_before(doc, script.HOST_PACED_UNTIL) == [
        ("matmul_gelu_softmax", shape, grad, "eager", old) for shape in (at(1024), *other)]
    assert f"2 tuned keys' own training-step entries timed before {script.HOST_PACED_UNTIL}" in out
    family[at(1024)][grad]["date"] = new
    assert [found[1] for found in script.tuned_steps_timed_before(doc, script.HOST_PACED_UNTIL)] == [*other]


def test_the_gaps_script_runs_the_tunes_in_its_own_process_and_goes_on_past_a_failure(tmp_path, capsys, monkeypatch):
    table = tmp_path / "t.json"
    kwargs = dict(device="cpu", seed=5, variants=["eager", "simplified"], progress=False, table=table)
    autofuse.tune("matmul_gelu_softmax", TUNED, batch_classes=False, autograd_entry=False, **kwargs)
    autofuse.tune("matmul_gelu_softmax", TUNED, batch_classes=False, autograd_entry=False, precision="bf16", **kwargs)
    script = _gaps_script()
    real_tune, asked = autofuse.tune, []

    def tune(problem, shape, **options):  # the first key's tune fails as a stale entry would
        asked.append(options["precision"])
        if len(asked) == 1:
            raise autofuse.InputError("its entry is stale")
        return real_tune(problem, shape, **options)

    monkeypatch.setattr(autofuse, "tune", tune)
    assert script.main(["--table", str(table), "--run"]) == 1
    out = capsys.readouterr().out
    assert out.count("-> failed: its entry is stale") == 1 and out.count("-> batch classes added in") == 1, out
    assert sorted(asked) == ["bf16", "fp32"]
    done = "bf16" if asked[1] == "bf16" else "fp32"
    done_key = f"dtype=float32,precision={done},mode=any,autograd=false"
    assert sorted(entries_by_batch(table, key=done_key)) == [1, 8, 16, 32]
    monkeypatch.setattr(autofuse, "tune", real_tune)
    assert script.main(["--table", str(table), "--run"]) == 0  # the failed key, again
    assert capsys.readouterr().out.startswith("1 tuned forward keys without batch classes or with unserved")
    assert script.main(["--table", str(table)]) == 0
    assert capsys.readouterr().out.startswith("0 tuned forward keys without batch classes or with unserved")


def test_the_gaps_script_races_a_missing_rung_and_leaves_the_others(tmp_path, capsys):
    table = tmp_path / "t.json"
    shape = {**TUNED, "batch_size": 64}
    autofuse.tune("matmul_gelu_softmax", shape, device="cpu", seed=5, variants=["eager", "simplified"],
                  progress=False, table=table, autograd_entry=False)
    before = entries_by_batch(table)
    assert sorted(before) == [1, 8, 32, 64, 128]
    doc = json.loads(table.read_text())
    [device] = doc["devices"].values()
    del device["problems"]["matmul_gelu_softmax"][",".join(f"{k}={v}" for k, v in {**shape, "batch_size": 32}.items())]
    table.write_text(json.dumps(doc))
    script = _gaps_script()
    assert script.main(["--table", str(table), "--missing-rungs", "--run"]) == 0
    assert "--rungs 32" in capsys.readouterr().out
    after = entries_by_batch(table)
    assert sorted(after) == [1, 8, 32, 64, 128] and after[32]["rung_of"] == before[32]["rung_of"]
    assert all(after[b] == before[b] for b in (1, 8, 128))  # not raced again
    assert script.missing_rungs(json.loads(table.read_text())) == []


def test_a_rung_the_runtime_replays_as_a_graph_races_only_candidates_it_can_capture(with_compiled):
    """`compiled` (never captured: its host path, hundreds of µs, stays on every call) won a small
    rung on GPU time alone; where the rung's calls are replayed, it is left out of the race."""
    prob = registry.get_problem("gemm_bn")
    names = ("compiled", "eager", "simplified")
    spaces = {name: registry.get_variant(prob.name, name).configs_for(TUNED, "cuda", "bf16") for name in names}
    assert not registry.get_variant(prob.name, "compiled").capturable

    def raced(batch, device="cuda", mode="train", autograd=False, problem=prob):
        ladder = batch_classes.build_ladder(prob.name, {"variant": "compiled", "params": spaces["compiled"][0]}, [],
                                            spaces, None, "bf16", BUDGETS["full"], autograd=autograd)
        at = {**TUNED, "batch_size": batch}
        return {c.variant for c in batch_classes.rung_candidates(ladder, problem, at, device, "bf16", BUDGETS["full"], mode)}

    assert raced(graphs.MAX_BATCH) == raced(2, mode="eval") == {"eager", "simplified"}
    assert raced(graphs.MAX_BATCH + 1) == raced(64, device="cpu") == raced(8, autograd=True) == set(names)
    undeclared = dataclasses.replace(prob, training_updates=None)  # its training calls are never replayed
    assert raced(8, problem=undeclared) == set(names) and raced(8, mode="eval", problem=undeclared) == {"eager", "simplified"}


def test_a_classes_only_run_races_the_next_fastest_configurations_its_entry_recorded():
    """Nothing was searched, so the runners-up are the entry's recorded candidates, fastest first,
    those still in the spaces (a configuration no longer offered, or one that failed, is left out)."""
    prob = registry.get_problem("matmul_gelu_softmax")
    configs = triton_variant.gemm_configs(48, "cpu")
    spaces = {"triton": configs, "eager": [{}], "simplified": [{}]}
    entry = {"variant": "triton", "params": configs[0], "candidates": {
        "triton": {"params": configs[0], "outcome": "ok", "median_ms": 0.20},
        "simplified": {"params": {}, "outcome": "ok", "median_ms": 0.31},
        "eager": {"params": {}, "outcome": "ok", "median_ms": 0.25},
        "cublas_epilogue": {"params": {"block": 256}, "outcome": "ok", "median_ms": 0.22},  # not in the spaces
        "compiled": {"params": {}, "outcome": "incorrect", "median_ms": None}}}
    ranking = batch_classes.recorded_ranking(entry, spaces)
    assert ranking == [("triton", configs[0]), ("eager", {}), ("simplified", {})]
    searched = batch_classes.Searched({}, spaces, "study", False, ranking)
    assert searched.ranked() == ranking
    ladder = batch_classes.build_ladder(prob.name, entry, searched.ranked(), spaces, None, "fp32", BUDGETS["full"],
                                        autograd=False)
    assert [(c.variant, c.params) for c in ladder.runners_up] == [("eager", {}), ("simplified", {})]
    assert batch_classes.recorded_ranking({"variant": "eager", "params": {}}, spaces) == []  # an entry without records


def test_a_rung_races_each_other_fused_kind_that_was_close_at_b():
    """The study's runners-up are the winner's variant's next configurations; a kind timed within
    the budget's prune of the winner at B (cuBLAS + epilogue at 1.07x triton's, matmul_clamp_lse_mish
    bf16) races at every forward rung too, fastest first: it picks its kernel per call and may win
    where the batch is small. A kind beyond prune, one that failed, or one no longer offered does
    not. The autograd rungs (each candidate a training step) race it at one row only, where the
    weight gradient contracts one row."""
    prob = registry.get_problem("matmul_gelu_softmax")
    configs = registry.get_variant(prob.name, "triton").configs_for(TUNED, "cuda", "bf16")
    spaces = {"triton": configs, "cublas_epilogue": [{"block": 256, "items": 0}], "eager": [{}], "simplified": [{}]}
    records = {"triton": {"params": configs[0], "outcome": "ok", "median_ms": 0.20},
               "cublas_epilogue": {"params": {"block": 256, "items": 0}, "outcome": "ok", "median_ms": 0.214},
               "eager": {"params": {}, "outcome": "ok", "median_ms": 0.45}}
    entry = {"variant": "triton", "params": configs[0], "median_ms": 0.20, "candidates": records}
    ranked = [("triton", c) for c in configs[:4]]
    small = {**TUNED, "batch_size": 8}
    for budget in BUDGETS.values():
        ladder = batch_classes.build_ladder(prob.name, entry, ranked, spaces, None, "bf16", budget, autograd=False)
        assert ("cublas_epilogue", {"block": 256, "items": 0}) in [(c.variant, c.params) for c in ladder.runners_up]
        assert [c.variant for c in ladder.runners_up].count("eager") == 0  # the simplest race as such
        raced = batch_classes.rung_candidates(ladder, prob, small, "cuda", "bf16", budget)
        assert raced[0].params == configs[0] and "cublas_epilogue" in {c.variant for c in raced}
        graded = batch_classes.build_ladder(prob.name, entry, [], spaces, None, "bf16", budget, autograd=True)
        assert [(c.variant, c.autograd) for c in graded.runners_up] == [("cublas_epilogue", True)]
        steps = {at: [(c.variant, c.autograd) for c in batch_classes.rung_candidates(
            graded, prob, {**TUNED, "batch_size": at}, "cuda", "bf16", budget)] for at in (1, 8)}
        assert ("cublas_epilogue", True) in steps[1] and all(grad for _, grad in steps[1])
        assert "cublas_epilogue" not in dict(steps[8])

    def kinds(**record):
        at = {**entry, "candidates": {**records, "cublas_epilogue": {**records["cublas_epilogue"], **record}}}
        return [c.variant for c in batch_classes.other_kinds(at, spaces, BUDGETS["quick"], registry.variants(prob.name))]

    assert kinds() == kinds(outcome="out_of_reach") == ["cublas_epilogue"]  # timed, if not gated, at B
    assert kinds(median_ms=0.41) == kinds(outcome="incorrect") == kinds(params={"block": 64, "items": 0}) == []
    assert batch_classes.other_kinds(entry, spaces, BUDGETS["full"], registry.variants(prob.name))  # no prune


@pytest.mark.parametrize("autograd", [False, True])
def test_a_rung_the_winners_configuration_cannot_hold_races_its_variants_first_configuration_there(autograd):
    """cublas_epilogue's 32-column strip holds gemm_bn's 1024 rows on chip but not 2048: rung 2048
    races the variant at its first configuration for 2048 rows, first, where the kind that won at
    B would otherwise be missing (its training step's rung went to eager); a rung it holds keeps
    the winner's own."""
    prob = registry.get_problem("gemm_bn")
    tuned = {"batch_size": 1024, "in_features": 8192, "out_features": 8192}
    cls = registry.get_variant(prob.name, "cublas_epilogue")
    strip = {"strip_cols": 32, "block": 1024}
    assert strip in cls.configs(tuned, "cuda") and strip not in cls.configs({**tuned, "batch_size": 2048}, "cuda")
    spaces = {"cublas_epilogue": cls.configs(tuned, "cuda"), "eager": [{}], "simplified": [{}]}
    entry = {"variant": "cublas_epilogue", "params": strip, "median_ms": 0.45, "candidates": {}}
    ladder = batch_classes.build_ladder(prob.name, entry, [], spaces, None, "bf16", BUDGETS["quick"], autograd)
    raced = {at: batch_classes.rung_candidates(ladder, prob, {**tuned, "batch_size": at}, "cuda", "bf16",
                                               BUDGETS["quick"], "train") for at in (512, 2048)}
    assert (raced[512][0].variant, raced[512][0].params) == ("cublas_epilogue", strip)
    first = raced[2048][0]
    assert (first.variant, first.params, first.autograd) == (
        "cublas_epilogue", cls.configs({**tuned, "batch_size": 2048}, "cuda")[0], autograd)


def test_a_batch_class_serving_its_family_says_so_at_info_not_as_a_warning(caplog):
    """Each new batch size a family's rungs serve is by design (gated there): an INFO line, not a
    warning per size."""
    record("matmul_gelu_softmax", 64, IN, OUT)
    record("matmul_gelu_softmax", 8, IN, OUT, rung_of=f"batch_size=64,in_features={IN},out_features={OUT}")
    module = module_for("matmul_gelu_softmax")
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="autofuse"):
        for batch in (3, 5, 9):
            assert "batch class of" in module.dispatch_info(torch.randn(batch, IN))["source"]
    served = [r for r in caplog.records if "no tuned entry" in r.getMessage()]
    assert len(served) == 3 and {r.levelno for r in served} == {logging.INFO}, caplog.text


def test_the_nearest_entry_of_a_table_without_batch_classes_still_warns(caplog):
    record("matmul_gelu_softmax", 64, IN, OUT)
    module = module_for("matmul_gelu_softmax")
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="autofuse"):
        module.dispatch_info(torch.randn(3, IN))
    served = [r for r in caplog.records if "no tuned entry" in r.getMessage()]
    assert len(served) == 1 and served[0].levelno == logging.WARNING, caplog.text


def test_a_rung_where_no_candidate_passed_is_said_with_each_ones_reason(batch_decoys, tmp_path, capsys):
    """Raced alone, the decoy fails at batch 1 and nothing else races there: the tune says so, and
    why, where its rungs had gone missing without a word."""
    autofuse.tune("matmul_gelu_softmax", TUNED, table=tmp_path / "t.json", device="cpu", seed=3,
                  variants=["wrong_at_batch_one"], autograd_entry=False, progress=False, budget="full")
    assert sorted(entries_by_batch(tmp_path / "t.json")) == [8, 16, 32]
    said = [line for line in capsys.readouterr().out.splitlines() if "no candidate passed" in line]
    assert len(said) == 1 and "at batch 1;" in said[0], said
    assert "wrong_at_batch_one[]: incorrect (" in said[0] and "nearest batch class" in said[0]


def test_an_unserved_rung_names_each_candidates_configuration_outcome_and_reason():
    """A wrong and a crashed candidate at one rung: the line names both, with what each returned."""
    rung = race(ScriptedWorker({"eager": 1.0, "simplified": 1.0}, wrong=["eager"], broken=["simplified"]),
                ["eager", "simplified"])
    assert rung.entry is None
    said = batch_classes.unserved_rung("p 8x4", DispatchKey("float32", "fp32", "any", False), rung)
    assert "at batch 16;" in said and "eager[]: incorrect (wrong)" in said and "simplified[]: runtime_failed (it crashed)" in said


class HeldAt:
    """A table that holds ``entries`` (rung shape key → entry) under every device and key."""

    def __init__(self, entries: dict):
        self.entries = entries

    def lookup(self, fingerprint_key, problem, shape_key, dispatch_key):
        return self.entries.get(shape_key)


def test_a_retune_races_the_entry_the_table_holds_at_each_rung(with_compiled):
    """A rung races the table's own entry there (an earlier tune's choice) beside the winner at B and
    the simplest: without it, gemm_bn's bfloat16-model eval step at 8 and 64 rows went from
    `compiled` (0.1082 and 0.1141 ms) to `cublas_epilogue` (0.1183 and 0.1201), the only kind the
    re-tune raced there besides eager and simplified (H100). An entry equal to a candidate raced
    anyway (its params in another order) is raced once; one whose variant the tune does not offer,
    not at all."""
    from autofuse.serve.table import shape_key
    from autofuse.tuning.outcome import Job

    prob = registry.get_problem("gemm_bn")
    tuned = {"batch_size": 1024, "in_features": 8192, "out_features": 8192}
    strip = {"strip_cols": 32, "block": 1024}
    spaces = {"cublas_epilogue": registry.get_variant(prob.name, "cublas_epilogue").configs(tuned, "cuda"),
              "compiled": [{"mode": "default", "dynamic": False}], "eager": [{}], "simplified": [{}]}
    entry = {"variant": "cublas_epilogue", "params": strip, "median_ms": 0.40, "candidates": {}}
    job = Job(prob.name, tuned, "cuda", "bfloat16", "bf16", "eval", 1)
    key = DispatchKey("bfloat16", "bf16", "eval", False)
    fingerprint = {"kind": "cuda", "name": "X", "capability": 9.0, "sm_count": 132, "cuda": "13.0", "torch": "2.11"}
    searched = batch_classes.Searched({}, spaces, "study", kept=False)
    rung_of = shape_key(tuned)
    held = {8: {"variant": "compiled", "params": {"dynamic": False, "mode": "default"}, "rung_of": rung_of},
            64: {"variant": "cublas_epilogue", "params": {"block": 1024, "strip_cols": 32}, "rung_of": rung_of},
            512: {"variant": "gone_since", "params": {}, "rung_of": rung_of}}
    table = HeldAt({shape_key(batch_classes.rung_shape(prob, tuned, b)): e for b, e in held.items()})

    [(_, dkey, _, rungs)] = batch_classes._plan(prob, tuned, job, key, fingerprint, table, (None, entry),
                                                BUDGETS["quick"], searched)
    raced = {at["batch_size"]: [(c.variant, c.params) for c in candidates] for at, candidates in rungs}
    assert dkey.autograd and ("compiled", held[8]["params"]) in raced[8]
    assert [v for v, _ in raced[64]].count("cublas_epilogue") == 1 and "compiled" not in dict(raced[64])
    assert {v for v, _ in raced[512]} == {"cublas_epilogue", "eager", "simplified"}
