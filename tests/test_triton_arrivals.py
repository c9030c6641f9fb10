"""The counters of kernels whose last program to arrive finishes the launch (``host.Arrivals``).

Two launches that may run at once must not share one: the counter is stream-ordered state. Plain
calls on one stream share their stream's counter; a call captured into a CUDA graph takes the
counter of the stream its replays are promised to (the runtime's graphs), else one of its own for
good; none left (or none made yet during a capture) is None, and the caller finishes in a launch
of its own. The CUDA side runs in tests/test_triton_gpu.py; here the capture and the
streams are stood in for.
"""

import pytest
import torch

from autofuse.core import capture
from autofuse.kernels.triton import host

CUDA = torch.device("cuda", 0)


@pytest.fixture
def on_a_fake_gpu(monkeypatch):
    """Arrivals on "cuda:0" with the buffer a CPU tensor, the current stream and whether it
    captures set by the test."""
    state = {"stream": 7, "capturing": False}
    monkeypatch.setattr(host, "_raw_stream", lambda device: state["stream"])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, device=None, **k: real_zeros(*a, **k))
    return state


def test_a_plain_call_gets_a_zeroed_counter_and_its_stream_keeps_it():
    arrivals = host.Arrivals()
    cpu = torch.device("cpu")
    first = arrivals.counter(cpu)
    assert first is arrivals.counter(cpu)
    assert first.dtype == torch.int32 and first.shape == (1,) and int(first) == 0


def test_streams_and_captures_take_counters_16_bytes_apart_and_a_capture_never_shares(on_a_fake_gpu):
    arrivals = host.Arrivals()
    plain = arrivals.counter(CUDA)
    on_a_fake_gpu["stream"] = 9
    other = arrivals.counter(CUDA)
    on_a_fake_gpu["capturing"] = True
    graphs = [arrivals.counter(CUDA) for _ in range(2)]
    on_a_fake_gpu["capturing"] = False
    assert arrivals.counter(CUDA) is other
    on_a_fake_gpu["stream"] = 7
    assert arrivals.counter(CUDA) is plain
    pointers = [t.data_ptr() for t in (plain, other, *graphs)]
    assert len(set(pointers)) == 4 and all((p - pointers[0]) % 16 == 0 for p in pointers)


def test_a_capture_before_any_plain_call_and_a_full_buffer_give_none(on_a_fake_gpu, monkeypatch):
    arrivals = host.Arrivals()
    on_a_fake_gpu["capturing"] = True
    assert arrivals.counter(CUDA) is None  # no zeroed buffer may be made inside a capture
    on_a_fake_gpu["capturing"] = False
    arrivals.counter(CUDA)
    monkeypatch.setattr(host.Arrivals, "SLOTS", 3)
    on_a_fake_gpu["capturing"] = True
    assert arrivals.counter(CUDA) is not None and arrivals.counter(CUDA) is not None
    assert arrivals.counter(CUDA) is None
    on_a_fake_gpu["capturing"] = False
    assert arrivals.counter(CUDA) is not None  # its stream's counter, given before


def test_a_capture_promised_to_a_stream_shares_its_counter_and_takes_none_of_its_own(on_a_fake_gpu):
    """The runtime recaptures a key after each change of the model's state: 300 captures, all
    replayed on stream 7, leave the buffer's other counters free (each took one before)."""
    arrivals = host.Arrivals()
    plain = arrivals.counter(CUDA)
    on_a_fake_gpu["capturing"] = True
    for _ in range(300):
        with capture.replays_on(7):
            assert arrivals.counter(CUDA) is plain
    with capture.replays_on(9):  # a stream with no plain call yet: its counter, given once
        promised = arrivals.counter(CUDA)
        assert promised is not None and promised is not plain and arrivals.counter(CUDA) is promised
    assert arrivals.counter(CUDA) is not plain  # a capture that promises nothing never shares
    on_a_fake_gpu["capturing"], on_a_fake_gpu["stream"] = False, 9
    assert arrivals.counter(CUDA) is promised
    assert arrivals._taken[CUDA] == 3


def test_two_threads_first_calls_on_two_streams_get_two_counters(on_a_fake_gpu, monkeypatch):
    """Slots are handed out under a lock: two streams given one slot would share a counter."""
    import threading
    import time

    class Slow(dict):  # widens the window between reading the next slot and taking it
        def get(self, *args):
            value = super().get(*args)
            time.sleep(0.01)
            return value

    arrivals = host.Arrivals()
    arrivals.counter(CUDA)  # the buffer exists
    arrivals._taken = Slow(arrivals._taken)
    streams = threading.local()
    monkeypatch.setattr(host, "_raw_stream", lambda device: streams.id)
    barrier, got = threading.Barrier(8), {}

    def first_call(stream):
        streams.id = stream
        barrier.wait()
        got[stream] = arrivals.counter(CUDA).data_ptr()

    threads = [threading.Thread(target=first_call, args=(100 + i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(got.values())) == 8, got
