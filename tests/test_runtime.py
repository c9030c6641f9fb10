"""get_module: a drop-in for the reference model that dispatches each call through the table."""

import copy
import logging

import pytest
import torch
from helpers import PROBLEMS, SMALL, assert_close, init_args, kernelbench_model, module_for, record

import autofuse
from autofuse.core import registry
from autofuse.serve.dispatch import CallKey
from autofuse.serve.table import DispatchTable

B, IN, OUT = SMALL


def loaded_pair(problem, mode="train"):
    """(KernelBench Model with random weights, get_module module holding the same state)."""
    reference = kernelbench_model(problem, B, IN, OUT, mode=mode)
    module = module_for(problem).train(mode == "train")
    module.load_state_dict(reference.state_dict())
    return reference, module


# -- a drop-in for the reference ------------------------------------------------

@pytest.mark.parametrize("problem", PROBLEMS)
def test_state_dict_and_parameter_names_are_the_references(problem):
    args, kwargs = init_args(problem, B, IN, OUT)
    reference = registry.get_problem(problem).model(*args, **kwargs)
    module = module_for(problem)
    assert isinstance(module, type(reference))
    assert list(module.state_dict()) == list(reference.state_dict())
    assert [n for n, _ in module.named_parameters()] == [n for n, _ in reference.named_parameters()]


@pytest.mark.parametrize("variant", [None, "simplified"])
@pytest.mark.parametrize("problem", PROBLEMS)
def test_loaded_kernelbench_state_gives_the_references_output(problem, variant):
    if variant is not None:
        record(problem, B, IN, OUT, mode="train" if problem == "gemm_bn" else "any", autograd=True, variant=variant)
    reference, module = loaded_pair(problem)
    x = torch.randn(B, IN)
    want, got = reference(x), module(x)
    info = module.dispatch_info(x)
    assert info["variant"] == (variant or "eager"), info
    assert_close(got, want, registry.get_problem(problem).tolerances["fp32"])
    for name, buf in reference.named_buffers():  # gemm_bn in train mode: the running statistics
        assert_close(module.get_buffer(name), buf, atol=1e-6, rtol=1e-5, what=name)


# -- which variant serves a call --------------------------------------------------

def test_exact_entry_is_used():
    record("matmul_gelu_softmax", B, IN, OUT, autograd=True)
    info = module_for("matmul_gelu_softmax").dispatch_info(torch.randn(B, IN))
    assert (info["source"], info["variant"]) == ("tuned", "simplified")


def test_no_entry_runs_the_reference_and_warns_once_per_key(caplog):
    module = module_for("matmul_gelu_softmax")
    x = torch.randn(B, IN)
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        for _ in range(10):  # grad mode: the autograd key, then (no backward) the no-grad key too
            module(x)
        with torch.no_grad():
            module(x)
        assert module.dispatch_info(x)["source"] == "no entry: reference"
    warnings = sorted(r.getMessage() for r in caplog.records if r.name == "autofuse")
    assert len(warnings) == 2 and all("no tuned entry" in w for w in warnings), warnings
    assert "autograd=false" in warnings[0] and "autograd=true" in warnings[1], warnings


def test_a_bfloat16_models_miss_names_the_tune_that_fills_it(caplog):
    """The hint a miss prints tunes the key that missed: a bfloat16 model's needs --dtype bfloat16."""
    module = module_for("matmul_gelu_softmax", precision="bf16").bfloat16()
    with caplog.at_level(logging.WARNING, logger="autofuse"), torch.no_grad():
        module(torch.randn(B, IN, dtype=torch.bfloat16))
    [warning] = [r.getMessage() for r in caplog.records if r.name == "autofuse"]
    assert "--dtype bfloat16 --precision bf16" in warning, warning


def test_nearest_batch_entry_serves_another_batch():
    record("gemm_avgpool_gelu_residual", 64, IN, OUT, autograd=True)
    info = module_for("gemm_avgpool_gelu_residual").dispatch_info(torch.randn(50, IN))
    assert info["source"].startswith("nearest batch") and info["variant"] == "simplified", info


