"""Heartbeats written to the store together: a group commit.

Every heartbeat is a store write (its client's deadline and its slots' figures), and at a few
hundred a second per server process, one write each is what costs: on SQLite every write is a
turn at the file's one write lock, which several processes wait for in turn (and a process
waiting for it holds all its connections still); on MongoDB every write is a round trip.

``HeartbeatWriter.touch`` is ``store.touch_client`` for a heartbeat, answered, as before, only
once its write is done. The first heartbeat to come while no write is under way writes, after
letting the heartbeats already received join it; those that come while it writes wait, and
the next write takes all of them (``store.touch_clients``: one transaction on SQLite, three
round trips on MongoDB). Alone, a heartbeat is written at once as before; under load the
writes are as many as the store can take in turn, each for all that came meanwhile.
``GET /metrics`` counts both: ``zwdx_heartbeats_total`` and ``zwdx_heartbeat_writes_total``.
"""
from __future__ import annotations

import threading
import time

from . import meters

#: seconds a heartbeat waits for the write that took it before its client is told to retry
WAIT_LIMIT = 30.0


class _Touch:
    __slots__ = ("args", "done", "ok", "error")

    def __init__(self, args: tuple):
        self.args = args
        self.done = threading.Event()
        self.ok = False
        self.error: BaseException | None = None


class HeartbeatWriter:
    def __init__(self, store):
        self.store = store
        self._lock = threading.Lock()
        self._pending: list[_Touch] = []
        self._writing = False

    def touch(self, client_id: str, changes: dict, stats: list[dict], expect_status: str | None = None) -> bool:
        """``store.touch_client(...)``, written with the heartbeats that come meanwhile. Raises
        what the store raised for the write that took it."""
        touch = _Touch((client_id, changes, stats, expect_status))
        with self._lock:
            self._pending.append(touch)
            lead = not self._writing
            self._writing = True
        if lead:
            self._write_all()
        elif not touch.done.wait(WAIT_LIMIT):
            raise TimeoutError(f"heartbeat of {client_id}: not written within {WAIT_LIMIT:.0f} s")
        if touch.error is not None:
            raise touch.error
        return touch.ok

    def _write_all(self) -> None:
        """Write what is pending, and again what came meanwhile, until nothing is."""
        try:
            time.sleep(0)  # (gevent: patched) the connections with a heartbeat read already add theirs first
            while True:
                with self._lock:
                    batch, self._pending = self._pending, []
                    if not batch:
                        self._writing = False
                        return
                self._write(batch)
        except BaseException:  # the writer itself stopped (its greenlet killed): the others are not left waiting
            with self._lock:
                self._writing = False
                left, self._pending = self._pending, []
            for t in left:
                t.error = RuntimeError("the heartbeat write was interrupted")
                t.done.set()
            raise

    def _write(self, batch: list[_Touch]) -> None:
        try:
            refused = self.store.touch_clients([t.args for t in batch])
            for t in batch:
                t.ok = t.args[0] not in refused
        except Exception as exc:  # each heartbeat of the write answers with the store's error
            for t in batch:
                t.error = exc
        finally:
            meters.heartbeats_written(len(batch))
            for t in batch:
                t.done.set()
