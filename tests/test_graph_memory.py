"""The memory CUDA graphs may hold (``autofuse.serve.graph_memory``): past the budget the least
recently replayed graphs go, a dropped key is captured again only after more warm calls, a graph
larger than the budget is never kept, and the tuner's timed graphs are never dropped. On the CPU,
with test_graphs' stand-in for the graph and each graph's size set by the test."""

import gc

import pytest
import torch
from test_graphs import Capturable, _fake_record, _state_probe

from autofuse.errors import InputError
from autofuse.serve import graph_memory, graphs

MIB = graph_memory.MIB


@pytest.fixture
def sized(monkeypatch):
    """Fake capture (test_graphs), a fresh ledger, and graphs of ``sizes[id(call)]`` MiB (1 unless set)."""
    monkeypatch.setattr(graphs.GraphedCall, "_record", _fake_record)
    monkeypatch.setattr(graphs, "_stream", lambda device: 0)
    monkeypatch.setattr(graphs, "_plain_only", lambda: False)
    monkeypatch.setattr(graph_memory, "LEDGER", graph_memory.Ledger())
    sizes = {}
    monkeypatch.setattr(graphs.GraphedCall, "_account", _sized_account(sizes))
    return sizes


def _sized_account(sizes):
    real = graphs.GraphedCall._account

    def account(self, graph, static_x, device):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(graph_memory, "graph_bytes", lambda graph, x: sizes.get(id(self), 1) * MIB)
            return real(self, graph, static_x, device)
    return account


def _keys(n):
    """``n`` GraphedCalls of one module, as the dispatcher binds one per batch size."""
    module, first = _state_probe("matmul_gelu_softmax")
    return module, [first] + [graphs.GraphedCall(module._autofuse, Capturable(), f"probe {i}") for i in range(1, n)]


def _until_captured(call, module, rows=3):
    for _ in range(64):
        x = torch.randn(rows, 5)
        assert torch.equal(call(module, x), x * 2.0)
        if call.graph is not None:
            return
    raise AssertionError("never captured")


def _calls(call, module, n, rows=3):
    for _ in range(n):
        x = torch.randn(rows, 5)
        assert torch.equal(call(module, x), x * 2.0)


def _two_held(sized, monkeypatch, mib):
    """Three keys of ``mib`` MiB graphs each under a 7 MiB budget, the first two captured."""
    monkeypatch.setenv("AUTOFUSE_CUDA_GRAPH_MEMORY", "7")
    module, (a, b, c) = _keys(3)
    sized.update({id(a): mib[0], id(b): mib[1], id(c): mib[2]})
    _until_captured(a, module)
    _until_captured(b, module)
    return module, a, b, c


def test_a_full_ledger_keeps_its_graphs_and_a_new_key_runs_plain(sized, monkeypatch):
    module, a, b, c = _two_held(sized, monkeypatch, (3, 3, 3))
    for _ in range(20):  # the three take turns: a capture of c would only drop a or b
        _calls(c, module, 1)
        _calls(a, module, 1)
        _calls(b, module, 1)
    assert a.graph is not None and b.graph is not None and c.graph is None and c.failed is None
    assert a._drops == b._drops == 0 and graph_memory.LEDGER.held(torch.device("cpu")) == 6 * MIB


def test_a_stale_graph_makes_room(sized, monkeypatch):
    module, a, b, c = _two_held(sized, monkeypatch, (3, 3, 3))
    _calls(c, module, 4)
    assert c.graph is None
    _calls(a, module, graph_memory.STALE_CALLS * 2 + 1)  # b not called meanwhile: stale
    _until_captured(c, module)
    assert a.graph is not None and b.graph is None and b._drops == 1
    assert graph_memory.LEDGER.held(torch.device("cpu")) == 6 * MIB


def test_graphs_of_sizes_no_longer_sent_go_stale_and_make_room(sized, monkeypatch):
    """A caller that moved on to other batch sizes replays nothing: staleness counts every call of
    a graphed key, so the old graphs still go and the new sizes get their graphs."""
    module, a, b, c = _two_held(sized, monkeypatch, (3, 3, 3))
    _calls(c, module, 4)
    assert c.graph is None and c._idle > 0
    _calls(c, module, graph_memory.STALE_CALLS * 2 + graph_memory.idle_calls(3))  # refused, idle, asking again
    assert c.graph is not None and a.graph is None and b.graph is None  # every stale graph goes
    assert graph_memory.LEDGER.held(torch.device("cpu")) == 3 * MIB


def test_a_graph_larger_than_its_room_drops_the_least_recently_replayed(sized, monkeypatch):
    module, a, b, c = _two_held(sized, monkeypatch, (2, 2, 4))
    _calls(a, module, 1)  # b is now the least recently replayed
    _until_captured(c, module)  # taken to need 2 MiB (the largest held), it holds 4
    assert a.graph is not None and c.graph is not None and b.graph is None and b._drops == 1
    calls = b.call.calls
    _calls(b, module, 40)  # its 2 MiB do not fit beside 6: plain, and never captured only to drop another
    assert b.graph is None and b.call.calls == calls + 40 and a._drops == c._drops == 0
    assert graph_memory.LEDGER.held(torch.device("cpu")) == 6 * MIB


