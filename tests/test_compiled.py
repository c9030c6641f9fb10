"""`compiled`: torch.compile of the reference, a variant of every problem. On the CPU: registered
for built-ins and files and blockable; through the gate at fp32 (BatchNorm's side effects, train
and eval, gradients) and bf16 (cached bfloat16 weights); a KernelBench file tuned between it and
eager, exported, dispatched; a failed compile recorded. Compiles are few and small: on two CPU
cores each takes seconds (tens of seconds with inductor's cache cold)."""

import json
import logging
import pathlib

import pytest
import torch
from helpers import PROBLEMS, assert_close
from test_kernelbench import kernelbench_eval

from autofuse.cli import main
from autofuse.core import plugins, registry
from autofuse.kernelbench.export import export_kernelbench
from autofuse.serve.table import DispatchKey, DispatchTable, current_fingerprint, shape_key
from autofuse.testing import assert_variant_conforms
from autofuse.tuning import evaluate, search
from autofuse.tuning.outcome import Outcome, TrialResult
from autofuse.tuning.worker import Candidate, Job

GEMM = pathlib.Path(__file__).parent / "kernelbench" / "gemm_sigmoid_sum.py"  # KernelBench 2-56, small sizes
DEFAULT = {"mode": "default", "dynamic": False}


@pytest.fixture(autouse=True)
def compiled(monkeypatch, no_file_problems):
    """`compiled` registered (conftest leaves it out of other tests), no KernelBench file loaded."""
    monkeypatch.delenv("AUTOFUSE_BLOCK_PLUGINS", raising=False)
    plugins.reset_plugin_manager()


def test_every_problem_has_it_a_file_problem_too_and_it_can_be_blocked(monkeypatch):
    for problem in [*PROBLEMS, str(GEMM)]:
        variant = registry.get_variant(problem, "compiled")
        assert (variant.kind, variant.problem, registry.owner(problem, "compiled")) == ("compiled", registry.get_problem(problem).name, "compiled")
        assert variant.configs({}, "cpu")[0] == DEFAULT and {c["dynamic"] for c in variant.configs({}, "cpu")} == {False, True}
    assert registry.get_variant("gemm_bn", "compiled").source_hash() != registry.get_variant("kb2-22", "compiled").source_hash()
    assert registry.get_variant("gemm_bn", "compiled").rank() > registry.get_variant("gemm_bn", "cuda_templated").rank()
    monkeypatch.setenv("AUTOFUSE_BLOCK_PLUGINS", "compiled")
    plugins.reset_plugin_manager()
    assert "compiled" not in registry.variants("gemm_bn") and "compiled" not in registry.variants(str(GEMM))


@pytest.mark.parametrize("problem,precision", [("gemm_bn", "fp32"), ("matmul_gelu_softmax", "bf16")])
def test_it_passes_the_conformance_kit(problem, precision):
    """gemm_bn at fp32: BatchNorm's running statistics, train and eval, gradients; 99 at bf16:
    the cached bfloat16 weights, renewed after an in-place update, and gradients through them."""
    assert_variant_conforms(problem, "compiled", precision=precision, params=DEFAULT, shapes=[(7, 37, 53)])


def test_a_kernelbench_file_tuned_on_the_cpu_chooses_between_eager_and_compiled(tmp_path, capsys):
    table = tmp_path / "table.json"
    assert main(["tune", str(GEMM), "--device", "cpu", "--variants", "eager,compiled", "--trials", "2",
                 "--table", str(table), "--no-progress", "--seed", "4", "--no-autograd-entry",
                 "--budget", "full"]) == 0  # full: both gated, whatever their times
    out = capsys.readouterr().out
    assert "compile s" in out  # the tune table's column
    [entry] = json.loads(table.read_text())["devices"].popitem()[1]["problems"]["kb_gemm_sigmoid_sum"].popitem()[1].values()
    assert set(entry["candidates"]) == {"eager", "compiled"}
    assert entry["candidates"]["compiled"]["outcome"] == "ok" and entry["candidates"]["compiled"]["compile_s"] > 0
    assert entry["variant"] in ("eager", "compiled")

    out_file = tmp_path / "gemm_new.py"
    export_kernelbench(str(GEMM), out_file, table=table)
    model, model_new, inputs, want, got = kernelbench_eval(GEMM, out_file)
    with torch.no_grad():
        assert model_new.dispatch_info(inputs[0])["variant"] == entry["variant"]
    assert_close(got, want, registry.get_problem(str(GEMM)).tolerances["fp32"])


