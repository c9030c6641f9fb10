"""The tuner compiles a batch's Triton candidates in parallel before the worker measures them
(``autofuse.tuning.prewarm``): at every shape a trial runs them at, never on the CPU, and
nothing it does can change a result (a failure is the worker's to meet and record)."""

import os
import pathlib

import pytest
import torch

import autofuse
from autofuse.core import registry
from autofuse.kernels.triton import variant as triton_variant
from autofuse.tuning import prewarm, search
from autofuse.tuning.outcome import Job, Outcome, TrialResult

needs_triton = pytest.mark.skipif(triton_variant.triton_missing() is not None, reason="needs triton")
SHAPE = {"batch_size": 16, "in_features": 48, "out_features": 40}


def test_on_the_cpu_nothing_is_compiled_ahead():
    prewarm._shutdown()
    configs = triton_variant.gemm_configs(48, "cpu")[:2]
    prewarm.start("cpu")
    prewarm.begin("matmul_gelu_softmax", "cpu", "float32", "any", "fp32", [("triton", c, SHAPE) for c in configs]).wait()
    assert prewarm._pool is None and not prewarm.enabled("cpu")


def test_prewarm_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("AUTOFUSE_PREWARM", "0")
    assert not prewarm.enabled("cuda")


def test_a_trial_runs_at_the_tuned_shape_and_the_gates_odd_one_where_its_configuration_is_valid():
    problem = registry.get_problem("matmul_gelu_softmax")
    job = Job(problem.name, SHAPE, "cpu", "float32", "fp32", "any", 0)
    odd = problem.odd_shape(SHAPE)
    configs = registry.get_variant(problem.name, "triton").configs(SHAPE, "cpu")
    valid_at_odd = registry.get_variant(problem.name, "triton").configs(odd, "cpu")
    for config in configs:
        want = [SHAPE, odd] if config in valid_at_odd else [SHAPE]
        assert search.trial_shapes(job, "triton", config) == want
    assert search.trial_shapes(job, "eager", {}) == [SHAPE, odd]


def test_a_failing_candidate_is_the_workers_to_record():
    assert prewarm.compile_candidate("matmul_gelu_softmax", "cpu", "float32", "any", "fp32", "triton",
                                     {"block_m": -1}, SHAPE) is False


@needs_triton
def test_the_search_asks_for_each_triton_candidate_at_each_shape_before_measuring_it(monkeypatch, tmp_path):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    asked = []
    monkeypatch.setattr(prewarm, "begin", lambda problem, device, dtype, mode, precision, candidates, log=None:
                        asked.append((problem, device, precision, list(candidates))) or prewarm.Pending([]))
    [result] = autofuse.tune("matmul_gelu_softmax", SHAPE, device="cpu", seed=2, n_trials=3, variants=["triton", "eager"],
                             autograd_entry=False, batch_classes=False, progress=False, table=tmp_path / "t.json")
    job = Job("matmul_gelu_softmax", SHAPE, "cpu", "float32", "fp32", "any", 2)
    shapes = {}
    for _, device, precision, candidates in asked:
        assert device == "cpu" and precision == "fp32"
        for name, config, shape in candidates:
            held = shapes.setdefault((name, str(config)), (name, config, []))[2]
            held += [] if shape in held else [shape]  # a repeated suggestion is asked for again
    tried = [row for row in result.rows if row.variant == "triton"]
    assert tried and all((row.variant, str(row.params)) in shapes for row in tried)
    for name, config, at in shapes.values():
        assert at == search.trial_shapes(job, name, config)