def test_the_keys_one_entry_serves_share_one_built_variant_and_its_weight_copies():
    """A caller whose batch varies: every batch the entry serves takes the same instance (each
    instance caches its own weight copies; one per batch size held 32 GiB on an H200)."""
    record("matmul_gelu_softmax", B, IN, OUT, variant="simplified")
    record("matmul_gelu_softmax", 4 * B, IN, OUT, variant="eager")
    module = module_for("matmul_gelu_softmax")
    with torch.no_grad():
        for batch in (1, 3, B, B + 1, 4 * B):
            module(torch.randn(batch, IN))
    dispatcher = module._autofuse
    served = {key.shape[0]: call for key, call in dispatcher.ready.items()}
    assert served[1] is served[3] is served[B] is served[B + 1] and served[4 * B] is not served[B]
    assert [type(v).kind for v in dispatcher.built.values()].count("simplified") == 1
    module.to(torch.float64)  # moved: its variants are built again for the new tensors
    assert dispatcher.built == {}


def test_compiled_gets_an_instance_per_key_its_recompile_limit_being_per_instance(with_compiled):
    record("matmul_gelu_softmax", B, IN, OUT, variant="compiled", params={"mode": "default", "dynamic": False})
    module = module_for("matmul_gelu_softmax")
    with torch.no_grad():
        for batch in (3, B, B + 1):
            assert module.dispatch_info(torch.randn(batch, IN))["variant"] == "compiled"  # resolved, not run
    served = list(module._autofuse.ready.values())
    assert len(served) == 3 and len({id(call) for call in served}) == 3


def test_grad_need_is_part_of_the_key():
    record("matmul_clamp_lse_mish", B, IN, OUT, autograd=False)
    module, x = module_for("matmul_clamp_lse_mish"), torch.randn(B, IN)
    assert module.dispatch_info(x)["source"] == "no entry: reference"
    assert module(x).requires_grad
    with torch.no_grad():
        assert module.dispatch_info(x)["source"] == "tuned"


def test_unknown_variant_in_the_table_falls_back_with_a_warning(caplog):
    record("matmul_gelu_softmax", B, IN, OUT, autograd=True, variant="no_such_variant")
    reference, module = loaded_pair("matmul_gelu_softmax")
    x = torch.randn(B, IN)
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        got = module(x)
    assert_close(got, reference(x), atol=1e-6, rtol=1e-5)
    assert module.dispatch_info(x)["source"] == "unusable entry: reference"
    assert any("no_such_variant" in r.getMessage() for r in caplog.records), caplog.text


def test_corrupt_table_is_reported_and_left_intact(tmp_path, caplog):
    path = tmp_path / "table.json"
    garbage = bytes(range(256)) * 4
    path.write_bytes(garbage)
    reference, module = loaded_pair("gemm_avgpool_gelu_residual")
    module._autofuse.table = DispatchTable(path)
    x = torch.randn(B, IN)
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        got = module(x)
    assert_close(got, reference(x), atol=1e-6, rtol=1e-5)
    assert module.dispatch_info(x)["source"] == "no entry: reference"
    assert any(str(path) in r.getMessage() for r in caplog.records), caplog.text
    assert path.read_bytes() == garbage


def test_a_deeply_nested_table_is_reported_like_a_corrupt_one(tmp_path, caplog):
    # It raised RecursionError from the module's first call (issue 32).
    path = tmp_path / "table.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    reference, module = loaded_pair("gemm_avgpool_gelu_residual")
    module._autofuse.table = DispatchTable(path)
    x = torch.randn(B, IN)
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        got = module(x)
    assert_close(got, reference(x), atol=1e-6, rtol=1e-5)
    said = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert len(said) == 1 and "nested" in said[0], caplog.text


BAD_ENTRIES = {
    "unknown parameter": ({"params": {"BLOCK": 256}}, "BLOCK"),
    "negative time": ({"median_ms": -1.0}, "median_ms"),
    "NaN time": ({"median_ms": float("nan")}, "median_ms"),
    "string time": ({"eager_ms": "fast"}, "eager_ms"),
}


