"""The device memory CUDA graphs may hold: past ``budget()``, the least recently replayed graphs go.

Each graph keeps a memory pool of its own (the call's output and scratch) and its input, for as
long as it lives, and a caller whose batch varies gets one graph per batch size it sends. Up to
``graphs.MAX_BATCH`` (256) rows that adds up: one graph of 99 under fp32 at 256 rows holds tens
of MiB, and a caller sending every batch size would hold gigabytes. So every graph of the process
is accounted here, per device, against ``AUTOFUSE_CUDA_GRAPH_MEMORY`` (MiB; default
``DEFAULT_MIB``): a capture that takes its device's total past it drops that device's least
recently replayed graphs until it fits. A dropped key runs plain and is captured again once its
model state has held for ``warm_calls(times dropped)`` calls (4x more after each drop), so keys
that take turns past the budget settle instead of being captured again every few calls. A
graph larger than the whole budget is never kept. A dropped graph's pool goes back to PyTorch's
caching allocator: reused by later allocations, freed to the driver by ``torch.cuda.empty_cache()``
or when an allocation would otherwise fail.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict

import torch

from autofuse.errors import InputError

DEFAULT_MIB = 2048
MIB = 2**20


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
    return int(mib * MIB)


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


class Ledger:
    """Every live graph's (device, bytes), least recently replayed first. Holders are weakly held:
    a graph dropped with its module leaves the ledger with it."""

    def __init__(self):
        # Re-entrant: a holder collected inside a locked section (the garbage collector runs where
        # it likes) forgets itself through its weak reference's callback on the same thread.
        self._lock = threading.RLock()
        self._held: OrderedDict[int, tuple[weakref.ref, object, int]] = OrderedDict()

    def held(self, device) -> int:
        with self._lock:
            return sum(nbytes for _, on, nbytes in self._held.values() if on == device)

    def add(self, holder, device, nbytes: int) -> list:
        """Account ``holder``'s new graph; the holders whose graphs must go for it to fit, least
        recently replayed first (the caller drops them). ``holder`` itself if it alone is over."""
        limit = budget()
        if nbytes > limit:
            return [holder]
        key = id(holder)
        with self._lock:
            self._held[key] = (weakref.ref(holder, lambda _, key=key: self.forget_id(key)), device, nbytes)
            total = sum(n for _, on, n in self._held.values() if on == device)
            over = []
            for other, (ref, on, n) in list(self._held.items()):
                if total <= limit:
                    break
                if other != key and on == device and (found := ref()) is not None:
                    over.append(found)
                    total -= n
            return over

    def touch(self, holder) -> None:
        """``holder``'s graph was just replayed: the last to go."""
        with self._lock:
            if id(holder) in self._held:
                self._held.move_to_end(id(holder))

    def forget(self, holder) -> None:
        self.forget_id(id(holder))

    def forget_id(self, key: int) -> None:
        with self._lock:
            self._held.pop(key, None)


LEDGER = Ledger()
