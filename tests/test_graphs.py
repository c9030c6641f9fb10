"""Small-batch calls as CUDA graphs (``autofuse.serve.graphs``): which keys qualify, what counts as
the model's state, and the plain-warm-capture-replay cycle, on the CPU with a stand-in for the
graph. The real capture runs on the GPU (tests/test_graphs_gpu.py)."""

import dataclasses
import logging

import pytest
import torch
from helpers import module_for
from torch import nn

from autofuse.core import registry
from autofuse.core.variant import EagerVariant
from autofuse.serve import graphs
from autofuse.serve.dispatch import CallKey

CUDA = torch.device("cuda", 0)


class Capturable:
    capturable = True
    name = "stub"

    def __init__(self, fn=None):
        self.fn, self.calls = fn or (lambda model, x: x * 2.0), 0

    def __call__(self, model, x):
        self.calls += 1
        return self.fn(model, x)


def test_only_small_no_grad_cuda_calls_of_capturable_variants_qualify(monkeypatch):
    stub = Capturable()
    assert graphs.graphable(stub, 1, CUDA, False, "any") and graphs.graphable(stub, graphs.MAX_BATCH, CUDA, False, "eval")
    assert not graphs.graphable(stub, graphs.MAX_BATCH + 1, CUDA, False, "any")
    assert not graphs.graphable(stub, 0, CUDA, False, "any")  # an empty batch: nothing to replay
    assert not graphs.graphable(stub, 8, CUDA, True, "any")  # the autograd entry saves for a backward
    assert not graphs.graphable(stub, 8, torch.device("cpu"), False, "any")
    assert not graphs.graphable(stub, 8, CUDA, False, "train")  # writes buffers it does not declare
    assert graphs.graphable(stub, 8, CUDA, False, "train", ("bn.running_mean",))
    assert graphs.graphable(EagerVariant("fp32"), 8, CUDA, False, "any")
    assert not graphs.graphable(type("Plugin", (), {})(), 8, CUDA, False, "any")  # says nothing: not captured
    monkeypatch.setenv("AUTOFUSE_CUDA_GRAPHS", "0")
    assert not graphs.graphable(stub, 8, CUDA, False, "any")


@pytest.mark.parametrize("problem", ["gemm_bn", "matmul_gelu_softmax", "matmul_clamp_lse_mish",
                                     "gemm_avgpool_gelu_residual"])
def test_compiled_is_not_captured_the_reference_and_the_fused_kinds_are(problem):
    kinds = {cls.kind: cls.capturable for cls in registry.variants(problem).values()}
    assert kinds.get("compiled", False) is False  # Inductor's own graphs, its guards' recompiles
    assert kinds["eager"] is True and kinds["simplified"] is True and all(kinds[k] for k in kinds if k in ("triton", "cuda", "cublas"))


def _state_probe(problem):
    module = module_for(problem).eval()
    call = graphs.GraphedCall(module._autofuse, Capturable(), "probe")
    return module, call


@pytest.mark.parametrize("change", ["in place", "data swapped", "replaced", "loaded", "buffer", "attribute"])
def test_every_change_a_forward_could_read_changes_the_state(change):
    module, call = _state_probe("gemm_bn")
    before = call._model_state(module)
    assert call._model_state(module) == before  # nothing changed, nothing seen
    weight = module.gemm.weight
    if change == "in place":
        with torch.no_grad():
            weight.add_(1.0)
    elif change == "data swapped":
        weight.data = torch.randn_like(weight)
    elif change == "replaced":
        module.gemm.weight = nn.Parameter(weight.detach().clone())
    elif change == "loaded":
        module.load_state_dict({k: v.clone() for k, v in module.state_dict().items()})
    elif change == "buffer":
        module.bn.running_var.mul_(2.0)
    else:
        module.bn.eps = 1e-3
    assert call._model_state(module) != before, change


def test_a_tuple_attribute_of_a_submodule_is_part_of_the_state():
    module, call = _state_probe("matmul_gelu_softmax")
    module.linear.window = (2, 2)  # as a plugin's pooling layer holds its kernel_size
    module.linear.held = (torch.ones(1),)  # a tuple holding a tensor is not a constant to compare
    before = call._model_state(module)
    module.linear.window = (3, 3)
    assert call._model_state(module) != before