@pytest.mark.parametrize("fields, named", BAD_ENTRIES.values(), ids=BAD_ENTRIES.keys())
def test_a_bad_entry_at_the_exact_shape_is_rejected_once_and_the_next_one_serves(fields, named, caplog):
    # Such entries were accepted silently where the shape matched (issue 32): the nearest-batch
    # path checks a configuration, the exact one did not.
    record("matmul_gelu_softmax", B, IN, OUT, **fields)
    record("matmul_gelu_softmax", 2 * B, IN, OUT)
    module, x = module_for("matmul_gelu_softmax"), torch.randn(B, IN)
    with caplog.at_level(logging.WARNING, logger="autofuse"), torch.no_grad():
        for _ in range(3):
            module(x)
        info = module.dispatch_info(x)
    assert info["source"].startswith(f"nearest batch (batch_size={2 * B},") and info["variant"] == "simplified", info
    rejected = [r.getMessage() for r in caplog.records if named in r.getMessage()]
    assert len(rejected) == 1, caplog.text


def test_table_argument_is_read(tmp_path):
    path = tmp_path / "elsewhere.json"
    record("matmul_gelu_softmax", B, IN, OUT, autograd=True, path=path)
    assert module_for("matmul_gelu_softmax", table=path).dispatch_info(torch.randn(B, IN))["source"] == "tuned"
    assert module_for("matmul_gelu_softmax").dispatch_info(torch.randn(B, IN))["source"] == "no entry: reference"


# -- inputs that do not fit --------------------------------------------------------

@pytest.mark.parametrize("x, expected, got", [
    (torch.randn(IN), "2-D", f"({IN},)"),
    (torch.randn(2, B, IN), "2-D", f"(2, {B}, {IN})"),
    (torch.randn(B, IN + 1), str(IN), f"({B}, {IN + 1})"),
    (torch.randn(B, IN, dtype=torch.float64), "float32", "float64"),
], ids=["1-D", "3-D", "features", "float64"])
def test_wrong_input_names_expected_and_got(x, expected, got):
    module = module_for("gemm_bn")
    with pytest.raises(autofuse.InputError) as info:
        module(x)
    assert expected in str(info.value) and got in str(info.value), str(info.value)


def test_bfloat16_input_needs_bf16_precision():
    module = module_for("matmul_gelu_softmax").to(torch.bfloat16)
    with pytest.raises(autofuse.InputError, match="precision='fp32'.*got bfloat16"):
        module(torch.randn(B, IN, dtype=torch.bfloat16))


def test_bf16_precision_module_takes_bfloat16_input():
    module = module_for("matmul_gelu_softmax", precision="bf16").to(torch.bfloat16)
    assert module(torch.randn(B, IN, dtype=torch.bfloat16)).dtype == torch.bfloat16


# -- train/eval, the hot path, precision --------------------------------------------

def test_gemm_bn_train_and_eval_each_match_the_reference():
    record("gemm_bn", B, IN, OUT, mode="train", autograd=True, median_ms=1.0)
    record("gemm_bn", B, IN, OUT, mode="eval", autograd=True, median_ms=3.0)
    reference, module = loaded_pair("gemm_bn")
    tol = registry.get_problem("gemm_bn").tolerances["fp32"]
    for mode, marker in (("train", 1.0), ("eval", 3.0), ("train", 1.0)):
        reference.train(mode == "train"), module.train(mode == "train")
        x = torch.randn(B, IN)
        assert module.dispatch_info(x)["entry"]["median_ms"] == marker, mode
        assert_close(module(x), reference(x), tol, what=mode)
        assert_close(module.bn.running_var, reference.bn.running_var, tol, what=f"{mode} running_var")


def test_hot_path_reads_no_file(monkeypatch):
    record("gemm_avgpool_gelu_residual", B, IN, OUT, autograd=True)
    module, x = module_for("gemm_avgpool_gelu_residual"), torch.randn(B, IN)
    first = module(x)

    def no_io(self):
        raise AssertionError("the dispatch table was read on the hot path")
    monkeypatch.setattr(DispatchTable, "load", no_io)
    assert_close(module(x), first, atol=0, rtol=0)


