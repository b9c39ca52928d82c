"""The filters over a set of eligible slots: the order to take them in (spread), CPU slots of
one host sharing its RAM, whole groups on each GPU client (``gpus_per_client``, TP groups), and
GPU clients that must reach each other. Each returns the slots it keeps and what it left out."""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

from ...protocol import SlotKind
from .records import Client, Need, Slot


def spread(of_kind: list[Slot], want: int | None, load: Counter) -> list[Slot]:
    """The slots in the order to take them. A job that one GPU client can hold whole goes on
    one: the one with the fewest busy slots, then the fewest free (jobs spread over the room,
    and a big client stays free for a big job, rather than the largest client drawing every
    job); a larger one fills whole GPU clients first, the largest first (fewer hosts, more
    ranks over local links)."""
    free = Counter(s.client_id for s in of_kind)

    def key(slot: Slot) -> tuple:
        c = slot.client_id
        if want and free[c] >= want:
            return 0, load[c], free[c], c, slot.index
        return 1, 0, -free[c], c, slot.index
    return sorted(of_kind, key=key)


@dataclass(frozen=True)
class Host:
    """A host's RAM as its CPU slots report it (counted once), and what the ranks there hold."""
    name: str
    free: int
    total: int
    taken: int = 0

    @property
    def room(self) -> int:
        return max(0, min(self.free, self.total - self.taken))


def hosts_ram(slots: list[Slot], clients: dict[str, Client], held: dict, idle: bool = False) -> dict[str, Host]:
    """host -> Host, over the CPU slots of ``slots`` (``held``: bytes per rank by job id).
    ``idle``: every slot free, none held."""
    free: dict[str, int] = {}
    total: dict[str, int] = {}
    taken: Counter = Counter()
    names: dict[str, str] = {}
    for slot in slots:
        client = clients.get(slot.client_id)
        if client is None or slot.kind != SlotKind.CPU:
            continue
        names.setdefault(client.host, client.hostname or client.id)
        if slot.job_id and not idle:
            taken[client.host] += int(held.get(slot.job_id) or 0)
        if client.online:  # each of its GPU clients reports the same RAM: the least free, to be safe
            slot_free = slot.memory_total if idle else slot.memory_free
            free[client.host] = min(free.get(client.host, slot_free), slot_free)
            total[client.host] = max(total.get(client.host, 0), slot.memory_total)
    return {h: Host(names[h], free[h], total[h], taken[h]) for h in free}


@dataclass(frozen=True)
class Short:
    """A host whose RAM holds fewer of the job's ranks than it has CPU slots for it."""
    name: str
    room: int
    slots: int
    fits: int


def within_host_ram(order: list[Slot], mem: int, hosts: dict[str, Host],
                    clients: dict[str, Client]) -> tuple[list[Slot], list[Short]]:
    """The CPU slots of ``order`` that fit their host's RAM, in order, and the hosts short of it."""
    fits: Counter = Counter()
    seen: Counter = Counter()
    kept = []
    for slot in order:
        host = clients[slot.client_id].host
        seen[host] += 1
        if (fits[host] + 1) * mem <= hosts[host].room:
            fits[host] += 1
            kept.append(slot)
    return kept, [Short(hosts[h].name, hosts[h].room, n, fits[h]) for h, n in seen.items() if fits[h] < n]


def whole_groups(order: list[Slot], per: int) -> tuple[list[Slot], int]:
    """Of the slots in ``order``, the first ``per`` of each GPU client that has that many, in
    order; and how many GPU clients have fewer."""
    by_client = Counter(s.client_id for s in order)
    full = {c for c, n in by_client.items() if n >= per}
    taken: Counter = Counter()
    kept = []
    for slot in order:
        if slot.client_id in full and taken[slot.client_id] < per:
            taken[slot.client_id] += 1
            kept.append(slot)
    return kept, len(by_client) - len(full)


def tp_groups(need: Need, order: list[Slot], want: int | None) -> int:
    """How many ranks of a TP or FSDP+TP job go on each GPU client (its TP group's size), from
    the slots in ``order``: ``gpus_per_client`` when the submit fixed it (TP: the world size;
    FSDP+TP: ``tp_size``); else TP's largest group of one GPU client, and FSDP+TP's largest group
    size (at least 2) that divides ``want`` and that enough GPU clients have (with no ``want``:
    the size that places the most ranks). 0: no such group."""
    if need.per:
        return need.per
    counts = Counter(s.client_id for s in order)
    if need.parallelism == "TP":
        return max(counts.values(), default=0)
    if want is None:
        sizes = [(p * sum(1 for n in counts.values() if n >= p), p) for p in set(counts.values()) if p >= 2]
        return max(sizes)[1] if sizes else 0
    fits = [p for p in range(want, 1, -1) if want % p == 0 and p * sum(1 for n in counts.values() if n >= p) >= want]
    return fits[0] if fits else min((p for p in range(2, want + 1) if want % p == 0), default=0)


def apart(clients: dict[str, Client], now: float) -> set[frozenset]:
    """Pairs of the room's GPU clients known not to reach each other at ``now``."""
    return {frozenset((cid, peer)) for cid, client in clients.items() for peer in client.apart_from(now)
            if peer != cid}


def reachable(order: list[Slot], pairs: set[frozenset], want: int | None) -> list[Slot]:
    """The slots of ``order`` on GPU clients that all reach each other: greedily from each GPU
    client in turn, the first group with ``want`` slots (or the largest one)."""
    ids = list(dict.fromkeys(s.client_id for s in order))
    best: list[Slot] = []
    for first in ids:
        group = [first]
        for other in ids:
            if other != first and all(frozenset((other, g)) not in pairs for g in group):
                group.append(other)
        kept = [s for s in order if s.client_id in group]
        if len(kept) > len(best):
            best = kept
        if want is not None and len(best) >= want:
            break
    return best


def by_kind(slots: list[Slot]) -> dict[SlotKind, list[Slot]]:
    out: dict[SlotKind, list[Slot]] = defaultdict(list)
    for slot in slots:
        if slot.kind is not None:
            out[slot.kind].append(slot)
    return out
