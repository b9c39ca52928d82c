"""zwdx/server/limits.py's own memory storage (``PurgedMemoryStorage``, issue 35) and the storage
a URI chooses, in process: what mutation testing found unchecked once they were added."""
from __future__ import annotations

import time

from limits.storage import MemoryStorage
from limits.storage.memory import Entry

from zwdx.server import limits


def test_memory_uris_get_the_purged_storage_and_the_others_the_librarys():
    assert type(limits._storage("memory://")) is limits.PurgedMemoryStorage
    other = limits._storage("redis://127.0.0.1:1/0")  # made, not connected
    assert type(other).__name__ == "RedisStorage"


def test_a_hit_arms_one_daemon_sweep_a_purge_interval_away():
    storage = limits.PurgedMemoryStorage()
    storage.timer.join()  # the library's own first sweep, armed as it is made
    assert storage.acquire_entry("k", 5, 60)
    timer = storage.timer
    assert timer.is_alive() and timer.daemon and timer.interval == limits.PURGE_INTERVAL
    assert storage.acquire_entry("k", 5, 60)
    assert storage.timer is timer  # still armed: not a second one
    timer.cancel()


def test_a_hit_whose_key_a_sweep_dropped_midway_is_counted_once_as_asked(monkeypatch):
    storage, calls = limits.PurgedMemoryStorage(), []
    real = MemoryStorage.acquire_entry

    def racing(self, key, limit, expiry, amount=1):
        calls.append((key, limit, expiry, amount))
        if len(calls) == 1:
            raise KeyError(key)  # the sweep's del between the library's setdefault and its insert
        return real(self, key, limit, expiry, amount)

    monkeypatch.setattr(MemoryStorage, "acquire_entry", racing)
    assert storage.acquire_entry("k", 5, 60, 2) is True
    assert calls == [("k", 5, 60, 2), ("k", 5, 60, 2)]
    assert storage.get_moving_window("k", 5, 60)[1] == 2
    storage.timer.cancel()


def test_a_sweep_drops_the_keys_whose_windows_all_passed_and_keeps_the_others():
    storage = limits.PurgedMemoryStorage()
    now = time.time()
    storage.events.update({"passed": [Entry(60)], "empty": [], "live": [Entry(60)]})
    storage.events["passed"][0].expiry = now - 1
    storage.events["live"][0].expiry = now + 60
    for key in ("passed", "empty", "live"):
        storage.locks[key]
    storage._sweep()
    assert set(storage.events) == {"live"} and len(storage.events["live"]) == 1
    assert "passed" not in storage.locks and "empty" not in storage.locks
