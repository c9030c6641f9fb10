"""$AUTOFUSE_TIMELINE: a tune writes where its seconds went (``autofuse.tuning.timeline``)."""

import os

import autofuse
from autofuse.tuning import timeline
from autofuse.tuning.outcome import Candidate, Job

SHAPE = {"batch_size": 16, "in_features": 48, "out_features": 40}


def _tune(tmp_path, **kwargs):
    return autofuse.tune("matmul_gelu_softmax", SHAPE, device="cpu", seed=1, n_trials=2,
                         variants=["eager", "simplified"], progress=False, table=tmp_path / "t.json", **kwargs)


def test_a_tune_writes_its_phases_and_every_worker_call_with_its_outcome(tmp_path, monkeypatch):
    path = tmp_path / "timeline.txt"
    monkeypatch.setenv("AUTOFUSE_TIMELINE", str(path))
    monkeypatch.delenv(timeline.ORIGIN, raising=False)
    [result] = _tune(tmp_path)
    lines = [line.split(None, 3) for line in path.read_text().splitlines()]
    ours = [line for line in lines if line[2] == str(os.getpid())]
    spans = [(float(start), float(seconds), what) for start, seconds, _, what in ours]
    assert all(start >= 0 and seconds >= 0 for start, seconds, _ in spans)
    phases = {what.split()[0]: (start, seconds) for start, seconds, what in spans
              if what.split()[0] in ("setup", "search", "choice", "batch")}
    assert list(phases) == ["setup", "search", "choice", "batch"], [w for _, _, w in spans]
    order = [phases[p][0] for p in ("setup", "search", "choice", "batch")]
    assert order == sorted(order)
    # Each trial the search measured is a worker call inside the search's span, with its outcome:
    # written before the search's own line (a span is written as it ends), and timed inside it (the
    # times are rounded, so a call starting just after the search may read as inside: the order
    # tells them apart).
    start, seconds = phases["search"]
    search_line = next(i for i, (_, _, what) in enumerate(spans) if what.split()[0] == "search")
    inside = [what for i, (s, d, what) in enumerate(spans)
              if what.startswith("worker evaluate") and start <= s <= start + seconds and i < search_line]
    measured = sum(row.trials for row in result.rows)
    assert len(inside) == measured and all(what.rsplit(None, 1)[1] in ("ok", "out_of_reach") for what in inside), inside
    # The autograd entry's calls carry their gradients, the batch classes' their batch.
    assert any("+grad" in what for _, _, what in spans)
    assert any("at batch_size=1," in what for _, _, what in spans)
    # The worker subprocess writes what each call spent where, on the tuner's clock: each of its
    # lines lies inside the tuner's span of the call it served.
    theirs = [(float(start), float(seconds), what) for start, seconds, pid, what in lines if pid != str(os.getpid())]
    kinds = {what.split()[0] for _, _, what in theirs}
    assert {"build", "first", "gate:"} <= kinds, kinds
    calls = [(s, d) for s, d, what in spans if what.startswith("worker ")]
    slack = 0.02  # the printed starts and seconds are rounded to 10 ms
    for start, seconds, what in theirs:
        assert any(s - slack <= start and start + seconds <= s + d + slack for s, d in calls), (start, seconds, what)
    started = [s + d for s, d, what in spans if what.startswith("worker start")]
    assert started and min(start for start, _, _ in theirs) >= started[0] - slack


def test_without_the_variable_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("AUTOFUSE_TIMELINE", raising=False)
    written = []
    monkeypatch.setattr(timeline, "_write", lambda *args: written.append(args))
    _tune(tmp_path, autograd_entry=False, batch_classes=False)
    assert written == []


def test_an_unwritable_timeline_never_fails_what_it_times(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFUSE_TIMELINE", str(tmp_path / "no" / "such" / "dir" / "timeline.txt"))
    with timeline.span("something") as outcome:
        outcome.append("done")


def test_a_worker_call_is_described_by_its_batch_candidate_and_whether_it_is_gated():
    job = Job("matmul_gelu_softmax", SHAPE, "cpu", "float32", "fp32", "any", 1)
    candidate = Candidate("triton", {"block_m": 16}, autograd=True)
    assert timeline.describe_call("evaluate", (job, candidate, None, False)) == (
        "evaluate at batch_size=16,in_features=48,out_features=40 triton[block_m=16] +grad (timed only)")
    assert timeline.describe_call("retime", (job, [candidate, candidate], 50)).endswith(" 2 candidates")
    assert timeline.describe_call("gemm_floor", (job,)) == "gemm_floor at batch_size=16,in_features=48,out_features=40"


def test_the_summary_says_where_each_phases_seconds_went():
    lines = ["    0.00    5.00 10 setup p batch_size=8 (spaces, device, study)",
             "    5.00   30.00 10 search p batch_size=8 (dtype=float32)",
             "    5.00    4.00 10 worker start (imports, CUDA context; the part not overlapped)",
             "    5.00   12.00 10 worker evaluate at batch_size=8 triton[] ok",
             "    9.50    6.00 11   first calls (compiling) and timing triton[] at batch_size=8",
             "   15.50    1.50 11   gate: prepare case batch_size=8 randn randomized seed=1",
             "   20.00    8.00 10 compile pool: wait for 4 compiles",
             "   20.00    7.50 12   pool: compile triton[block_m=64] at batch_size=8",
             "   35.00   10.00 10 batch classes p batch_size=8",
             "   35.00    2.00 10 compile pool: wait for 1 compiles",
             "   37.00    3.00 10 worker evaluate at batch_size=1 triton[] ok",
             "   37.10    2.00 11   first calls (compiling) and timing triton[] at batch_size=1",
             "   39.20    0.50 11   gate: check triton on batch_size=1 rand default-init seed=1"]
    setup, search, classes = timeline.summarize([line + "\n" for line in lines])
    assert (setup["phase"], setup["key"], setup["tuner's own"]) == ("setup", "p batch_size=8", 5.0)
    assert search["pool waits"] == 8.0 and search["worker start"] == 4.0
    assert (search["worker compiling+timing"], search["worker gate"]) == (6.0, 1.5)
    assert search["tuner's own"] == 30.0 - 8.0 - 4.0 - 12.0  # nvcc builds, the study, the table
    assert (classes["pool waits"], classes["worker compiling+timing"], classes["worker gate"]) == (2.0, 2.0, 0.5)


def test_a_tunes_own_timeline_reads_back_phase_by_phase(tmp_path, monkeypatch, capsys):
    path = tmp_path / "timeline.txt"
    monkeypatch.setenv("AUTOFUSE_TIMELINE", str(path))
    monkeypatch.delenv(timeline.ORIGIN, raising=False)
    [result] = _tune(tmp_path)
    phases = timeline.summarize(path.read_text().splitlines())
    assert [p["phase"] for p in phases] == list(timeline.PHASES)
    assert all(value >= 0 for p in phases for value in p.values() if isinstance(value, float))
    assert sum(p["worker compiling+timing"] for p in phases) > 0  # the worker's lines are read too
    timeline.main([str(path)])
    assert "choice and autograd entry" in capsys.readouterr().out