def test_a_pool_process_runs_an_autograd_candidate_forward_and_backward(monkeypatch):
    """With gradients the pool runs the backward too (a Triton variant's backward kernels then
    compile there, not one after another in the worker) and leaves the process's cached model
    without gradients for its next candidate. Shown with eager, which runs the same way on the CPU."""
    backward = []
    original = torch.Tensor.backward
    monkeypatch.setattr(torch.Tensor, "backward", lambda self, *a, **k: backward.append(tuple(self.shape))
                        or original(self, *a, **k))
    assert prewarm.compile_candidate("matmul_gelu_softmax", "cpu", "float32", "any", "fp32", "eager", {}, SHAPE,
                                     None, True)
    assert backward == [(16, 40)]
    model, _ = prewarm._case(registry.get_problem("matmul_gelu_softmax"), SHAPE, "cpu", torch.float32, "any")
    assert all(p.grad is None for p in model.parameters())
    assert prewarm.compile_candidate("matmul_gelu_softmax", "cpu", "float32", "any", "fp32", "eager", {}, SHAPE)
    assert backward == [(16, 40)]  # without gradients: the forward alone


class _Recorded:
    """``prewarm.submit`` recorded: each call's candidates, and the ``wait`` on what it returned."""

    def __init__(self, events: list):
        self.events = events

    def __call__(self, problem, device, dtype, mode, precision, candidates, log=None):
        asked = [prewarm.Compile(*c) for c in candidates]
        self.events.append(("submit", asked))
        events = self.events

        class Pending:
            def wait(self):
                events.append(("wait", asked))
        return Pending()


@needs_triton
def test_the_batch_classes_compile_every_rung_ahead_and_wait_for_each_before_racing_it(monkeypatch, tmp_path):
    from autofuse.tuning import batch_classes

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    events = []
    monkeypatch.setattr(prewarm, "submit", _Recorded(events))
    race = batch_classes.run_rung
    monkeypatch.setattr(batch_classes, "run_rung", lambda job, candidates, *a, **k: events.append(
        ("race", job.shape["batch_size"], candidates[0].autograd)) or race(job, candidates, *a, **k))
    autofuse.tune("matmul_gelu_softmax", SHAPE, device="cpu", seed=2, n_trials=2, variants=["triton", "eager"],
                  autograd_entry=True, batch_classes=True, progress=False, table=tmp_path / "t.json")
    first_race = next(i for i, e in enumerate(events) if e[0] == "race")
    races = [e for e in events if e[0] == "race"]
    # One submit a rung, all of them before the first race, in the order the rungs race.
    rung_submits = [e[1] for e in events[first_race - len(races) - 1:first_race - 1]]
    assert [e[0] for e in events[first_race - len(races) - 1:first_race]] == ["submit"] * len(races) + ["wait"]
    for (_, batch, autograd), asked in zip(races, rung_submits):  # at the rung's batch, or the gate's odd one
        assert asked and {c.shape["batch_size"] for c in asked} <= {batch, 7}, (batch, asked)
        assert all(c.autograd == autograd for c in asked)
    assert any(c.variant == "triton" for asked in rung_submits for c in asked)
    # Each rung waits for its own compiles, and only for them, just before its race.
    after = events[first_race - 1:]
    pairs = [(after[i], after[i + 1]) for i, e in enumerate(after) if e[0] == "wait"]
    assert [(w[1], r[1:]) for w, r in pairs] == [(asked, race[1:]) for asked, race in zip(rung_submits, races)]
    # The autograd entry's rungs (1, 8 and 32 here; and the gate's odd shape, batch 7) are asked
    # for with gradients, the forward entry's without: both ladders at each rung.
    with_gradients = {c.shape["batch_size"] for asked in rung_submits for c in asked if c.autograd}
    without = {c.shape["batch_size"] for asked in rung_submits for c in asked if not c.autograd}
    assert with_gradients == {1, 7, 8, 32} and {1, 8, 32} <= without, (with_gradients, without)