def test_bfloat16_module_uses_its_bf16_entry():
    record("matmul_gelu_softmax", B, IN, OUT, autograd=True, dtype="bfloat16", precision="bf16")
    module, x = module_for("matmul_gelu_softmax", precision="bf16"), torch.randn(B, IN)
    assert module.dispatch_info(x)["source"] == "no entry: reference"
    module.to(torch.bfloat16)
    assert module.dispatch_info(x.bfloat16())["source"] == "tuned"


def test_tf32_precision_runs():
    reference, module = kernelbench_model("matmul_gelu_softmax", B, IN, OUT), module_for("matmul_gelu_softmax", precision="tf32")
    module.load_state_dict(reference.state_dict())
    x = torch.randn(B, IN)
    assert_close(module(x), reference(x), registry.get_problem("matmul_gelu_softmax").tolerances["tf32"])


def test_unknown_precision_raises():
    with pytest.raises(autofuse.InputError, match="fp64"):
        module_for("gemm_bn", precision="fp64")


# -- a stricter precision's entry serves a looser call (issue 12.3) -------------------

def test_an_fp32_entry_serves_a_bf16_call_and_runs_at_fp32(caplog):
    record("matmul_gelu_softmax", B, IN, OUT, autograd=False, precision="fp32")
    reference = kernelbench_model("matmul_gelu_softmax", B, IN, OUT)
    module = module_for("matmul_gelu_softmax", precision="bf16")
    module.load_state_dict(reference.state_dict())
    x = torch.randn(B, IN)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="autofuse"):
        for _ in range(3):
            got = module(x)
        info = module.dispatch_info(x)
        served = module._autofuse.ready[module._autofuse.call_key(module, x)]
    assert (info["source"], info["precision"], info["variant"]) == ("tuned at fp32", "fp32", "simplified"), info
    assert served.precision == "fp32"  # its math mode and the gate it passed, not bf16's
    assert_close(got, reference(x), registry.get_problem("matmul_gelu_softmax").tolerances["fp32"])
    said = [r.getMessage() for r in caplog.records if "tuned at fp32" in r.getMessage()]
    assert len(said) == 1 and "run at fp32" in said[0], said


def test_a_looser_entry_never_serves_a_stricter_call():
    for precision in ("tf32", "bf16"):
        record("matmul_gelu_softmax", B, IN, OUT, precision=precision)
    for precision in ("fp32", "ieee"):
        info = module_for("matmul_gelu_softmax", precision=precision).dispatch_info(torch.randn(B, IN))
        assert (info["source"], info["precision"]) == ("no entry: reference", precision), info


def test_the_least_strict_serving_precision_is_preferred():
    record("matmul_clamp_lse_mish", B, IN, OUT, precision="fp32", median_ms=3.0)
    record("matmul_clamp_lse_mish", B, IN, OUT, precision="tf32", median_ms=2.0)
    with torch.no_grad():
        bf16 = module_for("matmul_clamp_lse_mish", precision="bf16").dispatch_info(torch.randn(B, IN))
        ieee = module_for("matmul_clamp_lse_mish", precision="ieee").dispatch_info(torch.randn(B, IN))
    assert (bf16["source"], bf16["entry"]["median_ms"]) == ("tuned at tf32", 2.0), bf16
    assert ieee["source"] == "no entry: reference", ieee


