"""Which slots can take a rank of a job: small filters, each ``(need, client, slot) -> reason |
None``, and ``eligible``, which runs them for both questions placement answers: where the job
goes now (``plan``: every filter) and whether it could ever go (``unschedulable``: the standing
ones, as if every slot were idle). A slot is refused by its first filter that says why."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache

from .records import Client, Need, Slot, gib

Check = Callable[[Need, Client, Slot], "str | None"]


def avoided(need: Need, client: Client, slot: Slot) -> str | None:
    if client.id in need.avoid:
        return f"gpu client {client.id} held a placement of this job that did not start"
    return None


def image(need: Need, client: Client, slot: Slot) -> str | None:
    """A container's image runs only where its donor allows it."""
    if need.image and need.image not in slot.allowed_images:
        return f"slot {slot.id} does not run image {need.image}"
    return None


def python(need: Need, client: Client, slot: Slot) -> str | None:
    if need.python is not None and client.minor != need.python:
        return f"gpu client {client.id} runs Python {client.minor}, the bundle needs {need.python}"
    return None


def missing_modules(need: Need, client: Client) -> list[str]:
    """The job's required modules the client cannot import (none when it did not say)."""
    if not need.modules or client.modules is None:
        return []
    return list(_missing(need.modules, client.modules))


@lru_cache(maxsize=4096)  # a client's list is long and the same for each of its slots, pass after pass
def _missing(need: tuple[str, ...], modules: str) -> tuple[str, ...]:
    have = set(modules.split())
    return tuple(m for m in need if m not in have)


def packages(need: Need, client: Client, slot: Slot) -> str | None:
    lacks = missing_modules(need, client)
    return f"gpu client {client.id} lacks package(s) {', '.join(lacks)}" if lacks else None


def memory_total(need: Need, client: Client, slot: Slot) -> str | None:
    if need.memory and slot.memory_total < need.memory:
        return f"slot {slot.id} has {gib(slot.memory_total)} in all, the job needs {gib(need.memory)}"
    return None


def busy(need: Need, client: Client, slot: Slot) -> str | None:
    if slot.job_id:
        return f"slot {slot.id} holds a rank of job {slot.job_id}"
    if need.memory and slot.memory_free < need.memory:
        return f"slot {slot.id} has {gib(slot.memory_free)} free, the job needs {gib(need.memory)}"
    return None


@dataclass(frozen=True)
class Filter:
    name: str
    check: Check
    now: bool = False  # a fact of the moment (busy slots, this job's history): plan's only


#: In the order a slot meets them (the order plan's reasons come in).
FILTERS = (Filter("avoided", avoided, now=True), Filter("image", image), Filter("python", python),
           Filter("packages", packages), Filter("memory", memory_total), Filter("busy", busy, now=True))
#: The standing ones, in the order ``unschedulable`` tells them (the first that leaves no slot is
#: the reason): an image last, so that a room on another Python says so, whatever it allows.
STANDING = tuple(f for name in ("python", "packages", "memory", "image") for f in FILTERS if f.name == name)


@dataclass
class Eligible:
    """The slots every filter let through, and the others by the filter that refused them
    (``(client, slot, reason)``), in ``FILTERS``' order. ``online``: the online GPU clients."""
    slots: list[Slot] = field(default_factory=list)
    refused: dict[str, list[tuple[Client, Slot, str]]] = field(default_factory=dict)
    online: list[Client] = field(default_factory=list)

    def clients(self, name: str) -> list[Client]:
        """The GPU clients the filter ``name`` refused slots of, once each, in order."""
        return list({c.id: c for c, _, _ in self.refused.get(name, ())}.values())


def eligible(need: Need, clients: Iterable[Client], slots: Iterable[Slot] | None = None,
             idle: bool = False) -> Eligible:
    """Run the filters over the slots of the online ``clients`` (or over ``slots``, each on its
    client: one of a client not given or offline is passed over in silence). ``idle``: only the
    standing filters, as if every slot were free and the job had no history."""
    by_id = {c.id: c for c in clients}
    out = Eligible(online=[c for c in by_id.values() if c.online])
    checks = STANDING if idle else FILTERS
    pairs = ((by_id.get(s.client_id), s) for s in slots) if slots is not None else \
        ((c, s) for c in out.online for s in c.slots)
    for client, slot in pairs:
        if client is None or not client.online:
            continue
        for f in checks:
            reason = f.check(need, client, slot)
            if reason is not None:
                out.refused.setdefault(f.name, []).append((client, slot, reason))
                break
        else:
            out.slots.append(slot)
    out.refused = {f.name: out.refused[f.name] for f in checks if f.name in out.refused}
    return out