def test_an_exported_model_new_compiles_once_and_follows_its_parameters(tmp_path, caplog):
    """Where the table names `compiled`, ModelNew compiles at its first call (said once), and
    later calls read the caller's parameters, updated in place as an optimizer step does."""
    problem = registry.get_problem(str(GEMM))
    table = tmp_path / "table.json"
    entry = {"variant": "compiled", "params": DEFAULT, "median_ms": 1.0, "p20_ms": 1.0, "p80_ms": 1.0}
    DispatchTable(table).record(current_fingerprint("cpu"), problem.name, shape_key(problem.default_shapes[0]),
                                DispatchKey("float32", "fp32", "any", False).to_str(), entry)
    out_file = tmp_path / "gemm_new.py"
    export_kernelbench(str(GEMM), out_file, table=table)
    with caplog.at_level(logging.INFO, logger="autofuse"):
        model, model_new, inputs, want, got = kernelbench_eval(GEMM, out_file)
        assert_close(got, want, problem.tolerances["fp32"])
        with torch.no_grad():
            assert model_new.dispatch_info(inputs[0])["variant"] == "compiled"
            for m in (model, model_new):
                m.linear.weight.mul_(-2.0)
            assert_close(model_new(inputs[0]), model(inputs[0]), problem.tolerances["fp32"], what="after an update")
    said = [r.getMessage() for r in caplog.records if "torch.compile(" in r.getMessage()]
    assert len(said) == 1 and "kb_gemm_sigmoid_sum" in said[0] and "(32, 24)" in said[0], said


def _job():
    return Job("matmul_gelu_softmax", {"batch_size": 8, "in_features": 24, "out_features": 16}, "cpu", "float32",
               "fp32", "any", seed=0)


def test_a_compile_that_fails_is_a_recorded_outcome(monkeypatch):
    real_compile = torch.compile

    def failing_backend(graph, example_inputs):
        raise RuntimeError("inductor fell over")

    # At the first call (where inductor compiles) and when wrapping (a torch that refuses this Python).
    monkeypatch.setattr(torch, "compile", lambda fn, **options: real_compile(fn, backend=failing_backend))
    result = evaluate.evaluate({}, _job(), Candidate("compiled", DEFAULT))
    assert result.outcome is Outcome.COMPILE_FAILED and "inductor fell over" in result.reason, result
    monkeypatch.setattr(torch, "compile", lambda fn, **options: (_ for _ in ()).throw(RuntimeError("not on 3.99")))
    result = evaluate.evaluate({}, _job(), Candidate("compiled", DEFAULT))
    assert result.outcome is Outcome.COMPILE_FAILED and "not on 3.99" in result.reason, result


@pytest.mark.parametrize("dynamic", [False, True])
def test_the_tuners_gate_checks_a_compile_per_shape_at_the_tuned_shape_only(monkeypatch, dynamic):
    """At the odd small shape a dynamic=False compile would compile and check other code; a
    dynamic=True one runs there the code it serves, so it is checked there too."""
    graphs, shapes = [], []
    real_compile, real_check = torch.compile, evaluate.check_variant

    def recording_backend(graph, example_inputs):  # no inductor: only what dynamo traced for which x
        graphs.append(graph)
        return graph.forward

    def recording_check(variant, problem, cases, *args, **kwargs):
        shapes.extend(dict(case.shape) for case in cases)
        return real_check(variant, problem, cases, *args, **kwargs)

    monkeypatch.setattr(torch, "compile", lambda fn, **options: real_compile(fn, backend=recording_backend,
                                                                             dynamic=options["dynamic"]))
    monkeypatch.setattr(evaluate, "check_variant", recording_check)
    job = _job()
    config = {"mode": "default", "dynamic": dynamic}
    result = evaluate.evaluate({}, job, Candidate("compiled", config))
    assert result.outcome is Outcome.OK, result
    odd = registry.get_problem(job.problem).odd_shape(job.shape)
    assert (odd in shapes) == dynamic and job.shape in shapes, shapes
    assert search.trial_shapes(job, "compiled", config) == [job.shape] + [odd] * dynamic
    if not dynamic:
        assert len(graphs) == 1, f"compiled {len(graphs)} graphs, the tuned shape's alone expected"