@needs_triton
def test_the_rungs_compiles_are_submitted_once_the_forward_winner_is_chosen_before_the_autograd_entry(monkeypatch, tmp_path):
    """The pool is idle while the worker compiles and gates the autograd entry's training step
    (kb2-99 fp32, H200: 18-24 s), and the batch classes then waited 5.5 s for their first rung."""
    from autofuse.tuning.worker import Worker

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    events = []
    monkeypatch.setattr(prewarm, "submit", _Recorded(events))
    call = Worker.call

    def recorded_call(self, op, payload, timeout):
        if op == "evaluate" and payload[1].autograd:
            events.append(("autograd evaluate", payload[0].shape["batch_size"]))
        return call(self, op, payload, timeout)
    monkeypatch.setattr(Worker, "call", recorded_call)
    [result] = autofuse.tune("matmul_gelu_softmax", SHAPE, device="cpu", seed=2, n_trials=2, variants=["triton", "eager"],
                             autograd_entry=True, batch_classes=True, progress=False, table=tmp_path / "t.json")
    first_grad = events.index(("autograd evaluate", SHAPE["batch_size"]))
    ahead = {c for e in events[:first_grad] if e[0] == "submit" for c in map(_hashable, e[1])}
    rungs = [e for e in events[first_grad:] if e[0] == "submit"]
    assert ahead and any(c[3] for c in ahead) and any(not c[3] for c in ahead)  # the forward's rungs and the training step's
    # Every rung's compile the batch classes ask for was asked for ahead, where the autograd entry
    # took the forward winner's configuration (which it tries first).
    if result.grad_winner["params"] == result.winner["params"]:
        assert {c for e in rungs for c in map(_hashable, e[1])} <= ahead


def _hashable(c: prewarm.Compile) -> tuple:
    return c.variant, repr(sorted(c.params.items())), repr(sorted(c.shape.items())), c.autograd


def test_a_candidate_submitted_again_is_waited_for_not_compiled_again(monkeypatch):
    submitted = []

    class Pool:
        def submit(self, fn, *args):
            submitted.append(args)
            return f"future {len(submitted)}"
    monkeypatch.setattr(prewarm, "enabled", lambda device: True)
    monkeypatch.setattr(prewarm, "_unsupported", lambda: None)
    monkeypatch.setattr(prewarm, "start", lambda device, log=None: None)
    monkeypatch.setattr(prewarm, "_pool", Pool())
    monkeypatch.setattr(prewarm, "_submitted", {})
    monkeypatch.setattr(prewarm, "is_triton", lambda cls: True)
    config = {"block_m": 16}
    ask = lambda *candidates: prewarm.submit("matmul_gelu_softmax", "cuda", "float32", "any", "fp32",  # noqa: E731
                                              list(candidates)).futures
    assert ask(prewarm.Compile("triton", config, SHAPE, True)) == ["future 1"]
    again = ask(prewarm.Compile("triton", dict(config), dict(SHAPE), True), prewarm.Compile("triton", config, SHAPE))
    assert again == ["future 1", "future 2"] and len(submitted) == 2
    assert ask(prewarm.Compile("triton", config, {**SHAPE, "batch_size": 1}, True)) == ["future 3"]


