"""Modules pick up what a tune writes to their table, in any process, without a restart.

One daemon thread per process wakes every ``AUTOFUSE_TABLE_POLL`` seconds (default 2; 0 turns
it off) and stats each table file that a live module reads (inode, mtime, size: one ``stat`` per
table). Where one changed, each of its modules re-resolves the keys it has served against the new
table (``Dispatcher.reload``) and swaps in what changed: a provisional entry a running tune wrote,
its improvement, the final winner. The call path is untouched: it reads the same dict of ready
callables, which the thread replaces entries of under the dispatcher's lock.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref

log = logging.getLogger("autofuse")

ENV_POLL = "AUTOFUSE_TABLE_POLL"
DEFAULT_POLL_S = 2.0


def poll_seconds() -> float:
    raw = os.environ.get(ENV_POLL, "")
    try:
        return DEFAULT_POLL_S if raw.strip() == "" else max(0.0, float(raw))
    except ValueError:
        log.warning("autofuse: %s=%r is not a number of seconds; using %g", ENV_POLL, raw, DEFAULT_POLL_S)
        return DEFAULT_POLL_S


def signature(path) -> tuple | None:
    """What tells a rewritten table from the one read before (``os.replace`` gives a new inode)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class TableWatch:
    """The process's watcher: table path -> (its last signature, the dispatchers reading it)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._tables: dict[str, tuple[tuple | None, weakref.WeakSet]] = {}
        self._thread: threading.Thread | None = None

    def add(self, dispatcher) -> None:
        poll = poll_seconds()
        if poll == 0:
            return
        path = os.fspath(dispatcher.table.path)
        with self._lock:
            if path not in self._tables:
                self._tables[path] = (signature(path), weakref.WeakSet())
            self._tables[path][1].add(dispatcher)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, args=(poll,), name="autofuse-table-watch", daemon=True)
                self._thread.start()

    def check(self) -> None:
        """Reload the dispatchers of every table that changed since the last check."""
        with self._lock:
            changed = []
            for path, (seen, dispatchers) in list(self._tables.items()):
                if not dispatchers:
                    del self._tables[path]
                    continue
                now = signature(path)
                if now != seen:
                    self._tables[path] = (now, dispatchers)
                    changed.extend(dispatchers)
        for dispatcher in changed:
            try:
                dispatcher.reload()
            except Exception as exc:  # noqa: BLE001 - the thread must outlive one module's failure
                log.warning("autofuse: reloading the dispatch table %s failed: %s", dispatcher.table.path, exc)

    def _run(self, poll: float) -> None:
        stop = threading.Event()
        while not stop.wait(poll):
            self.check()


WATCH = TableWatch()
