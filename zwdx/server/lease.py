"""Which server process leads: runs the scheduler's passes and the sweeper.

One process (no ``MESSAGE_QUEUE``) always leads. Several processes that share a store and a
Socket.IO message queue (``ZWDX_MESSAGE_QUEUE``, docs/deploy-scale.md) lead one at a time: the
holder of the store's lease ``scheduler`` (``Store.take_lease``, one atomic write in SQLite and
in MongoDB). Every process tries to take or renew it every third of ``SCHEDULER_LEASE_TTL``;
the holder renews it, the others find it taken. A holder that dies (SIGKILL, a lost host)
stops renewing, and another process takes it within ``SCHEDULER_LEASE_TTL`` plus one try; one
that stops cleanly gives it up, and another takes it at its next try.

A holder believes it leads only until ``SCHEDULER_LEASE_TTL`` minus one renewal interval after
it last renewed (measured on its own monotonic clock, from before the write): a holder cut off
from the store stops leading before anyone else may take over. The processes' wall clocks
(which the store's expiry is written in) must agree to well within that interval (NTP).

    Lease(store, shared, ttl)   .held()   .start(stopping)   .release()
    .on_taken: called (in the lease's thread) each time this process starts leading
    .every_try: called after every try, whoever holds it (per-process chores of a shared server)
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Callable

from .. import defaults

log = logging.getLogger(__name__)

#: The lease's name in the store.
NAME = "scheduler"


class Lease:
    """This process's part in the lease: whether it holds it, and the loop that renews it."""

    def __init__(self, store, shared: bool, ttl: float = defaults.SCHEDULER_LEASE_TTL):
        self.store = store
        self.shared = shared
        self.ttl = float(ttl)
        self.interval = self.ttl / 3
        #: who this process is in the store: host, pid and a random part (a pid is reused)
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.on_taken: list[Callable[[], None]] = []
        self.every_try: list[Callable[[], None]] = []
        self._until = 0.0  # monotonic: leads until then
        self._thread: threading.Thread | None = None

    def held(self) -> bool:
        """Whether this process leads now."""
        return not self.shared or time.monotonic() < self._until

    def start(self, stopping: threading.Event) -> None:
        """Try at once, then every ``interval`` until ``stopping`` (only when ``shared``)."""
        if not self.shared:
            return
        self.renew()
        self._thread = threading.Thread(target=self._loop, args=(stopping,), name="zwdx-lease", daemon=True)
        self._thread.start()

    def _loop(self, stopping: threading.Event) -> None:
        while not stopping.wait(self.interval):
            self.renew()

    def renew(self) -> bool:
        """Take or renew the lease once; whether this process leads after."""
        was, started = self.held(), time.monotonic()
        try:
            taken = self.store.take_lease(NAME, self.holder, self.ttl) is not None
        except Exception:  # the store is away: lead no longer than the lease lasts
            log.exception("lease: cannot renew the scheduler's lease")
            taken = False
            if was and time.monotonic() >= self._until:
                log.warning("lease: scheduler lease lapsed (store unreachable); this process stops scheduling")
        else:
            if taken:
                self._until = started + self.ttl - self.interval
            elif was:
                self._until = 0.0
                log.warning("lease: another server process took the scheduler's lease; this one stops scheduling")
        if taken and not was:
            log.info("lease: this server process (%s) now runs the scheduler and the sweeper", self.holder)
            for step in self.on_taken:
                self._call(step)
        for step in self.every_try:
            self._call(step)
        return self.held()

    @staticmethod
    def _call(step) -> None:
        try:
            step()
        except Exception:
            log.exception("lease: %s failed", getattr(step, "__name__", step))

    def release(self) -> None:
        """Give the lease up (a clean stop): another process takes it at its next try."""
        if self.shared and self.held():
            self._until = 0.0
            try:
                if self.store.release_lease(NAME, self.holder):
                    log.info("lease: this server process gave the scheduler's lease up")
            except Exception:
                log.exception("lease: cannot give the scheduler's lease up; it expires by itself")