@pytest.mark.gpu
@needs_triton
def test_on_the_gpu_the_pool_fills_tritons_cache_and_compiling_only_runs_no_kernel(monkeypatch, tmp_path):
    """A configuration compiled by the pool is in Triton's cache before this process runs it, and
    under ``compiling_only`` no kernel of the candidate runs (profiled); run after, it is right."""
    from autofuse.kernels.triton.launch import compiling_only
    from autofuse.tuning.gate import CheckCase, build_case

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))  # the pool's processes inherit it
    prewarm._shutdown()
    problem = registry.get_problem("matmul_gelu_softmax")
    shape = {"batch_size": 37, "in_features": 264, "out_features": 200}
    config, other = registry.get_variant(problem.name, "triton").configs(shape, "cuda")[:2]
    try:  # two: one alone is left to the worker
        prewarm.begin(problem.name, "cuda", "float32", "any", "fp32",
                      [("triton", config, shape), ("triton", other, shape)]).wait()
    finally:
        prewarm._shutdown()
    assert list((tmp_path / "triton").rglob("*.cubin")), "the pool compiled nothing into Triton's cache"
    # and loaded what it compiled, so the kernels' C launchers are built (``launch._load``)
    assert list((tmp_path / "triton").rglob("*launcher*.so")), "the pool built no launcher into Triton's cache"

    model, x = build_case(problem, CheckCase(shape, "randn", 4, True), "cuda", torch.float32, "any")
    variant = registry.get_variant(problem.name, "triton")("fp32", **config)
    variant.build("cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof, compiling_only(), \
            torch.no_grad():
        variant(model, x)
        torch.cuda.synchronize()
    ran = [e.key for e in prof.key_averages() if e.device_time_total > 0]
    assert not any("gemm" in name or "parts" in name for name in ran), ran
    fresh = registry.get_variant(problem.name, "triton")("fp32", **config)  # the first one kept W's unwritten parts
    with torch.no_grad():
        out = fresh(model, x)
        want = registry.get_variant(problem.name, "eager")("fp32")(model, x)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("problem_name", ["gemm_bn", "gemm_avgpool_gelu_residual", "matmul_gelu_softmax",
                                          "matmul_clamp_lse_mish"])
def test_a_pool_process_builds_each_problems_model_and_input_at_the_shape(problem_name):
    """What a pool process runs a candidate on (the device's, made there; here the CPU's): the
    problem's model at the shape's sizes and an input the model takes (a first version passed
    ``init_args``' (args, kwargs) as two arguments: every compile failed, silently, on the GPU)."""
    problem = registry.get_problem(problem_name)
    shape = problem.normalize_shape(dict(zip(problem.dims, (9, 24, 20))))
    model, x = prewarm._case(problem, shape, "cpu", torch.float32, "train")
    assert model.training and x.shape == (9, 24)
    with torch.no_grad():
        assert model(x).shape[0] == 9


def test_a_search_batch_asks_until_it_holds_enough_new_candidates_to_compile_together(monkeypatch):
    """Repeats and pruned variants fill no batch: asked ``size`` trials alone, kb2-99's last batches
    held one new Triton candidate each, which the worker then compiled alone (H200: 14 s of a
    69 s search). Here the first three asks of a batch of three repeat a measured configuration."""
    import optuna

    from autofuse.tuning import search
    from autofuse.tuning import study as studies
    from autofuse.tuning.budget import BUDGETS
    from autofuse.tuning.progress import TrialProgress
    from autofuse.tuning.shared_study import SharedStudy
    from autofuse.tuning.timing import Timing

    configs = [{"block_m": m} for m in (16, 32, 64, 128)]
    spaces = {"triton": configs}
    script = [configs[0], configs[0], configs[0], configs[1], configs[0], configs[2], configs[3]]

    def scripted(trial, spaces):
        trial.suggest_categorical("variant", ["triton"])
        return "triton", script.pop(0)
    monkeypatch.setattr(studies, "suggest", scripted)
    compiled = []
    monkeypatch.setattr(search, "_prebuild", lambda candidates, job: compiled.append([c["block_m"] for _, c in candidates]))
    measured = []

    class Worker:
        def call(self, op, payload, timeout):
            measured.append(payload[1].params["block_m"])
            return TrialResult(Outcome.OK, None, 1e-7, Timing(1.0, 0.99, 1.01, 10))

    study = studies.open_study("batch", 1, optuna.storages.InMemoryStorage())
    job = Job("matmul_gelu_softmax", SHAPE, "cuda", "float32", "fp32", "any", 1)
    with SharedStudy(study) as shared, TrialProgress(4, 0, "batch", enabled=False) as bar:
        progress = search._Progress(BUDGETS["full"], None)
        search._measure_batch(shared, spaces, job, Worker(), 4, 1, 5, 60.0, bar, progress)  # the measured one
        spent = search._measure_batch(shared, spaces, job, Worker(), 4, 3, 15, 60.0, bar, progress)
    assert compiled == [[16], [32, 64, 128]] and measured == [16, 32, 64, 128]
    assert spent == 6 and not script  # three repeats (told 16's result) and three new, asked in one batch
    # A batch stops asking at its ``asks``: what it holds then is what it compiles.
    script[:] = [configs[0]] * 4
    with SharedStudy(study) as shared, TrialProgress(4, 0, "batch", enabled=False) as bar:
        assert search._measure_batch(shared, spaces, job, Worker(), 8, 3, 4, 60.0, bar, search._Progress(BUDGETS["full"], None)) == 4
    assert compiled[-1] == []


WINNER_99_BF16 = {"block_m": 128, "block_n": 256, "block_k": 64, "stages": 3, "warps": 8, "group_m": 8,
                  "persistent": True, "tma": True, "operands": "cast_pass"}
# A worker's life, in a process of its own as the worker's is: the tuner names Triton's cache, the
# pool compiles the candidates, a compiled trial runs torch.compile, then the first calls.
_WORKER = """
import json, pathlib, sys, torch
from autofuse.core import registry
from autofuse.core.precision import parse_dtype
from autofuse.tuning import prewarm
from autofuse.tuning.worker import share_tritons_cache
dtype, precision, shape, configs, root = json.loads(sys.argv[1])
root = pathlib.Path(root)
share_tritons_cache()
problem = registry.get_problem("matmul_gelu_softmax")
configs = configs or registry.get_variant(problem.name, "triton").configs(shape, "cuda")[:2]
try:
    prewarm.begin(problem.name, "cuda", dtype, "any", precision, [("triton", c, shape) for c in configs]).wait()
finally:
    prewarm._shutdown()
pooled = sorted(map(str, root.rglob("*.cubin")))
torch.compile(lambda t: torch.nn.functional.gelu(t).sum(-1))(torch.randn(64, 96, device="cuda"))
before = set(map(str, root.rglob("*.cubin")))
model, x = prewarm._case(problem, shape, "cuda", parse_dtype(dtype), "any")
for config in configs:
    variant = registry.get_variant(problem.name, "triton")(precision, **config)
    variant.build("cuda")
    with torch.no_grad():
        variant(model, x)
torch.cuda.synchronize()
print(json.dumps({"pooled": pooled, "again": sorted(set(map(str, root.rglob("*.cubin"))) - before)}))
"""


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("dtype, precision, shape, configs", [
    ("float32", "fp32", {"batch_size": 37, "in_features": 264, "out_features": 200}, None),
    # kb2-99's bfloat16-model winner at its batch class 1
    ("bfloat16", "bf16", {"batch_size": 1, "in_features": 8192, "out_features": 8192},
     [WINNER_99_BF16, {**WINNER_99_BF16, "persistent": False}]),
])
def test_on_the_gpu_what_the_pool_compiled_is_loaded_after_a_torch_compile_not_compiled_again(
        tmp_path, dtype, precision, shape, configs):
    """The pool's whole point: after it compiled a candidate, the worker's first call at the same
    shape compiles no kernel. With ``TRITON_CACHE_DIR`` unset, as most users run, a worker that
    had run ``torch.compile`` (Inductor names its own cache there) compiled everything again
    (``worker.share_tritons_cache``)."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    env.update(TRITON_HOME=str(tmp_path), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    run = subprocess.run([sys.executable, "-c", _WORKER, json.dumps([dtype, precision, shape, configs, str(tmp_path)])],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["pooled"], "the pool compiled nothing"
    again = {pathlib.Path(p) for p in report["again"]}
    assert not again, (f"compiled again at the first call: {_specialized_apart(again, set(map(pathlib.Path, report['pooled'])))}"
                       f"; what the pool said: {run.stderr[-2000:]}")


def _specialized_apart(again: set, compiled: set) -> str:
    """Each kernel compiled again, with how its Triton IR's signature differs from the pool's."""
    import difflib

    said = []
    for cubin in sorted(again):
        pools = [c for c in compiled if c.name == cubin.name]
        if not pools:
            said.append(f"{cubin.name}: the pool compiled no kernel of that name")
            continue
        diff = list(difflib.unified_diff(_signature(pools[0]), _signature(cubin), lineterm="", n=0))[2:]
        said.append(f"{cubin.name}: {' | '.join(diff)[:3000]}")
    return "; ".join(said)


def _signature(cubin: pathlib.Path) -> list[str]:
    """The arguments of the kernel's Triton IR function, one a line."""
    ttir = cubin.with_suffix(".ttir")
    lines = [line for line in ttir.read_text().splitlines() if "tt.func" in line] if ttir.exists() else []
    return lines[0].split(", %") if lines else []


def test_the_tuner_names_tritons_cache_for_the_worker_and_the_pool_where_nothing_does(monkeypatch, tmp_path):
    from autofuse.tuning import worker

    knobs = pytest.importorskip("triton").knobs
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    started = []
    monkeypatch.setattr(worker.subprocess, "Popen", lambda *a, **k: started.append(os.environ.get("TRITON_CACHE_DIR")))
    monkeypatch.setattr(worker, "Connection", lambda fd: None)
    worker.Worker().spawn()
    assert started == [knobs.cache.dir] and started[0].startswith(str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))  # a user's own is kept
    worker.share_tritons_cache()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")