def test_a_plain_attribute_of_the_model_itself_is_part_of_the_state():
    module, call = _state_probe("matmul_clamp_lse_mish")
    before = call._model_state(module)
    module.scale_factor = module.scale_factor * 2
    assert call._model_state(module) != before


class FakeGraph:
    """What ``torch.cuda.CUDAGraph`` does for these tests: replay reruns the captured call, reading
    and writing ``at`` (its input and output, the captured ones until a FakeRepointer moves them)."""

    def __init__(self, run, at=None):
        self.run, self.replays, self.at = run, 0, at

    def replay(self):
        self.replays += 1
        self.run()


def _fake_record(self, model, static_x, written, before):
    """``GraphedCall._record`` without CUDA: the warm-up runs the call (writing the buffers, which
    are put back as the real one does), the capture runs nothing, a replay reruns the call."""
    static_out = self.call(model, static_x)
    graphs._restore(written, before)
    graph = FakeGraph(lambda: graph.at[1].copy_(self.call(model, graph.at[0])), [static_x, static_out])
    return graph, static_out


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(graphs.GraphedCall, "_record", _fake_record)
    monkeypatch.setattr(graphs, "_stream", lambda device: 0)
    monkeypatch.setattr(graphs, "_plain_only", lambda: False)
    monkeypatch.setattr(graphs.graph_memory, "graph_bytes", lambda graph, x: x.untyped_storage().nbytes())


def test_a_key_is_captured_after_its_warm_calls_and_each_call_owns_its_output(fake_cuda):
    module, call = _state_probe("matmul_gelu_softmax")
    xs = [torch.randn(3, 5) for _ in range(6)]
    outs = [call(module, x) for x in xs]
    assert call.graph is not None and call.graph.replays == len(xs) - graphs.WARM_CALLS + 1
    for x, out in zip(xs, outs):  # a replay writes the graph's output; the caller's clone keeps its value
        assert torch.equal(out, x * 2.0)
    assert len({out.data_ptr() for out in outs}) == len(outs)


def test_a_change_of_state_runs_plain_and_captures_again_once_steady(fake_cuda):
    module, call = _state_probe("matmul_gelu_softmax")
    x = torch.randn(3, 5)
    for _ in range(graphs.WARM_CALLS + 1):
        call(module, x)
    first = call.graph
    with torch.no_grad():
        module.linear.weight.add_(1.0)
    calls = call.call.calls
    call(module, x)
    assert call.graph is None and call.call.calls == calls + 1  # dropped; this call ran plain
    for _ in range(graphs.WARM_CALLS):
        call(module, x)
    assert call.graph is not None and call.graph is not first


def test_a_model_that_changes_between_every_call_is_never_captured(fake_cuda):
    module, call = _state_probe("matmul_gelu_softmax")
    for _ in range(5):
        call(module, torch.randn(3, 5))
        with torch.no_grad():
            module.linear.bias.add_(1.0)  # an optimizer step between evaluations
    assert call.graph is None and call.failed is None


def test_a_failed_capture_leaves_the_key_plain_and_says_so_once(fake_cuda, monkeypatch, caplog):
    def failing(self, model, static_x, written, before):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs.GraphedCall, "_record", failing)
    module, call = _state_probe("matmul_gelu_softmax")
    x = torch.randn(3, 5)
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        outs = [call(module, x) for _ in range(5)]
    assert all(torch.equal(out, x * 2.0) for out in outs) and call.failed is not None and call.graph is None
    assert caplog.text.count("not replayed as a CUDA graph") == 1 and "stream is capturing" in caplog.text


class FakeRepointer:
    """``repoint.Repointer`` for a FakeGraph: ``point`` moves what its replays read and write, as
    far as it ``sees``: "x and out"; "out" (a graph that reads its input where no kernel argument
    shows it, as cuBLAS's do); "nothing" (its output is written elsewhere too)."""

    def __init__(self, graph, sees):
        self.graph, self.sees = graph, sees

    def point(self, tensors):
        x, out = tensors
        if self.sees != "nothing":
            self.graph.at[1] = out
        if self.sees == "x and out":
            self.graph.at[0] = x


