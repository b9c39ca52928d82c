"""Python's cyclic garbage collector, kept from stalling a busy server process.

A server process holding a thousand GPU clients keeps a few hundred thousand long-lived objects
(connections, greenlets, sessions). Python's full (generation 2) collection walks every one of
them, and runs whenever enough new objects survived: every few seconds under load, 120-180 ms
each on a 2-core machine at 800 clients. Every connection of a gevent process waits that long:
the tail of every latency.

What this does instead (``zwdx server`` only):

- ``gc.freeze()`` once started, and again within a second of each full collection: what
  survived one is moved out of the collector's sight, so the next walks only what survived
  since. Each long-lived object is walked by one full collection, not by all of them.
- Every ``THAW_INTERVAL`` s, ``gc.unfreeze()`` and one full collection of everything: cycles
  among frozen objects that became garbage since (a closed connection's) are freed then. That
  one long stall comes every few minutes instead of every few seconds.

Objects freed by reference counting (almost all of them) are freed at once either way: freezing
only hides objects from the cycle collector.
"""
from __future__ import annotations

import gc
import logging
import threading
import time

log = logging.getLogger(__name__)

#: Seconds between two full collections of everything, frozen objects included.
THAW_INTERVAL = 600.0

_collected = threading.Event()  # a full collection ended: freeze what survived it


def keep_pauses_short(stopping: threading.Event) -> None:
    """Freeze what the process has made so far, and start the loop that keeps freezing."""
    gc.collect()
    gc.freeze()
    gc.callbacks.append(_after_collection)
    threading.Thread(target=_loop, args=(stopping,), name="zwdx-gc", daemon=True).start()


def _after_collection(phase: str, info: dict) -> None:
    if phase == "stop" and info.get("generation") == 2:
        _collected.set()  # not frozen here: the collector is still at work during its callbacks


def _loop(stopping: threading.Event) -> None:
    thawed = time.monotonic()
    while not stopping.wait(1.0):
        if time.monotonic() - thawed >= THAW_INTERVAL:
            started = thawed = time.monotonic()
            gc.unfreeze()
            gc.collect()
            log.info("server: every object collected in %.0f ms", 1000 * (time.monotonic() - started))
            _collected.set()
        if _collected.is_set():
            _collected.clear()
            gc.freeze()