def test_a_graph_larger_than_the_whole_budget_is_never_kept_and_says_why(sized, monkeypatch, caplog):
    monkeypatch.setenv("AUTOFUSE_CUDA_GRAPH_MEMORY", "2")
    module, (small, large) = _keys(2)
    sized[id(large)] = 5
    _until_captured(small, module)
    for _ in range(6):
        x = torch.randn(3, 5)
        assert torch.equal(large(module, x), x * 2.0)
    assert large.graph is None and "AUTOFUSE_CUDA_GRAPH_MEMORY" in large.failed and "5 MiB" in large.failed
    assert small.graph is not None  # nothing was dropped for a graph that was not kept
    assert "not replayed as a CUDA graph" in caplog.text


def test_a_graph_in_use_is_not_dropped(sized):
    module, (a,) = _keys(1)
    _until_captured(a, module)
    with a._lock:  # a call is replaying it on another thread
        assert a.drop() is False
    assert a.graph is not None and a.drop() is True and a.graph is None and a._drops == 1


def test_a_changed_model_state_or_a_collected_key_leaves_the_ledger(sized):
    module, (a, b) = _keys(2)
    _until_captured(a, module)
    _until_captured(b, module)
    cpu = torch.device("cpu")
    assert graph_memory.LEDGER.held(cpu) == 2 * MIB
    with torch.no_grad():
        module.linear.bias.add_(1.0)
    a(module, torch.randn(3, 5))  # runs plain, its graph of the old state let go
    assert a.graph is None and graph_memory.LEDGER.held(cpu) == MIB
    del b
    gc.collect()
    assert graph_memory.LEDGER.held(cpu) == 0


def test_graphs_of_other_devices_do_not_count(sized, monkeypatch):
    monkeypatch.setenv("AUTOFUSE_CUDA_GRAPH_MEMORY", "4")
    ledger, holders = graph_memory.LEDGER, [Capturable() for _ in range(3)]
    assert ledger.add(holders[0], torch.device("cuda", 0), 3 * MIB) == []
    assert ledger.add(holders[1], torch.device("cuda", 1), 3 * MIB) == []
    assert ledger.add(holders[2], torch.device("cuda", 0), 2 * MIB) == [holders[0]]


def test_the_tuners_timed_graphs_are_not_accounted(sized, monkeypatch):
    monkeypatch.setenv("AUTOFUSE_CUDA_GRAPH_MEMORY", "0")  # any accounted graph would be over
    module, _ = _state_probe("matmul_gelu_softmax")
    timed = graphs.GraphedCall.standalone(Capturable(), module)
    _until_captured(timed, module)
    assert timed.failed is None and graph_memory.LEDGER.held(torch.device("cpu")) == 0


@pytest.mark.parametrize("said, mib", [("", graph_memory.DEFAULT_MIB), ("512", 512), (" 0.5 ", 0.5), ("0", 0),
                                       ("inf", 2**42)])
def test_the_budget_is_read_in_mib(monkeypatch, said, mib):
    monkeypatch.setenv("AUTOFUSE_CUDA_GRAPH_MEMORY", said)
    assert graph_memory.budget() == int(mib * MIB)


@pytest.mark.parametrize("said", ["-1", "lots", "nan", "2GiB"])
def test_a_budget_that_is_not_mib_is_an_error_that_says_what_it_takes(monkeypatch, said):
    monkeypatch.setenv("AUTOFUSE_CUDA_GRAPH_MEMORY", said)
    with pytest.raises(InputError, match="MiB"):
        graph_memory.budget()


def test_a_malformed_budget_fails_when_the_module_is_made(monkeypatch):
    monkeypatch.setenv("AUTOFUSE_CUDA_GRAPH_MEMORY", "2GiB")
    with pytest.raises(InputError, match="AUTOFUSE_CUDA_GRAPH_MEMORY"):
        _state_probe("gemm_bn")
    monkeypatch.setenv("AUTOFUSE_CUDA_GRAPHS", "0")  # graphs off: the budget is not read
    _state_probe("gemm_bn")


def test_each_drop_quadruples_the_warm_calls():
    assert [graph_memory.warm_calls(d, 2) for d in range(4)] == [2, 8, 32, 128]


def test_a_refused_key_runs_plain_unwatched_and_asks_again_ever_more_rarely(sized, monkeypatch):
    monkeypatch.setenv("AUTOFUSE_CUDA_GRAPH_MEMORY", "1")
    module, (a, b) = _keys(2)
    _until_captured(a, module)
    asks, room = [], graph_memory.Ledger.room
    monkeypatch.setattr(graph_memory.Ledger, "room", lambda *args: asks.append(1) or room(*args))
    read, model_state = [], graphs.GraphedCall._model_state
    monkeypatch.setattr(graphs.GraphedCall, "_model_state", lambda self, m: read.append(1) or model_state(self, m))
    _calls(b, module, graphs.WARM_CALLS)
    assert len(asks) == 1 and b._idle == graph_memory.idle_calls(0) == 16
    read.clear()
    _calls(b, module, 16)  # idle: the variant alone, no state read
    assert read == [] and len(asks) == 1
    _calls(b, module, graphs.WARM_CALLS)
    assert len(asks) == 2 and b._idle == graph_memory.idle_calls(1) == 64 and b.graph is None
    assert [graph_memory.idle_calls(r) for r in range(5)] == [16, 64, 256, 1024, 1024]
