"""The room as the submit-time hint and the dashboard's totals read it."""
from __future__ import annotations

import threading
import time

from .records import host_of, memory, online


class RecentClients:
    """Each room's GPU clients for the submit-time ``unschedulable`` hint: from the placement view
    (``views``, ``roomview.py``: current, and read in proportion to what changed); without one,
    as read at most ``ttl`` seconds ago (per server process), so that a room of thousands of
    clients that takes many submits a second is read once a ``ttl``, not once a submit (a hint
    that refuses the job, ``fail_if_unschedulable``, reads the store itself)."""

    def __init__(self, store, ttl: float = 5.0, views=None):
        self.store, self.ttl, self.views = store, ttl, views
        self._held: dict[str, tuple[float, list[dict]]] = {}
        self._lock = threading.Lock()

    def of(self, room_id: str, fresh: bool = False) -> list[dict]:
        if self.views is not None:
            return list(self.views.of(room_id).values())
        now = time.monotonic()
        with self._lock:
            held = self._held.get(room_id)
        if fresh or held is None or held[0] < now - self.ttl:
            held = (now, self.store.list_clients(room_id))
            with self._lock:
                if len(self._held) > 10_000:  # rooms without end: forget, do not grow
                    self._held.clear()
                self._held[room_id] = held
        return held[1]

    @property
    def kept(self):
        """The records of the documents ``of`` returns, when they are the room view's (else None)."""
        return getattr(self.views, "kept", None)

    def forget(self, room_id: str) -> None:
        """A client of the room registered or left through this process: the next hint reads anew."""
        with self._lock:
            self._held.pop(room_id, None)


def room_totals(clients: list[dict]) -> dict:
    """What the room's online GPU clients offer: slots, busy slots, memory total and free, the
    RAM of CPU slots counted once per host."""
    slots = busy = total = free = 0
    cpu_ram: dict[str, tuple[int, int]] = {}
    for client in clients:
        if not online(client):
            continue
        for slot in client["slots"]:
            slots += 1
            busy += 1 if slot.get("job_id") else 0
            slot_total, slot_free = memory(slot), memory(slot, "memory_free")
            if slot.get("kind") == "cpu":  # one host's RAM, whichever of its GPU clients reports it
                t, f = cpu_ram.get(host_of(client), (slot_total, slot_free))
                cpu_ram[host_of(client)] = (max(t, slot_total), min(f, slot_free))
            else:
                total += slot_total
                free += slot_free
    for t, f in cpu_ram.values():
        total += t
        free += f
    return {"clients_online": sum(1 for c in clients if online(c)), "slots": slots, "slots_busy": busy,
            "memory_total": total, "memory_free": free, "hosts": len({host_of(c) for c in clients if online(c)})}