def test_precision_before_batch_size():
    # The requested precision at a nearby batch beats a stricter precision at the exact shape:
    # the same kernel and arithmetic, where fp32 against bf16 cost 12x on an H100 (99: 2.69 / 0.22 ms).
    record("gemm_avgpool_gelu_residual", 2 * B, IN, OUT, precision="bf16")
    record("gemm_avgpool_gelu_residual", B, IN, OUT, precision="fp32")
    record("gemm_avgpool_gelu_residual", 4 * B, IN, OUT, precision="tf32")
    x = torch.randn(B, IN)
    with torch.no_grad():
        bf16 = module_for("gemm_avgpool_gelu_residual", precision="bf16").dispatch_info(x)
        tf32 = module_for("gemm_avgpool_gelu_residual", precision="tf32").dispatch_info(x)
        tf32_other_batch = module_for("gemm_avgpool_gelu_residual", precision="tf32").dispatch_info(torch.randn(3, IN))
    assert (bf16["source"], bf16["precision"]) == (f"nearest batch (batch_size={2 * B},in_features={IN},out_features={OUT})", "bf16")
    assert (tf32["source"], tf32["precision"]) == (f"nearest batch (batch_size={4 * B},in_features={IN},out_features={OUT})", "tf32")
    assert tf32_other_batch["source"].startswith("nearest batch") and tf32_other_batch["precision"] == "tf32"
    record("gemm_avgpool_gelu_residual", 2 * B, IN, OUT, precision="bf16", variant="no_such_variant")
    with torch.no_grad():
        info = module_for("gemm_avgpool_gelu_residual", precision="bf16").dispatch_info(x)
    # An unusable entry hands over to the next one in the same order, not to the reference.
    assert info["source"] == f"nearest batch (batch_size={4 * B},in_features={IN},out_features={OUT}), tuned at tf32", info


def test_a_nearest_batch_entry_at_a_stricter_precision_says_both():
    record("gemm_avgpool_gelu_residual", 2 * B, IN, OUT, precision="fp32")
    with torch.no_grad():
        info = module_for("gemm_avgpool_gelu_residual", precision="bf16").dispatch_info(torch.randn(B, IN))
    assert info["source"] == f"nearest batch (batch_size={2 * B},in_features={IN},out_features={OUT}), tuned at fp32", info
    assert info["precision"] == "fp32"


def test_bfloat16_inputs_are_served_only_by_bf16_entries():
    record("matmul_gelu_softmax", B, IN, OUT, dtype="float32", precision="fp32")
    module = module_for("matmul_gelu_softmax", precision="bf16").to(torch.bfloat16)
    with torch.no_grad():
        assert module.dispatch_info(torch.randn(B, IN, dtype=torch.bfloat16))["source"] == "no entry: reference"


@pytest.mark.parametrize("tuned, requested, median, eager, serves", [
    ("fp32", "bf16", 11.30, 11.53, False),   # gemm_bn 16384 train on an H100: bf16's reference is ~5x faster
    ("fp32", "bf16", 0.0507, 5.6016, True),  # 51: the algebra removed the GEMM, 110x its eager
    ("tf32", "bf16", 1.6321, 1.9935, True),  # gemm_bn 16384 train tf32: bf16's reference gains nothing
    ("fp32", "tf32", 2.6867, 2.7305, False),
    ("ieee", "tf32", 2.6867, 2.7305, False),
    ("ieee", "fp32", 2.6867, 2.7305, True),  # the same reference
])
def test_on_cuda_a_stricter_entry_serves_only_where_it_beats_the_looser_reference(tuned, requested, median, eager, serves):
    from autofuse.serve.dispatch import slower_than_reference

    entry = {"variant": "v", "median_ms": median, "eager_ms": eager}
    assert (slower_than_reference(entry, tuned, requested, "cuda") is None) == serves
    assert slower_than_reference(entry, tuned, requested, "cpu") is None  # no tensor cores: nothing gains