def _repoint_with(monkeypatch, repointer: type, sees: str, reach=(512, 512)) -> None:
    """Graphs re-pointed by ``repointer`` (FakeRepointer or one of its kind) as far as they ``sees``;
    ``reach``: what ``repoint.segment_reach`` gives (no caching allocator here)."""
    monkeypatch.setattr(graphs.repoint.Repointer, "of", staticmethod(lambda graph, tensors: repointer(graph, sees)))
    monkeypatch.setattr(graphs.repoint, "ALIGNMENT", 1)  # the CPU allocator aligns to 64 bytes, not 256
    monkeypatch.setattr(graphs.repoint, "segment_reach", lambda t: reach)


@pytest.fixture(params=["x and out", "out", "nothing"])
def repointable(request, fake_cuda, monkeypatch):
    """Graphs that re-point as far as they see (FakeRepointer)."""
    _repoint_with(monkeypatch, FakeRepointer, request.param)
    return request.param


class WritingPast(FakeRepointer):
    """"x and out", whose replays also write the element after the output wherever its storage
    has one: a scratch that had the graph's output's addresses, re-pointed with it."""

    def point(self, tensors):
        super().point(tensors)
        graph = self.graph
        if not hasattr(graph, "plain_run"):
            graph.plain_run = graph.run
            graph.run = lambda: (graph.plain_run(), _write_past(graph.at[1]))


def _write_past(t):
    end = t.storage_offset() + t.numel()
    if t.untyped_storage().nbytes() > end * t.element_size():
        torch.as_strided(t, (1,), (1,), end).fill_(0.0)


def test_a_graph_that_writes_past_its_repointed_output_is_not_repointed(fake_cuda, monkeypatch):
    _repoint_with(monkeypatch, WritingPast, "x and out")
    module, call = _state_probe("matmul_gelu_softmax")
    xs = [torch.randn(3, 5) for _ in range(5)]
    outs = [call(module, x) for x in xs]
    assert call.graph is not None and call.failed is None and call._repoint is None  # copied in, cloned out
    assert all(torch.equal(out, x * 2.0) for out, x in zip(outs, xs))


def test_a_graph_whose_output_no_allocator_segment_holds_is_not_repointed(fake_cuda, monkeypatch):
    for reach in (None, (graphs.repoint.GUARD_LIMIT, 512)):  # not the caching allocator's; guards past the limit
        _repoint_with(monkeypatch, FakeRepointer, "x and out", reach)
        module, call = _state_probe("matmul_gelu_softmax")
        for _ in range(graphs.WARM_CALLS + 2):
            call(module, torch.randn(3, 5))
        assert call.graph is not None and call._repoint is None, reach


def test_a_repointed_replay_reads_the_callers_x_where_it_can_and_writes_a_fresh_output(repointable):
    module, call = _state_probe("matmul_gelu_softmax")
    xs = [torch.randn(3, 5) for _ in range(6)]
    outs = [call(module, x) for x in xs]
    assert all(torch.equal(out, x * 2.0) for x, out in zip(xs, outs))
    assert len({out.data_ptr() for out in outs}) == len(outs)
    # The checks: reading NaN where x should be read, or leaving the NaN-filled output unwritten.
    assert (call._repoint is not None) == (repointable != "nothing")
    assert call._reads_x == (repointable == "x and out")
    if repointable == "x and out":  # no call after the capture copied its x into the graph's input
        assert torch.equal(call._x, xs[graphs.WARM_CALLS - 1]) and call.graph.at[0] is xs[-1]
    else:
        assert torch.equal(call._x, xs[-1])
    if repointable != "nothing":
        assert call.graph.at[1] is outs[-1]


def test_graphs_in_copy_mode_are_never_repointed(repointable, monkeypatch):
    monkeypatch.setenv("AUTOFUSE_CUDA_GRAPHS", "copy")
    module, call = _state_probe("matmul_gelu_softmax")
    xs = [torch.randn(3, 5) for _ in range(4)]
    assert all(torch.equal(call(module, x), x * 2.0) for x in xs)
    assert call.graph is not None and call._repoint is None and torch.equal(call._x, xs[-1])