def test_a_rungs_gate_and_retiming_run_the_instance_its_timing_compiled(monkeypatch):
    """A rung times its candidates first, then gates and re-times some on that timing: on the
    instance the timing compiled, not on a new one that compiles the tuned shape again (a training
    step, seconds a rung on an H100 host). A gate on another worker's state still compiles it."""
    graphs, real_compile = [], torch.compile

    def recording_backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    monkeypatch.setattr(torch, "compile", lambda fn, **options: real_compile(fn, backend=recording_backend))
    job, candidate, state = _job(), Candidate("compiled", DEFAULT), {}
    timed = evaluate.evaluate(state, job, candidate, None, False)
    assert timed.outcome is Outcome.OUT_OF_REACH and len(graphs) == 1, timed
    before = len(graphs)
    assert evaluate.evaluate(state, job, candidate, None, True, timed.timing).outcome is Outcome.OK
    on_kept = len(graphs) - before
    evaluate.retime(state, job, [candidate], rounds=1)
    assert len(graphs) - before == on_kept, "the re-timing compiled the tuned shape again"
    before = len(graphs)
    assert evaluate.evaluate({}, job, candidate, None, True, timed.timing).outcome is Outcome.OK
    assert len(graphs) - before == on_kept + 1, (on_kept, len(graphs) - before)


def test_compile_seconds_are_an_optional_field_of_a_trial():
    result = TrialResult(Outcome.OK, compile_s=2.5)
    assert TrialResult.from_dict(result.to_dict()).compile_s == 2.5
    old = {k: v for k, v in result.to_dict().items() if k != "compile_s"}  # recorded before the field existed
    assert TrialResult.from_dict(old).compile_s is None


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs", "reduce-overhead"])
def test_it_conforms_on_gpu_at_fp32_after_tf32(mode):
    """On CUDA, compiled at tf32 first and then, in the same process, at fp32: at K=1000 plain TF32
    misses fp32's tolerance, so this fails if a TF32 kernel inductor chose (max-autotune bakes the
    flag into its GEMM templates) served an fp32 call. ieee and bf16 run under fp32's flags (TF32
    off; bf16 casts its operands), so fp32 stands for them; a bfloat16 model's compiled runs in
    tests/test_bf16_model_gpu.py.

    ``max-autotune`` is max-autotune-no-cudagraphs' kernels replayed as CUDA graphs: its flags are
    checked there, its copied-out outputs under reduce-overhead. With it, and with ieee and bf16,
    the test did not finish in 200-250 s on an H100 host (every randomized case compiles again:
    dynamo specialises on the model's float attributes). As it is: default 12.6 s (H100);
    reduce-overhead 15.7 s and max-autotune-no-cudagraphs 35.7 s with Inductor's cache warm, over
    150 s cold (its GEMM autotuning; H200), so give this file a few minutes on a fresh host.

    At tf32 itself a compile may miss the gate: on an H100, max-autotune's Triton GEMM templates
    put 2 of 777000 elements of gemm_bn's eval weight gradient past atol + rtol·|ref|, and in a
    later run default and reduce-overhead put 1 there (-0.116 where float64 has -0.144; they had
    passed in the run before). That is the gate doing its job (the tuner records the miss and
    picks another candidate), so at tf32 a tolerance miss is accepted, a crash is not."""
    for precision in ("tf32", "fp32"):
        try:
            assert_variant_conforms("gemm_bn", "compiled", device="cuda", precision=precision,
                                    params={"mode": mode, "dynamic": False}, shapes=[(37, 1000, 777)])
        except AssertionError as exc:
            tolerance_miss = "elements off by more than" in str(exc) or "relative L2 error" in str(exc)
            if not (precision == "tf32" and tolerance_miss):
                raise
