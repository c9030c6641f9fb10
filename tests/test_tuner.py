"""The tuner end to end on CPU: outcomes of broken candidates, resume, the table, concurrency."""

import json
import subprocess
import sys

import pytest
import torch
from helpers import use_test_plugins

import autofuse
from autofuse.core import plugins
from autofuse.core.variant import Variant
from autofuse.serve.table import DispatchTable
from autofuse.tuning.outcome import Outcome

SMALL = {"batch_size": 16, "in_features": 48, "out_features": 40}


@pytest.fixture
def broken_plugins(monkeypatch):
    use_test_plugins(monkeypatch, "broken_variants")
    yield
    monkeypatch.delenv("AUTOFUSE_PLUGINS")
    plugins.reset_plugin_manager()


def _outcomes(result):
    return {row.variant: row.result.outcome for row in result.rows if row.result is not None}


def test_each_broken_candidate_is_a_recorded_outcome_and_the_tune_goes_on(broken_plugins, tmp_path):
    names = ["eager", "segfault", "abort", "hang", "raises", "wrong", "compile_error"]
    # budget="full" gates every candidate, so each broken one meets the gate whatever its time.
    [result] = autofuse.tune("matmul_gelu_softmax", SMALL, device="cpu", table=tmp_path / "t.json", seed=3,
                             variants=names, trial_timeout=15, autograd_entry=False, progress=False, budget="full")
    outcomes = _outcomes(result)
    assert outcomes == {
        "eager": Outcome.OK, "segfault": Outcome.RUNTIME_FAILED, "abort": Outcome.RUNTIME_FAILED,
        "hang": Outcome.TIMED_OUT, "raises": Outcome.RUNTIME_FAILED, "wrong": Outcome.INCORRECT,
        "compile_error": Outcome.COMPILE_FAILED,
    }
    reasons = {row.variant: row.result.reason for row in result.rows}
    assert "SIGSEGV" in reasons["segfault"] and "SIGABRT" in reasons["abort"]
    assert "invalid configuration" in reasons["raises"] and "relative L2 error" in reasons["wrong"]
    assert result.winner["variant"] == "eager"
    assert DispatchTable(tmp_path / "t.json").load()["devices"]


def test_a_variant_whose_fastest_configuration_fails_with_gradients_is_gated_at_the_next(broken_plugins, tmp_path):
    """The autograd entry gates each variant's fastest forward configuration with gradients and,
    where that fails, the next fastest: a forward's best tiles can store wrong tensors for the
    backward while its result is right (Triton 3.6 on an H100)."""
    # budget="full": both configurations are measured whatever this machine's load does to the times.
    [result] = autofuse.tune("matmul_gelu_softmax", SMALL, device="cpu", table=tmp_path / "t.json", seed=4,
                             variants=["eager", "wrong_gradient_when_fastest"], trial_timeout=30, progress=False,
                             budget="full")
    forward = {row.variant: row for row in result.rows}["wrong_gradient_when_fastest"]
    assert forward.ok and forward.params == {"fast": True}  # the forward's best: its result is right
    graded = result.grad_winner["candidates"]["wrong_gradient_when_fastest"]
    assert graded["outcome"] == "ok" and graded["params"] == {"fast": False}


def test_a_retune_that_drops_a_faster_recorded_winner_says_so(tmp_path, capsys):
    """A retune over fewer variants replaces the entry (its own side-by-side choice) but names the
    recorded winner it did not run when that one had measured faster."""
    table = tmp_path / "t.json"
    kwargs = dict(device="cpu", table=table, autograd_entry=False, progress=False, batch_classes=False)
    autofuse.tune("matmul_gelu_softmax", SMALL, seed=1, variants=["eager"], **kwargs)
    doc = json.loads(table.read_text())
    [entries] = [shapes for device in doc["devices"].values() for shapes in device["problems"]["matmul_gelu_softmax"].values()]
    [entry] = entries.values()
    entry.update(variant="simplified", median_ms=1e-6, study="an earlier study")  # a faster winner of another tune
    table.write_text(json.dumps(doc))
    capsys.readouterr()
    [result] = autofuse.tune("matmul_gelu_softmax", SMALL, seed=2, variants=["eager"], **kwargs)
    out = capsys.readouterr().out
    assert "simplified (1e-06 ms" in out and "replaced by eager" in out
    assert result.winner["variant"] == "eager"