def test_an_x_laid_out_otherwise_is_copied_into_the_graphs_input(repointable):
    module, call = _state_probe("matmul_gelu_softmax")
    for _ in range(graphs.WARM_CALLS + 1):
        call(module, torch.randn(3, 5))
    strided = torch.randn(5, 3).t()  # the key's shape, not contiguous
    assert torch.equal(call(module, strided), strided * 2.0) and torch.equal(call._x, strided)
    if call._repoint is not None:
        assert call.graph.at[0] is call._x
    x = torch.randn(3, 5)
    assert torch.equal(call(module, x), x * 2.0)


def test_training_calls_repointed_update_the_statistics_once_each(repointable):
    module, plain, call = _training_probe()
    for i in range(5):
        x = torch.randn(6, module.gemm.in_features) * (1 + i)
        with torch.no_grad():
            assert torch.allclose(call(module, x), plain(x), rtol=1e-5, atol=1e-6)
        for mine, theirs in zip(_stats(module), _stats(plain)):  # the checks' extra updates undone
            assert torch.allclose(mine, theirs, rtol=1e-5, atol=1e-6)
    assert call.graph is not None and call._reads_x == (repointable == "x and out")


def test_under_autocast_or_functorch_a_call_runs_plain(monkeypatch):
    monkeypatch.setattr(graphs, "_stream", lambda device: 0)
    monkeypatch.setattr(graphs.GraphedCall, "_record", _fake_record)
    module, call = _state_probe("matmul_gelu_softmax")
    with monkeypatch.context() as inside:  # CUDA's autocast, which a CPU build cannot enter
        inside.setattr(torch, "is_autocast_enabled", lambda *device: not device or device == ("cuda",))
        for _ in range(4):
            call(module, torch.randn(3, 5))
    assert call.graph is None
    assert torch.func.vmap(lambda row: call(module, row[None])[0])(torch.randn(4, 5)).shape == (4, 5)
    assert call.graph is None


def test_the_dispatcher_binds_a_graph_to_a_qualifying_key_and_nothing_else():
    module = module_for("matmul_gelu_softmax")
    dispatcher, stub = module._autofuse, Capturable()
    key = CallKey(torch.Size([8, 12]), torch.float32, CUDA, False, True)
    dkey = key.dispatch_key("fp32", "any")
    bound = dispatcher._bound(key, stub, dkey, {"batch_size": 8})
    assert isinstance(bound, graphs.GraphedCall) and bound.call is stub and bound.name == "stub"
    assert dispatcher._bound(key._replace(device=torch.device("cpu")), stub, dkey, None) is stub
    assert dispatcher._bound(key._replace(shape=torch.Size([graphs.MAX_BATCH + 1, 12])), stub, dkey, None) is stub
    with torch.no_grad():  # on the CPU every call is the variant itself, as before
        module(torch.randn(8, 12))
    assert not any(isinstance(c, graphs.GraphedCall) for c in dispatcher.ready.values())


# -- training mode: a call that writes the model's buffers (BatchNorm's running statistics) --------
STATS = ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked")


def _training_probe(call=None):
    """gemm_bn in training mode, its key's GraphedCall around ``call`` (the reference by default),
    and a twin plain model that the same inputs are fed to."""
    module = module_for("gemm_bn").train()
    plain = module_for("gemm_bn").train()
    plain.load_state_dict(module.state_dict())
    updates = registry.get_problem("gemm_bn").training_updates
    assert updates == STATS
    return module, plain, graphs.GraphedCall(module._autofuse, call or EagerVariant("fp32"), "probe", updates)


def _stats(model):
    return [model.state_dict()[name].clone() for name in STATS]


def test_in_training_the_written_buffers_versions_are_not_state_but_their_addresses_and_the_rest_are():
    module, _, call = _training_probe()
    before = call._model_state(module)
    module.bn.running_mean.add_(1.0)  # what every training call does
    module.bn.num_batches_tracked.add_(1)
    assert call._model_state(module) == before
    module.bn.running_var = module.bn.running_var.clone()  # another tensor: the graph's is not it
    assert call._model_state(module) != before
    before = call._model_state(module)
    with torch.no_grad():
        module.bn.weight.mul_(2.0)  # a parameter: as in eval
    assert call._model_state(module) != before
    eval_call = graphs.GraphedCall(module._autofuse, Capturable(), "eval probe")
    before = eval_call._model_state(module)
    module.bn.running_mean.add_(1.0)
    assert eval_call._model_state(module) != before  # in eval the statistics are read: state


