"""Ranks' metric and log events written to the store in batches (a group commit), per server
process.

Every ``POST /jobs/<id>/events`` used to be a store transaction of its own; with thousands of
ranks reporting, the store's write lock (SQLite's one file) was taken once a request. Now a
request that finds no write in progress writes at once, its own events and whatever came
meanwhile; one that finds a write in progress waits for it, and the next write takes every
request that waited, in one transaction (``Store.add_event_batches``). A request is answered
only once its events are stored: nothing is held in memory that a shutdown could lose, and a
batch sent twice is still stored once (the store drops an event whose ``(rank, key)`` the job
holds). What a request waits for is bounded: at most the write in progress, then its own
(of at most ``MOST`` requests).

A write that fails is tried again request by request, so that one request's error (a job
deleted meanwhile) is that request's alone.

    EventWriter(store).add(job_id, events) -> the events stored (each with its seq)
"""
from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

#: The most requests one write takes (the rest wait for the next).
MOST = 256


class _Waiting:
    """One request's events, waiting to be written."""
    __slots__ = ("job_id", "events", "done", "stored", "error", "lead")

    def __init__(self, job_id: str, events: list[dict]):
        self.job_id, self.events = job_id, events
        self.done = threading.Event()
        self.stored: list[dict] | None = None
        self.error: BaseException | None = None
        self.lead = False  # woken to write the next batch, not because its events are stored


class EventWriter:
    """The group commit of one server process (``ServerContext.events``)."""

    def __init__(self, store):
        self.store = store
        self._lock = threading.Lock()
        self._queue: list[_Waiting] = []
        self._writing = False
        #: writes made and requests they took, for /metrics and the tests
        self.writes = self.requests = 0

    def add(self, job_id: str, events: list[dict]) -> list[dict]:
        """Store ``events`` of ``job_id`` (``Store.add_events``'s answer), together with those of
        the requests that come meanwhile."""
        mine = _Waiting(job_id, events)
        with self._lock:
            self._queue.append(mine)
            lead = not self._writing
            self._writing = True
        while not lead:
            mine.done.wait()
            if not mine.lead:
                break
            mine.done.clear()
            lead = True
        if lead:
            self._write_until(mine)
        if mine.error is not None:
            raise mine.error
        return mine.stored or []

    def _write_until(self, mine: _Waiting) -> None:
        """Write batches until ``mine`` is stored, then hand the writing on to the first request
        still waiting (or end it)."""
        while not mine.done.is_set():
            with self._lock:  # far back in a long queue, its turn comes in a later batch
                batch, self._queue = self._queue[:MOST], self._queue[MOST:]
            self._write(batch)
        with self._lock:
            if self._queue:
                nxt = self._queue[0]
                nxt.lead = True
                nxt.done.set()
            else:
                self._writing = False

    def _write(self, batch: list[_Waiting]) -> None:
        if not batch:
            return
        try:
            stored = self.store.add_event_batches([(w.job_id, w.events) for w in batch])
        except Exception as exc:
            if len(batch) == 1:
                batch[0].error, batch[0].lead = exc, False
                batch[0].done.set()
                return
            log.warning("events: a write of %d requests failed; writing them one by one", len(batch))
            for waiting in batch:
                self._write([waiting])
            return
        self.writes += 1
        self.requests += len(batch)
        for waiting, its in zip(batch, stored):
            waiting.stored = its
            waiting.lead = False
            waiting.done.set()
