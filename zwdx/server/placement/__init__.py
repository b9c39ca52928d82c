"""Which slots of a room can run a job, and what to tell its submitter when none can.

The room's GPU clients and slots are read from the store's documents into typed records
(``records``: ``Client``, ``Slot``, and the job's asks as ``Need``). Small filters each say why
a slot cannot take a rank of the job (``filters``): its GPU client is offline; it held a
placement of this job that did not start; the slot does not run the job's container image; the
client runs another Python minor than the bundle's (a script job runs on any); it cannot import
a package the bundle refers to (a client that reported no module list is not checked); the slot
has less than ``memory_required`` in all; it is busy or short of free memory. ``eligible`` runs
them; over what they let through, set filters (``groups``) keep the CPU slots of one host
within its RAM (GPU clients that report the same ``host_id`` share it), whole groups of
``gpus_per_client`` per GPU client (a TP job's ranks are one TP group on one client; FSDP+TP's
whole groups of ``tp_size``), and, for a job whose ranks meet over TCP (all but DILOCO), GPU
clients none of which is known to be unable to reach another (``reach.py``). A job runs on
slots of one kind unless it asks for mixed devices (GPUs first, then CPU slots).

``plan`` (the scheduler, at every pass) and ``unschedulable`` (``POST /api/v1/jobs``, and the
scheduler to let a job no room could run hold back no one) share that path: ``unschedulable``
runs it over the room as if every slot were idle, so they agree (``plan.py``).
"""
from __future__ import annotations

from .filters import FILTERS, STANDING, Eligible, Filter, eligible
from .groups import tp_groups, whole_groups
from .plan import choose, free_slots, plan, room_slots, unschedulable
from .reasons import MIXED_COST, NAMED, mixed, no_clients
from .recent import RecentClients, room_totals
from .records import GiB, TP_MODES, Client, Need, Slot, gib, host_of, memory, online, python_of, tree
from . import filters as _filters, groups as _groups


def missing_modules(spec: dict, client: dict) -> list[str]:
    """The job's required modules the GPU client (a store document) cannot import (none when it did not say)."""
    return _filters.missing_modules(Need.of(spec), Client.of(client, with_slots=False))


def apart_from(client: dict, now: float) -> list[str]:
    """The GPU clients this one (a store document) is known not to reach, or not to be reached by,
    at ``now`` (its record's ``unreachable``, written by ``reach.py``)."""
    if not client.get("unreachable"):
        return []  # most clients: no record built for nothing (the dashboard asks for each, at every push)
    return Client.of(client, with_slots=False).apart_from(now)


def apart(clients: dict[str, dict], now: float) -> set[frozenset]:
    """Pairs of the room's GPU clients (store documents by id) known not to reach each other at ``now``."""
    return _groups.apart({cid: Client.of(c, with_slots=False) for cid, c in clients.items()}, now)


def meets_over_tcp(spec: dict) -> bool:
    """Whether the job's ranks open TCP to each other (all but DILOCO, which syncs through the server)."""
    return spec.get("parallelism") != "DILOCO"


def needs_python(spec: dict) -> str | None:
    """The Python minor version a job's code loads on (None: a script job, any)."""
    return Need.of(spec).python


def tp_size(spec, placement) -> int | None:
    """The resolved TP group size of a placed TP or FSDP+TP job (``JobAssign.tp_size``): the
    submitted ``tp_size``, else how many ranks the placement put on rank 0's GPU client (every
    GPU client of the job holds as many); None for the other modes."""
    if spec.parallelism.value not in TP_MODES:
        return None
    if spec.tp is not None and spec.tp.size:
        return spec.tp.size
    first = placement[0].client_id
    return sum(1 for p in placement if p.client_id == first)


__all__ = ["plan", "unschedulable", "eligible", "choose", "free_slots", "room_slots", "Eligible", "Filter", "FILTERS", "STANDING",
           "Client", "Slot", "Need", "RecentClients", "room_totals", "missing_modules", "apart", "apart_from",
           "meets_over_tcp", "needs_python", "tp_size", "tp_groups", "whole_groups", "mixed", "MIXED_COST",
           "no_clients", "NAMED", "GiB", "gib", "host_of", "memory", "online", "python_of", "tree", "TP_MODES"]
