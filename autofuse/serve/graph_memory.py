"""The device memory CUDA graphs may hold, per device: ``AUTOFUSE_CUDA_GRAPH_MEMORY`` MiB.

Each graph keeps a memory pool of its own (the call's output and scratch) and its input for as
long as it lives, and a caller whose batch varies gets one graph per batch size it sends. Up to
``graphs.MAX_BATCH`` (256) rows that adds up: 24-56 MiB a graph at 128-255 rows (H200), 5.3 GiB
for 22 under bf16 at every batch from 1 to 256. So every graph of the process is accounted here,
per device, against ``budget()`` (``AUTOFUSE_CUDA_GRAPH_MEMORY`` MiB; default ``DEFAULT_MIB``):

- a key is captured only if its graph fits (``Ledger.room``: its size when it was captured
  before, else the largest graph held), after dropping its device's stale graphs (none of whose
  calls came in the last ``STALE_CALLS`` × graphs-held calls) if that makes room; otherwise
  it runs plain and asks again after ``idle_calls`` calls. So a full ledger keeps the graphs its
  caller replays, and the other sizes run plain, without captures that only drop each other;
- a capture that still goes past the budget (a graph larger than the one it was taken for)
  drops the least recently replayed graphs until it fits; a dropped key is captured again after
  ``warm_calls(times dropped)`` calls, 4x more each time;
- a graph larger than the whole budget is never kept.

A dropped graph's pool goes back to PyTorch's caching allocator, which frees it to the driver at
``torch.cuda.empty_cache()`` or when an allocation would otherwise fail.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from typing import NamedTuple

import torch

from autofuse.errors import InputError

DEFAULT_MIB = 2048
MIB = 2**20
# A graph none of whose key's calls came in the last STALE_CALLS × (graphs held) calls of the
# device's graphed keys (replayed, warming or refused) is stale: a capture that would not fit
# otherwise drops it. Counted in calls, not replays: a caller that moved on to other batch sizes
# replays nothing, and its old graphs must still go stale.
STALE_CALLS = 64


def budget() -> int:
    """Bytes the graphs of one device may hold: ``AUTOFUSE_CUDA_GRAPH_MEMORY`` MiB, else ``DEFAULT_MIB``."""
    said = os.environ.get("AUTOFUSE_CUDA_GRAPH_MEMORY", "").strip()
    if not said:
        return DEFAULT_MIB * MIB
    try:
        mib = float(said)
    except ValueError:
        mib = -1.0
    if not mib >= 0:
        raise InputError(f"AUTOFUSE_CUDA_GRAPH_MEMORY is MiB of device memory (a number ≥ 0), got {said!r}; "
                         f"AUTOFUSE_CUDA_GRAPHS=0 turns graphs off")
    return int(min(mib * MIB, float(2**62)))  # "inf": no limit


def idle_calls(refusals: int) -> int:
    """Plain calls a key makes, without reading the model or asking the ledger, after the ledger had
    no room for its graph ``refusals`` times in a row: 16, 64, 256, then 1,024 at most. A refused
    key's calls then cost what the variant's do: counting the calls towards a capture (the model's
    state read at each) took a plain call from 190 to 245 µs (H200, 22 under bf16, batches 1-256)."""
    return 16 * 4 ** min(refusals, 3)


def warm_calls(drops: int, base: int) -> int:
    """Calls with a steady model state before a capture: ``base``, 4x more for each time the key's
    graph was dropped (a key that keeps being dropped pays a capture ever more rarely)."""
    return base * 4 ** min(drops, 8)


def graph_bytes(graph, static_x: torch.Tensor) -> int:
    """What ``graph`` holds: the segments of its private pool, and its input (allocated outside it)."""
    pool = tuple(graph.pool())
    held = sum(segment["total_size"] for segment in torch.cuda.memory_snapshot()
               if tuple(segment.get("segment_pool_id", ())) == pool)
    return held + static_x.untyped_storage().nbytes()


class _Held(NamedTuple):
    ref: weakref.ref  # the holder (a GraphedCall)
    device: object
    nbytes: int
    last: int  # its device's call count (``Ledger.tick``) at its last replay


class Ledger:
    """Every live graph's device, bytes and last replay, least recently replayed first. Holders
    are weakly held: a graph dropped with its module leaves the ledger with it.

    A full ledger keeps its graphs: a key is captured only where its graph fits (``room``), its
    device's stale graphs dropped to make room, so a caller whose batch sizes outnumber the
    budget keeps the graphs it has and runs the rest plain, rather than capturing and dropping in
    turn (H200, 22 under bf16, 4,000 calls at batches 1-256 drawn at random: a capture costs a few
    plain calls, and dropping the least recently replayed to make room for each new key took the
    median call from 201 µs, all plain, to 234, p90 2.3 ms)."""

    def __init__(self):
        # Re-entrant: a holder collected inside a locked section (the garbage collector runs where
        # it likes) forgets itself through its weak reference's callback on the same thread.
        self._lock = threading.RLock()
        self._held: OrderedDict[int, _Held] = OrderedDict()
        self._calls: dict[object, int] = {}  # per device: calls of its graphed keys (``tick``)

    def _on(self, device, but=None) -> list[_Held]:
        """The graphs held on ``device``, least recently replayed first, ``but`` the holder's (call under the lock)."""
        return [h for key, h in self._held.items() if h.device == device and key != id(but)]

    def held(self, device) -> int:
        with self._lock:
            return sum(h.nbytes for h in self._on(device))

    def room(self, holder, device, nbytes: int = 0) -> tuple[bool, list]:
        """Whether a graph of ``nbytes`` for ``holder`` (0: not captured yet, taken to need the
        largest held) fits on ``device``, and the holders of the stale graphs that must go for it
        to (the caller drops them; none where it fits anyway, or would not even so)."""
        limit = budget()
        with self._lock:
            mine = self._on(device, holder)
            total = sum(h.nbytes for h in mine) + (nbytes or max((h.nbytes for h in mine), default=0))
            if total <= limit:
                return True, []
            horizon = self._calls.get(device, 0) - STALE_CALLS * len(mine)
            stale = [h for h in mine if h.last < horizon]
            if total - sum(h.nbytes for h in stale) > limit:
                return False, []
            return True, [found for h in stale if (found := h.ref()) is not None]

    def add(self, holder, device, nbytes: int) -> list:
        """Account ``holder``'s new graph; the holders whose graphs must go for it to fit, least
        recently replayed first (the caller drops them). ``holder`` itself if it alone is over."""
        limit = budget()
        if nbytes > limit:
            return [holder]
        key = id(holder)
        with self._lock:
            ref = weakref.ref(holder, lambda _, key=key: self.forget_id(key))
            self._held[key] = _Held(ref, device, nbytes, self._calls.get(device, 0))
            self._held.move_to_end(key)
            others = self._on(device, holder)
            total = nbytes + sum(h.nbytes for h in others)
            over = []
            for h in others:
                if total <= limit:
                    break
                if (found := h.ref()) is not None:
                    over.append(found)
                    total -= h.nbytes
            return over

    def tick(self, device) -> None:
        """One call of a graphed key on ``device``, replayed or not: the clock staleness is read on.
        Unlocked: an increment lost to a race only makes graphs go stale a call later."""
        self._calls[device] = self._calls.get(device, 0) + 1

    def touch(self, holder) -> None:
        """``holder``'s graph was just replayed: the last to go."""
        with self._lock:
            held = self._held.get(id(holder))
            if held is not None:
                self._held[id(holder)] = held._replace(last=self._calls.get(held.device, 0))
                self._held.move_to_end(id(holder))

    def forget(self, holder) -> None:
        self.forget_id(id(holder))

    def forget_id(self, key: int) -> None:
        with self._lock:
            self._held.pop(key, None)


LEDGER = Ledger()