def test_a_passed_over_stricter_entry_is_said_only_where_it_would_have_ranked_before_the_one_serving():
    from autofuse.serve.dispatch import candidates, passed_over_before
    from autofuse.serve.table import DispatchKey, shape_key

    shape = {"batch_size": 1024, "in_features": 8192, "out_features": 8192}
    slow_fp32 = {"variant": "triton", "median_ms": 2.0, "eager_ms": 2.7}  # 1.35x: loses to tf32's reference
    tf32 = {"variant": "cublas_epilogue", "median_ms": 0.35, "eager_ms": 0.40}
    keys = {p: DispatchKey("float32", p, "any", autograd=False) for p in ("fp32", "tf32")}
    both = {shape_key(shape): {keys["fp32"].to_str(): slow_fp32, keys["tf32"].to_str(): tf32}}
    found, passed_over = candidates(both, shape, keys["tf32"], "batch_size", "cuda")
    assert [f.entry for f in found] == [tf32] and len(passed_over) == 1
    assert passed_over_before(passed_over, 0) == []  # the tf32 entry serves: nothing to explain
    assert passed_over_before(passed_over, None) == [passed_over[0][1]]  # nothing served: say it
    only_fp32 = {shape_key(shape): {keys["fp32"].to_str(): slow_fp32}}
    found, passed_over = candidates(only_fp32, shape, keys["tf32"], "batch_size", "cuda")
    assert found == [] and "reference at tf32 is expected to be faster" in passed_over_before(passed_over, None)[0]


# -- the call key: grad need without walking the parameters (issues 12.5, 13.4) ----------

def test_inference_mode_and_no_grad_take_the_no_grad_entry():
    record("matmul_gelu_softmax", B, IN, OUT, autograd=False, median_ms=1.0)
    record("matmul_gelu_softmax", B, IN, OUT, autograd=True, median_ms=2.0)
    module, x = module_for("matmul_gelu_softmax").eval(), torch.randn(B, IN)
    with torch.inference_mode():
        assert module.dispatch_info(x)["entry"]["median_ms"] == 1.0
        assert not module(x).requires_grad
    with torch.no_grad():
        assert module.dispatch_info(x)["entry"]["median_ms"] == 1.0
    # Grad mode on, parameters requiring grad, nothing downstream differentiating: indistinguishable
    # from training, so the autograd entry serves (docs/autograd.md).
    assert module.dispatch_info(x)["entry"]["median_ms"] == 2.0
    assert module(x).requires_grad


def test_the_call_key_does_not_walk_the_parameters(monkeypatch):
    record("matmul_gelu_softmax", B, IN, OUT, autograd=True)
    module, x = module_for("matmul_gelu_softmax"), torch.randn(B, IN)
    want = module(x)

    def walked(*args, **kwargs):
        raise AssertionError("the parameters were walked on the hot path")
    monkeypatch.setattr(torch.nn.Module, "parameters", walked)
    monkeypatch.setattr(torch.nn.Module, "named_parameters", walked)
    for _ in range(3):
        assert_close(module(x), want, atol=0, rtol=0)


def test_every_call_key_is_a_call_key_with_named_parts():
    # One key type wherever a call key travels (issue 31): the hot path's, dispatch_info's and
    # the grad-mode call's no-grad key. A plain tuple compares equal, so the type is checked.
    module, x = module_for("gemm_bn"), torch.randn(B, IN)
    module(x)
    with torch.no_grad():
        module(x)
    key = module._autofuse.call_key(module, x)
    assert type(key) is CallKey and key == CallKey(x.shape, torch.float32, x.device, autograd=True, training=True)
    assert set(module._autofuse.ready) == set(module._autofuse.info) == {key, key._replace(autograd=False)}
    assert all(type(k) is CallKey for k in [*module._autofuse.ready, *module._autofuse.info])
    module.eval()
    with torch.no_grad():
        assert module._autofuse.call_key(module, x) == key._replace(autograd=False, training=False)
    assert module._autofuse.call_key(module, [1.0]) is None  # not a tensor: never matches


