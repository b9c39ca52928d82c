"""Where a job goes now (``plan``) and whether the room could ever run it (``unschedulable``):
both run the same filters (``filters.eligible``) and the same choice over what they let
through (``choose``); ``unschedulable`` as if every slot were idle, so that a job it says the
room could run gets a plan on that room idle, and one it says never does not."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace

from ...protocol import SlotKind
from . import reasons
from .filters import Eligible, eligible
from .groups import apart, by_kind, hosts_ram, reachable, spread, tp_groups, whole_groups, within_host_ram
from .records import Client, Kept, Need, Slot

CUDA, CPU = SlotKind.CUDA, SlotKind.CPU


@dataclass
class Room:
    """The facts of the moment the choice reads: the slots' load by GPU client, the hosts' RAM,
    the pairs of GPU clients known apart (none for a room taken as idle)."""
    clients: dict[str, Client]
    load: Counter = field(default_factory=Counter)
    hosts: dict = field(default_factory=dict)
    pairs: set = field(default_factory=set)


@dataclass
class Choice:
    """What ``choose`` found: the slots (None: too few), the most it could give, the count of
    each kind it gave each way it tried, the shortfalls met on the way, the group size."""
    slots: list[Slot] | None = None
    want: int | None = None
    have: int = 0
    kinds: list[Counter] = field(default_factory=list)
    met: list[tuple[str, object]] = field(default_factory=list)  # ("short", Short), ("fewer", (n, per)), ("apart", pairs)
    per: int = 0


def _take(need: Need, chosen: list[Slot], want: int | None, room: Room, out: Choice) -> tuple[list[Slot], int | None]:
    """The set filters over one way of taking slots: whole groups per GPU client, reachability."""
    per = tp_groups(need, chosen, want) if need.tp and chosen else need.per
    if need.tp and per and need.parallelism == "TP":
        want = per  # one group: the job's ranks
    out.per = per or out.per
    if per and chosen:
        chosen, fewer = whole_groups(chosen, per)
        if fewer:
            out.met.append(("fewer", (fewer, per)))
    if room.pairs and chosen:
        group = reachable(chosen, room.pairs, want)
        if len(group) < len(chosen):
            among = {s.client_id for s in chosen}
            out.met.append(("apart", {p for p in room.pairs if p <= among}))
            chosen = group
    return chosen, want


def choose(need: Need, ok: list[Slot], room: Room) -> Choice:
    """The slots for the job among ``ok``, rank order grouped by GPU client: one kind at a time
    (GPUs, then CPU slots), or both together for a mixed-devices job (GPUs first)."""
    out, want, mine = Choice(), need.want, by_kind(ok)
    for kinds in ([(CUDA, CPU)] if need.mixed else [(CUDA,), (CPU,)]):
        chosen: list[Slot] = []
        for kind in kinds:
            of_kind = spread(mine.get(kind) or [], want, room.load)
            if kind == CPU and need.memory and of_kind:
                of_kind, short = within_host_ram(of_kind, need.memory, room.hosts, room.clients)
                out.met += [("short", s) for s in short]
            chosen += of_kind
        chosen, want = _take(need, chosen, want, room, out)
        out.have = max(out.have, len(chosen))
        out.kinds.append(Counter(s.kind for s in chosen))
        out.want = want
        if not chosen:
            continue
        if want is None:
            out.slots = sorted(chosen, key=lambda s: (s.client_id, s.index))
            return out
        if len(chosen) < want and need.least and len(chosen) >= need.least:
            want = out.want = len(chosen)  # whole groups of gpus_per_client still: chosen holds only those
        if len(chosen) >= want:
            out.slots = sorted(chosen[:want], key=lambda s: (s.client_id, s.index))
            return out
    return out


def _records(slots: list[dict], clients: dict, kept: Kept | None = None) -> tuple[dict[str, Client], list[Slot]]:
    """The scheduler's documents as records (its slots are ``slots``: a client's own are not read);
    those of the room view's documents from ``kept``."""
    if kept is not None:
        return {cid: kept.client(c, with_slots=False) for cid, c in clients.items()}, [kept.slot(s) for s in slots]
    return {cid: Client.of(c, with_slots=False) for cid, c in clients.items()}, [Slot.of(s) for s in slots]


def room_slots(clients: dict) -> list[dict]:
    """Every slot of the room's clients (``clients``: by id, each with its slots), held ones too,
    in placement's order: by GPU client, then index."""
    return sorted((s for c in clients.values() for s in c["slots"]), key=lambda s: (s["client_id"], s["index"]))


def free_slots(job: dict, slots: list[dict], clients: dict) -> tuple[list[dict], list[str]]:
    """Free slots that can run the job, and what keeps the others from it (``plan``'s first step)."""
    need, (records, mine) = Need.of(job["spec"], job), _records(slots, clients)
    found = eligible(need, records.values(), mine)
    return [s.doc for s in found.slots], reasons.now(found, need)


def plan(job: dict, slots: list[dict], clients: dict, held: dict | None = None,
         now: float | None = None, kept: Kept | None = None) -> tuple[list[dict] | None, str]:
    """Choose the slots for a job, rank order grouped by GPU client; or None and the reason.
    ``held``: bytes per rank of the jobs holding slots (those on CPU slots count against their
    host's RAM). ``kept``: the records of the room view's documents (``RoomViews.kept``)."""
    need = Need.of(job["spec"], job)
    records, mine = _records(slots, clients, kept)
    if not any(c.online for c in records.values()):
        return None, reasons.no_clients(clients.values())
    found = eligible(need, records.values(), mine)
    room = Room(records, Counter(s.client_id for s in mine if s.job_id), hosts_ram(mine, records, held or {}),
                apart(records, time.time() if now is None else now) if need.tcp else set())
    choice = choose(need, found.slots, room)
    if choice.slots is not None:
        return [s.doc for s in choice.slots], ""
    return None, reasons.waiting(need, choice, reasons.now(found, need), records)


def unschedulable(spec: dict, clients: list[dict], kept: Kept | None = None) -> str | None:
    """Why the room as it is now could never run the job, even with every slot idle (more ranks
    than its eligible slots, more memory than any slot has, no GPU client at all, none on the
    submitter's Python, a package missing on every one, an image no slot runs); None when it
    could. Jobs wait anyway: GPU clients may join. ``kept``: as ``plan``'s."""
    records = {c["id"]: kept.client(c) if kept is not None else Client.of(c) for c in clients}
    if not any(c.online for c in records.values()):
        return reasons.no_clients(clients)
    need = Need.of(spec)
    need = replace(need, want=need.want or 1)  # min_world_size only lets a resumed job go on with fewer ranks
    found: Eligible = eligible(need, records.values(), idle=True)
    none_left = reasons.never_eligible(found, need)
    if none_left:
        return none_left
    every = [s for c in found.online for s in c.slots]
    choice = choose(need, found.slots, Room(records, hosts=hosts_ram(every, records, {}, idle=True)))
    return None if choice.slots is not None else reasons.never(need, choice)