def test_a_batchs_nvcc_builds_run_while_the_pool_compiles_its_triton_kernels(monkeypatch):
    """The pool's compiles start first and are waited for last, the nvcc builds between: one after
    the other they took 11 s of kb2-22's bfloat16-model search on an H100 host."""
    events = []

    class Built:
        def __init__(self, precision, **config):
            pass

        def kernel_builds(self, device):
            return ["extension"]

    class Started:
        def wait(self):
            events.append("pool waited for")

    monkeypatch.setattr(search.registry, "get_variant", lambda problem, name: Built)
    monkeypatch.setattr(search, "trial_shapes", lambda job, name, config: [SHAPE])
    monkeypatch.setattr(search, "build_many", lambda builds: events.append(f"nvcc {len(builds)}"))
    monkeypatch.setattr(prewarm, "begin", lambda *args: events.append(f"pool started {len(args[5])}") or Started())
    job = Job("matmul_gelu_softmax", SHAPE, "cuda", "float32", "fp32", "any", 2)
    search._prebuild([("triton", {"a": 1}), ("cublas_epilogue", {"b": 2})], job)
    assert events == ["pool started 2", "nvcc 2", "pool waited for"]


def test_the_search_builds_its_whole_spaces_extensions_ahead_on_a_thread_and_waits_for_them(monkeypatch):
    """The nvcc builds of every configuration of a variant with a small space start on a thread as
    the search starts (the first candidate is measured alone meanwhile), and the search returns
    only once they are done; a large space (cuda_templated's 430) is built as it is asked."""
    import threading
    import time

    built, done = [], threading.Event()

    class Built:
        def __init__(self, precision, **config):
            self.config = config

        def kernel_builds(self, device):
            return [f"extension {self.config['n']}"]

    def slow_build_many(builds, jobs=None):
        assert threading.current_thread() is not threading.main_thread()
        built.extend(builds)
        done.wait(5)
        time.sleep(0.2)  # still building when the search's loop is done

    monkeypatch.setattr(search, "build_many", slow_build_many)
    monkeypatch.setattr(search, "_search_loop", lambda *args: done.set() or {"measured": True})
    job = Job("matmul_gelu_softmax", SHAPE, "cuda", "float32", "fp32", "any", 2)
    large = [{"n": 100 + i} for i in range(search.AHEAD_MAX_CONFIGS + 1)]  # built as its trials are asked
    spaces = {"cublas_epilogue": [{"n": 1}, {"n": 2}, {"n": 3}], "cuda_templated": large}
    monkeypatch.setattr(search.registry, "get_variant", lambda problem, name: Built)
    assert search.search(None, spaces, job, None, 3, None, 60, False, "x") == {"measured": True}
    assert built == ["extension 1", "extension 2", "extension 3"]
    assert not [t for t in threading.enumerate() if t.name == "autofuse-builds"]