def test_what_changes_the_grad_need_between_calls_is_seen():
    record("matmul_gelu_softmax", B, IN, OUT, autograd=False, median_ms=1.0)
    record("matmul_gelu_softmax", B, IN, OUT, autograd=True, median_ms=2.0)
    module, x = module_for("matmul_gelu_softmax"), torch.randn(B, IN)
    marker = lambda: module.dispatch_info(x)["entry"]["median_ms"]  # noqa: E731
    assert marker() == 2.0 and module(x).requires_grad
    module.requires_grad_(False)
    assert marker() == 1.0 and not module(x).requires_grad
    module.linear.weight = torch.nn.Parameter(torch.randn(OUT, IN))  # a new parameter, requiring grad
    assert marker() == 2.0 and module(x).requires_grad
    module.linear.weight.requires_grad = False
    assert marker() == 1.0
    module.linear = torch.nn.Linear(IN, OUT)  # a new submodule
    assert marker() == 2.0 and module(x).requires_grad
    module.requires_grad_(False)
    old = module.linear.weight
    module.load_state_dict({k: v.clone() for k, v in module.state_dict().items()}, assign=True)  # new Parameters
    assert marker() == 1.0 and module.linear.weight is not old
    module.linear.weight.requires_grad_()  # the new one: the cached tuple was taken again
    assert marker() == 2.0
    module.requires_grad_(False)
    module.requires_grad_(False).to(torch.float32)
    assert marker() == 1.0 and not module(x).requires_grad
    x.requires_grad_()
    assert marker() == 2.0 and module(x).requires_grad


def test_a_deep_copy_dispatches_on_its_own():
    record("matmul_gelu_softmax", B, IN, OUT, autograd=True)
    module, x = module_for("matmul_gelu_softmax"), torch.randn(B, IN)
    want = module(x)
    twin = copy.deepcopy(module)
    assert twin._autofuse is not module._autofuse and not twin._autofuse.ready
    assert_close(twin(x), want, atol=0, rtol=0)
    assert twin.dispatch_info(x)["source"] == "tuned"
    twin.requires_grad_(False)  # its own parameters: the original still needs grad
    assert not twin(x).requires_grad and module(x).requires_grad


@pytest.mark.skipif(__import__("autofuse.kernels.triton.variant").kernels.triton.variant.triton_missing() is not None,
                    reason="needs triton")
@pytest.mark.parametrize("operands, served", [("round_host", False), ("split_host", True)])
def test_a_tf32_product_entry_serves_only_the_shape_it_was_gated_at(monkeypatch, caplog, operands, served):
    """TF32 products passed the gate at the default shapes and failed it at batch 1 (H100): the
    nearest-batch fallback must not carry such an entry to a batch nobody gated it at. (The
    3xTF32 split serves fp32 and is float32-accurate everywhere it was measured.)"""
    from autofuse.kernels.triton import variant as triton_variant

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the triton kind is admitted on the CPU; nothing runs here
    params = next(c for c in triton_variant.gemm_configs(IN, "cpu") if c["operands"] == operands)
    precision = triton_variant.OPERANDS[operands][0]
    record("matmul_gelu_softmax", 2 * B, IN, OUT, variant="triton", precision=precision, params=params)
    module = module_for("matmul_gelu_softmax", precision=precision)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="autofuse"):
        info = module.dispatch_info(torch.randn(B, IN))
    assert (info["variant"] == "triton") == served, info
    if not served:
        assert operands in caplog.text and info["source"] == "unusable entry: reference", caplog.text


@pytest.mark.skipif(__import__("autofuse.kernels.triton.variant").kernels.triton.variant.triton_missing() is not None,
                    reason="needs triton")
def test_x_left_to_the_tensor_cores_serves_its_gated_shape_and_the_host_split_elsewhere(monkeypatch):
    """split_trunc failed the fp32 gate at a shape where split_host passed (H100): an entry tuned
    with it runs it at its own shape and the same tiles with split_host at a neighbouring batch."""
    from autofuse.kernels.triton import variant as triton_variant

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the triton kind is admitted on the CPU; nothing runs here
    params = next(c for c in triton_variant.gemm_configs(IN, "cpu") if c["operands"] == "split_trunc")
    record("matmul_gelu_softmax", 2 * B, IN, OUT, variant="triton", precision="fp32", params=params)
    module = module_for("matmul_gelu_softmax")
    with torch.no_grad():
        gated, elsewhere = module.dispatch_info(torch.randn(2 * B, IN)), module.dispatch_info(torch.randn(B, IN))
    assert gated["variant"] == elsewhere["variant"] == "triton", (gated, elsewhere)
    assert gated["params"] == params and gated["source"] == "tuned"
    assert elsewhere["params"] == {**params, "operands": "split_host"}, elsewhere