def test_tune_writes_an_entry_that_get_module_uses(tmp_path):
    [result] = autofuse.tune("gemm_avgpool_gelu_residual", SMALL, device="cpu", table=tmp_path / "t.json",
                             seed=1, progress=False)
    assert result.winner is not None and result.grad_winner is not None
    assert (result.winner["step"], result.grad_winner["step"]) == ("forward", "forward+backward")
    assert result.grad_winner["variant"] in result.grad_winner["candidates"]  # bench re-measures them
    module = autofuse.get_module("gemm_avgpool_gelu_residual", 48, 40, table=tmp_path / "t.json")
    x = torch.rand(16, 48)
    with torch.no_grad():
        info = module.dispatch_info(x)
    assert info["source"] == "tuned" and info["variant"] == result.winner["variant"]
    assert module.dispatch_info(x)["source"] == "tuned"  # the autograd entry, params require grad


def test_an_interrupted_tune_resumes_from_the_study(tmp_path, monkeypatch):
    calls = []
    from autofuse.tuning import worker as worker_module

    real_call = worker_module.Worker.call

    def counting_call(self, op, payload, timeout):
        calls.append(op)
        return real_call(self, op, payload, timeout)

    monkeypatch.setattr(worker_module.Worker, "call", counting_call)
    kwargs = dict(device="cpu", table=tmp_path / "t.json", seed=5, autograd_entry=False, progress=False,
                  batch_classes=False)  # counted: the study's trials alone
    autofuse.tune("matmul_clamp_lse_mish", SMALL, n_trials=1, **kwargs)
    first = calls.count("evaluate")
    calls.clear()
    autofuse.tune("matmul_clamp_lse_mish", SMALL, n_trials=2, **kwargs)
    assert first == 1 and calls.count("evaluate") == 1  # only the missing trial ran


