"""The in-memory rate limits' sweep (zwdx/server/limits.py ``PurgedMemoryStorage``): expired windows
are dropped every ``PURGE_INTERVAL`` seconds, not 10 ms after each hit as the ``limits`` library's
memory storage does (a sweep walks every key: one per rank of each job posting events), and a late
sweep changes no answer. Fast lane, in process."""
from __future__ import annotations

import time

from limits import parse
from limits.strategies import MovingWindowRateLimiter

from zwdx.server import limits
from zwdx.server.limits import PurgedMemoryStorage, RateLimits


def test_memory_rate_limits_sweep_once_an_interval_under_a_stream_of_hits(monkeypatch):
    monkeypatch.setattr(limits, "PURGE_INTERVAL", 0.5)
    sweeps = []
    sweep = PurgedMemoryStorage._MemoryStorage__expire_events
    monkeypatch.setattr(PurgedMemoryStorage, "_MemoryStorage__expire_events",
                        lambda self: (sweeps.append(time.monotonic()), sweep(self)))
    storage = RateLimits("memory://").window.storage
    assert isinstance(storage, PurgedMemoryStorage)
    window = MovingWindowRateLimiter(storage)
    ended = time.monotonic() + 0.3
    while time.monotonic() < ended:  # a hit every 2 ms, as many ranks posting would
        window.hit(parse("1000/second"), "events", "j1:0")
        time.sleep(0.002)
    # the storage's first timer (10 ms, armed at its start) and at most one of PURGE_INTERVAL;
    # the library's own storage sweeps some 30 times in 0.3 s
    assert len(sweeps) <= 2, sweeps


def test_a_late_sweep_changes_no_answer_and_an_interval_drops_the_expired(monkeypatch):
    monkeypatch.setattr(limits, "PURGE_INTERVAL", 0.3)
    storage = PurgedMemoryStorage()
    window = MovingWindowRateLimiter(storage)
    rate = parse("2/second")
    assert [window.hit(rate, "events", "j1:0") for _ in range(3)] == [True, True, False]
    time.sleep(1.05)  # the window passed; its entries may still be held
    assert window.hit(rate, "events", "j1:0") and window.hit(rate, "events", "j1:0")
    assert not window.hit(rate, "events", "j1:0")
    time.sleep(1.05)
    assert window.hit(rate, "events", "j1:0")  # arms a sweep, which drops the two expired entries
    time.sleep(0.3 + 0.2)
    assert [len(entries) for entries in storage.events.values()] == [1]
    assert window.hit(rate, "events", "j2:0")  # another key
    time.sleep(1.05 + 0.3)
    assert window.hit(rate, "events", "j3:0")  # arms a sweep: the keys whose windows passed go
    time.sleep(0.3 + 0.2)
    assert list(storage.events) == ["LIMITER/events/j3:0/2/1/second"]
