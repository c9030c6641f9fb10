"""What a CUDA-graph capture in progress promises: the one stream its replays will run on.

A kernel that keeps state per stream (``autofuse.kernels.triton.host.Arrivals``: the counter its
last program to arrive resets, which launches running at once must not share) may then give the
capture that stream's state: replays there run in order with the stream's plain calls, as those
calls run in order with each other. ``autofuse.serve.graphs`` replays a graph only on the stream
its caller was on when it was captured, and says so while it captures (``replays_on``). Any other
capture (a caller's own ``torch.cuda.graph``, replayed wherever that caller likes) promises nothing.
"""

from __future__ import annotations

import contextlib
import threading

_promised = threading.local()


@contextlib.contextmanager
def replays_on(stream: int):
    """Within the block, a capture on this thread replays only on ``stream`` (a raw handle)."""
    before = getattr(_promised, "stream", None)
    _promised.stream = stream
    try:
        yield
    finally:
        _promised.stream = before


def replay_stream() -> int | None:
    """The stream a capture in progress on this thread will replay on, where one was promised."""
    return getattr(_promised, "stream", None)