def test_training_calls_replayed_update_the_statistics_once_each_as_plain_calls_do(fake_cuda):
    module, plain, call = _training_probe()
    xs = [torch.randn(6, module.gemm.in_features) * (1 + i) for i in range(5)]
    with torch.no_grad():
        versions = []
        for x in xs:
            got, want = call(module, x), plain(x)
            versions.append(module.bn.running_mean._version)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
            for mine, theirs in zip(_stats(module), _stats(plain)):
                assert torch.allclose(mine, theirs, rtol=1e-5, atol=1e-6)  # one update, not three
    assert call.graph is not None and call.failed is None and call.graph.replays == len(xs) - graphs.WARM_CALLS + 1
    assert all(b > a for a, b in zip(versions, versions[1:]))  # each replay marks its writes


@pytest.mark.parametrize("failure", ["raises", "differs"])
def test_a_failed_training_capture_leaves_the_statistics_as_one_plain_call_would(fake_cuda, monkeypatch, failure, caplog):
    if failure == "raises":
        def record(self, model, static_x, written, before):
            self.call(model, static_x)  # the warm-up ran and wrote, then the capture failed
            raise RuntimeError("operation not permitted when stream is capturing")
    else:
        def record(self, model, static_x, written, before):
            graph, out = _fake_record(self, model, static_x, written, before)
            graph.run = lambda: (out.copy_(self.call(model, static_x)), model.bn.running_mean.add_(1e-3))
            return graph, out
    monkeypatch.setattr(graphs.GraphedCall, "_record", record)
    module, plain, call = _training_probe()
    x = torch.randn(6, module.gemm.in_features)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="autofuse"):
        for _ in range(graphs.WARM_CALLS + 1):
            assert torch.allclose(call(module, x), plain(x), rtol=1e-5, atol=1e-6)
            for mine, theirs in zip(_stats(module), _stats(plain)):
                assert torch.allclose(mine, theirs, rtol=1e-5, atol=1e-6)
    assert call.failed is not None and call.graph is None
    assert ("stream is capturing" if failure == "raises" else "wrote the model's buffers") in caplog.text


def test_the_dispatcher_graphs_a_training_key_only_for_a_problem_that_declares_its_writes(monkeypatch):
    module = module_for("gemm_bn").train()
    dispatcher, stub = module._autofuse, Capturable()
    key = CallKey(torch.Size([8, 12]), torch.float32, CUDA, False, True)
    bound = dispatcher._bound(key, stub, key.dispatch_key("fp32", "train"), {"batch_size": 8})
    assert isinstance(bound, graphs.GraphedCall) and bound.writes == STATS
    assert dispatcher._bound(key, stub, key.dispatch_key("fp32", "eval"), None).writes == ()
    monkeypatch.setattr(dispatcher, "problem", dataclasses.replace(dispatcher.problem, training_updates=None))
    assert dispatcher._bound(key, stub, key.dispatch_key("fp32", "train"), None) is stub


# -- the tuner times a batch the runtime replays as the runtime serves it --------------------------
def test_the_tuner_times_a_replayed_key_through_its_graph_and_others_plain(fake_cuda, monkeypatch):
    from autofuse.tuning import evaluate
    from autofuse.tuning.outcome import Job

    replayed = []
    monkeypatch.setattr(graphs, "graphable", lambda call, batch, *rest: replayed.append(batch) or batch <= graphs.MAX_BATCH)
    variant = EagerVariant("fp32")
    for batch, graphed in ((8, True), (graphs.MAX_BATCH + 1, False)):
        job = Job("matmul_gelu_softmax", {"batch_size": batch, "in_features": 24, "out_features": 16}, "cpu",
                  "float32", "fp32", "any", 0)
        state = {}
        call = evaluate._timed_call(state, job, variant, autograd=False)
        model, x = evaluate._timing_case(state, job)
        with torch.no_grad():
            want = variant(model, x)
        holder = call.__closure__ and next((c.cell_contents for c in call.__closure__
                                            if isinstance(c.cell_contents, graphs.GraphedCall)), None)
        assert (holder is not None) == graphed and torch.equal(call(), want)
        if graphed:  # warmed until captured: each timed call is a replay
            replays = holder.graph.replays
            call()
            assert holder.graph.replays == replays + 1
    assert replayed == [8, graphs.MAX_BATCH + 1]