def test_concurrent_tuners_into_one_table_lose_nothing(tmp_path):
    table = tmp_path / "shared.json"
    procs = [
        subprocess.Popen([sys.executable, "-m", "autofuse.cli", "tune", "matmul_gelu_softmax", "--device", "cpu",
                          "--shape", f"batch_size={b},in_features=32,out_features=24", "--table", str(table),
                          "--no-progress", "--no-batch-classes", "--seed", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for b in (3, 5, 9)
    ]
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
    shapes = {shape for _, _, shape, _, _ in DispatchTable(table).entries()}
    assert shapes == {f"batch_size={b},in_features=32,out_features=24" for b in (3, 5, 9)}


def test_a_corrupt_table_is_left_intact_and_the_result_kept_beside_it(tmp_path, capsys):
    table = tmp_path / "t.json"
    table.write_bytes(b'{"schema": "autofuse-dispatch-table", "vers')
    autofuse.tune("matmul_gelu_softmax", SMALL, device="cpu", table=table, seed=1, autograd_entry=False, progress=False)
    assert table.read_bytes() == b'{"schema": "autofuse-dispatch-table", "vers'
    [rescued] = list(tmp_path.glob("t.rescued-*.json"))
    assert json.loads(rescued.read_text())["devices"]
    assert "left intact" in capsys.readouterr().out


def test_bad_arguments_fail_clearly():
    with pytest.raises(autofuse.InputError, match="precision"):
        autofuse.tune("gemm_bn", SMALL, device="cpu", precision="fp16")
    with pytest.raises(autofuse.InputError, match="shape parameter"):
        autofuse.tune("gemm_bn", {"batch": 3}, device="cpu")
    with pytest.raises(autofuse.UnknownNameError, match="known problems"):
        autofuse.tune("no_such_problem", SMALL, device="cpu")
    with pytest.raises(autofuse.InputError, match="no variant"):
        autofuse.tune("gemm_bn", SMALL, device="cpu", variants=["nope"])


def test_a_rerun_of_a_tuned_shape_reuses_study_and_table_without_a_worker(tmp_path, monkeypatch):
    kwargs = dict(device="cpu", table=tmp_path / "t.json", seed=4, progress=False)
    [first] = autofuse.tune("matmul_gelu_softmax", SMALL, **kwargs)
    from autofuse.tuning import worker as worker_module

    def no_worker(self, *args):
        raise AssertionError("a rerun with nothing new to measure must not run anything in a worker")

    # (The worker's process is spawned as the tune starts, overlapping its setup; a rerun closes it unused.)
    monkeypatch.setattr(worker_module.Worker, "_call", no_worker)
    monkeypatch.setattr(worker_module.Worker, "_start", no_worker)
    [again] = autofuse.tune("matmul_gelu_softmax", SMALL, **kwargs)
    assert again.winner == first.winner and again.grad_winner == first.grad_winner


def test_a_worker_spawned_early_and_never_used_is_killed_at_once_and_a_used_one_starts_on_demand():
    """The tuner spawns its worker as a tune starts (its start overlaps the setup); a tune that
    then fails on its input, or measures nothing, must not wait on a child still importing."""
    import signal

    from autofuse.tuning.outcome import Job
    from autofuse.tuning.worker import Worker

    worker = Worker()
    worker.spawn()
    proc = worker._proc
    worker.close()
    assert proc.returncode == -signal.SIGKILL and worker._proc is None
    with Worker() as worker:
        worker.spawn()
        job = Job("matmul_gelu_softmax", SMALL, "cpu", "float32", "fp32", "any", 0)
        assert worker.call("gemm_floor", (job,), 60).median_ms > 0  # the first call waits for the start
        assert worker._ready


class _Pipe:
    """The worker's end of its connection, fed ``ops``; what it sends is kept."""

    def __init__(self, ops):
        self.ops, self.sent = list(ops), []

    def recv(self):
        if not self.ops:
            raise EOFError
        return self.ops.pop(0)

    def send(self, message):
        self.sent.append(message)


def test_the_worker_imports_torch_compile_on_a_thread_when_asked_and_its_next_op_waits(monkeypatch):
    """Asked (op ``IMPORT_COMPILE_STACK``), the worker answers at once and imports torch.compile's
    stack on a thread while the tuner asks and builds; its next op starts only after them: no
    candidate races those imports, no timing shares the interpreter with them. Unasked, nothing."""
    import threading
    import time
    import types

    from autofuse.tuning import evaluate, worker

    events = []

    def imports():
        assert threading.current_thread() is not threading.main_thread()
        time.sleep(0.3)
        events.append("imported")

    monkeypatch.setattr(worker, "_import_compile_stack", imports)
    monkeypatch.setattr(evaluate, "evaluate", lambda state, job, *rest: events.append("evaluate") or "result")
    job = types.SimpleNamespace(device="cuda", log=None)
    pipe = _Pipe([("evaluate", (job,)), (worker.IMPORT_COMPILE_STACK, (job,)), ("evaluate", (job,))])
    worker._serve(pipe)
    assert pipe.sent == ["ready", "result", None, "result"]
    assert events == ["evaluate", "imported", "evaluate"]
    events.clear()
    worker._serve(_Pipe([("evaluate", (job,)), ("evaluate", (job,))]))
    assert events == ["evaluate", "evaluate"]


def test_the_search_asks_for_those_imports_after_its_first_candidate_where_compiled_is_in_the_space(monkeypatch, with_compiled):
    import optuna

    from autofuse.tuning import search
    from autofuse.tuning import study as studies
    from autofuse.tuning.outcome import Job
    from autofuse.tuning.worker import IMPORT_COMPILE_STACK

    monkeypatch.setattr(search, "_measure_batch", lambda *args: calls.append("batch") or 1)
    for device, variants, want in (("cuda", ["triton", "compiled"], True), ("cuda", ["triton"], False),
                                   ("cpu", ["eager", "compiled"], False)):
        calls = []

        class Worker:
            def call(self, op, payload, timeout):
                calls.append(op)

        job = Job("matmul_gelu_softmax", SMALL, device, "float32", "fp32", "any", 0)
        spaces = {name: [{}] for name in variants}
        study = studies.open_study("imports", 0, optuna.storages.InMemoryStorage())
        search._search_loop(study, spaces, job, Worker(), 2, None, 60, False, "x", search._Progress(search.BUDGETS["quick"], None))
        assert calls[:2] == (["batch", IMPORT_COMPILE_STACK] if want else ["batch", "batch"]), (device, variants, calls)
        assert calls.count(IMPORT_COMPILE_STACK) == want


def test_the_search_builds_small_spaces_extensions_ahead_on_a_thread_at_a_lower_priority(monkeypatch):
    """Every configuration's nvcc builds of each variant with at most AHEAD_MAX_CONFIGS in the
    space, on a thread whose nice value (inherited by nvcc) is raised; a larger space is built as
    its trials are asked, and a space with nothing to build starts no thread."""
    import os
    import threading

    from autofuse.tuning import search
    from autofuse.tuning.outcome import Job

    built = []

    def build_many(builds, jobs):
        me = threading.get_native_id()
        built.append((sorted(builds), jobs, os.getpriority(os.PRIO_PROCESS, me), me))

    monkeypatch.setattr(search, "build_many", build_many)
    monkeypatch.setattr(search, "_kernel_builds", lambda job, name, config: [] if name == "eager" else [f"{name}{config['i']}"])
    job = Job("matmul_gelu_softmax", SMALL, "cuda", "float32", "fp32", "any", 0)
    small, large = [{"i": i} for i in range(3)], [{"i": i} for i in range(search.AHEAD_MAX_CONFIGS + 1)]
    thread = search._build_ahead({"small": small, "large": large, "eager": [{}]}, job)
    thread.join()
    (builds, jobs, nice, tid), = built
    assert builds == ["small0", "small1", "small2"] and jobs >= 1
    assert tid != threading.get_native_id()
    assert nice == min(19, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + 10)
    assert search._build_ahead({"large": large, "eager": [{}]}, job) is None


def test_a_retune_with_other_variants_measures_the_recorded_winner_first(tmp_path):
    kwargs = dict(device="cpu", table=tmp_path / "t.json", seed=2, progress=False, autograd_entry=False)
    [first] = autofuse.tune("matmul_gelu_softmax", SMALL, variants=["simplified"], **kwargs)
    assert first.winner["variant"] == "simplified"
    # A new study (other variants); its one trial would be eager's default if nothing came first.
    [again] = autofuse.tune("matmul_gelu_softmax", SMALL, variants=["eager", "simplified"], n_trials=1, **kwargs)
    measured = {row.variant: row.trials for row in again.rows}
    assert measured == {"eager": 0, "simplified": 1}, measured


def test_a_retune_of_some_variants_keeps_the_other_variants_records(tmp_path):
    kwargs = dict(device="cpu", table=tmp_path / "t.json", seed=3, progress=False, autograd_entry=False,
                  batch_classes=False)
    [first] = autofuse.tune("matmul_gelu_softmax", SMALL, variants=["eager", "simplified"], n_trials=2, **kwargs)
    [again] = autofuse.tune("matmul_gelu_softmax", SMALL, variants=["eager"], n_trials=1, **kwargs)
    [[entry]] = [list(shapes.values()) for device in DispatchTable(tmp_path / "t.json").load()["devices"].values()
                 for shapes in device["problems"]["matmul_gelu_softmax"].values()]
    candidates = entry["candidates"]
    assert entry["variant"] == "eager" and entry["date"] == again.winner["date"]  # this tune's winner, its own
    assert "carried" not in candidates["eager"]  # measured by this tune
    assert candidates["simplified"]["params"] == first.winner["candidates"]["simplified"]["params"]
    assert candidates["simplified"]["carried"] == first.winner["date"]


def test_recorded_configurations_come_first_once_and_only_from_the_space():
    import optuna

    from autofuse.tuning import study as studies

    spaces = {"a": [{"k": 1}, {"k": 2}], "b": [{}]}
    study = optuna.create_study()
    studies.enqueue_starting_points(study, spaces, [("a", {"k": 2}), ("gone", {}), ("a", {"k": 9}), ("a", {"k": 2})])
    drawn = [studies.suggest(study.ask(), spaces) for _ in range(3)]
    assert drawn == [("a", {"k": 2}), ("a", {"k": 1}), ("b", {})]


class _RecordUpstream(torch.autograd.Function):
    """The identity, whose backward records the upstream gradient it is given."""

    seen: list = []

    @staticmethod
    def forward(ctx, y):
        return y.clone()

    @staticmethod
    def backward(ctx, grad):
        _RecordUpstream.seen.append(grad.clone())
        return grad


class SpySoftmax(Variant):
    """matmul_gelu_softmax that records what each timed training step hands it."""

    name, problem, kind, description = "spy", "matmul_gelu_softmax", "simplified", "records its calls"
    supports_autograd = True

    def __init__(self, precision="fp32", **params):
        super().__init__(precision, **params)
        self.grads_before, self.input_requires_grad = [], []

    def forward(self, model, x):
        self.grads_before.append([p.grad is None for p in model.parameters()])
        self.input_requires_grad.append(x.requires_grad)
        return _RecordUpstream.apply(torch.softmax(torch.nn.functional.gelu(model.linear(x)), dim=1))


def test_the_autograd_timing_is_a_training_step_with_a_random_upstream_gradient():
    """Ones would be a degenerate upstream gradient here: softmax's backward of ones is zero."""
    from autofuse.tuning.evaluate import _timed_call
    from autofuse.tuning.worker import Job

    _RecordUpstream.seen.clear()
    state, job = {}, Job("matmul_gelu_softmax", SMALL, "cpu", "float32", "fp32", "any", seed=2)
    spy, other = SpySoftmax(), SpySoftmax()
    step = _timed_call(state, job, spy, autograd=True)
    for _ in range(3):
        step()
    _timed_call(state, job, other, autograd=True)()
    first, *rest = _RecordUpstream.seen
    assert len(rest) == 3 and all(torch.equal(first, g) for g in rest)  # fixed, and shared by candidates
    assert not torch.equal(first, torch.ones_like(first)) and 0.8 < first.std().item() < 1.2  # random normal
    assert spy.grads_before == [[True, True]] * 3  # parameter grads set to None before every step
    model, _ = state["timing_case"]
    assert all(p.grad is not None for p in model.parameters())  # and the backward reached them
    assert spy.input_requires_grad == [False] * 3  # parameter gradients only (autofuse.tuning.timed_call)


@pytest.mark.gpu
@pytest.mark.nvcc
def test_an_illegal_memory_access_is_recorded_and_the_tune_goes_on_in_a_fresh_worker(monkeypatch, tmp_path):
    use_test_plugins(monkeypatch, "broken_cuda")
    try:
        [result] = autofuse.tune("matmul_gelu_softmax", SMALL, device="cuda", table=tmp_path / "t.json", seed=1,
                                 variants=["illegal_access", "eager", "cuda_tiled"], autograd_entry=False,
                                 trial_timeout=120, progress=False)
    finally:
        plugins.reset_plugin_manager()
    outcomes = _outcomes(result)
    assert outcomes["illegal_access"] is Outcome.RUNTIME_FAILED, outcomes
    assert "illegal memory access" in next(r.result.reason for r in result.rows if r.variant == "illegal_access")
    assert outcomes["eager"] is Outcome.OK and outcomes["cuda_tiled"] is Outcome.OK
    assert result.winner is not None


def test_the_final_choice_re_times_a_variants_near_configurations_and_the_winner_replaces_its_row():
    from autofuse.core import registry
    from autofuse.tuning import study as studies
    from autofuse.tuning import tuner
    from autofuse.tuning.outcome import Job, TrialResult
    from autofuse.tuning.timing import Timing

    configs = registry.get_variant("matmul_gelu_softmax", "triton").configs(SMALL, "cpu")[:4]
    ok = lambda ms: TrialResult(Outcome.OK, None, 1e-7, Timing(ms, ms, ms, 30))  # noqa: E731
    key = lambda c: ("triton", studies.config_label(c))  # noqa: E731
    results = {key(configs[0]): ok(1.00), key(configs[1]): ok(1.04), key(configs[2]): ok(1.06),
               key(configs[3]): TrialResult(Outcome.OUT_OF_REACH, "slow", None, Timing(1.01, 1.01, 1.01, 30)),
               ("eager", studies.config_label({})): ok(3.0)}
    spaces = {"triton": configs, "eager": [{}]}
    rows = tuner._rows(results, {n: registry.get_variant("matmul_gelu_softmax", n) for n in spaces}, spaces)
    near = tuner._near_ties(results, rows, spaces)
    # Gated, within 5% of the variant's best, not the best itself; an out-of-reach one is not gated.
    assert [(r.variant, r.params) for r in near] == [("triton", configs[1])]

    class Worker:
        def call(self, op, payload, timeout):
            ms = lambda c: 3.0 if c.variant == "eager" else 0.9 if c.params == configs[1] else 1.0  # noqa: E731
            return {c.label(): Timing(ms(c), ms(c), ms(c), 50) for c in payload[1]}

    job = Job("matmul_gelu_softmax", SMALL, "cpu", "float32", "fp32", "any", 1)
    winner, _ = tuner._finish(registry.get_problem("matmul_gelu_softmax"), job, rows, Worker(), 60, False, 4, "s",
                              near=near)
    assert winner["params"] == configs[1]
    [triton] = [row for row in rows if row.variant == "triton"]
    assert triton.params == configs[1] and winner["candidates"]["triton"]["params"] == configs[1]


def test_the_autograd_entry_records_each_variants_training_step_not_its_forwards_re_timing():
    """A variant the autograd race does not re-time (beyond the best three) recorded, in the
    autograd entry's candidates, its forward's re-timed time as its training step's (kb2-22 on an
    H100: cublas_epilogue's "step" read 0.1831 ms, its forward's time, beside compiled's 0.4494)."""
    from autofuse.core import registry
    from autofuse.tuning import study as studies
    from autofuse.tuning import tuner
    from autofuse.tuning.outcome import Job, TrialResult
    from autofuse.tuning.timing import Timing

    timed = lambda ms: Timing(ms, ms, ms, 30)  # noqa: E731
    forward = {"eager": 3.0, "simplified": 2.9, "cublas_epilogue": 1.0, "triton": 1.1}
    step = {"eager": 5.0, "simplified": 4.0, "cublas_epilogue": 9.0, "triton": 4.5}
    spaces = {name: [{}] if name != "triton" else
              registry.get_variant("matmul_gelu_softmax", "triton").configs(SMALL, "cuda")[:1] for name in forward}
    results = {(n, studies.config_label(spaces[n][0])): TrialResult(Outcome.OK, None, 1e-7, timed(ms))
               for n, ms in forward.items()}
    rows = tuner._rows(results, {n: registry.get_variant("matmul_gelu_softmax", n) for n in spaces}, spaces)

    class Worker:
        def call(self, op, payload, timeout):
            if op == "evaluate":
                _, candidate = payload
                return TrialResult(Outcome.OK, None, 1e-7, timed(step[candidate.variant]))
            ms = lambda c: (step if c.autograd else forward)[c.variant]  # noqa: E731
            return {c.label(): timed(ms(c)) for c in payload[1]}

    job = Job("matmul_gelu_softmax", SMALL, "cuda", "float32", "fp32", "any", 1)  # the worker is a stand-in
    winner, grad = tuner._finish(registry.get_problem("matmul_gelu_softmax"), job, rows, Worker(), 60, True, 4, "s")
    assert winner["variant"] == "cublas_epilogue" and winner["candidates"]["cublas_epilogue"]["median_ms"] == 1.0
    assert {n: c["median_ms"] for n, c in grad["candidates"].items()} == step
