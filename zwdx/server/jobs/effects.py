"""What must follow a job's move beyond its record, and the one place that does it.

A move (``model.Job``) writes the record; the function that made it (``lifecycle.py``,
``reports.py``, the scheduler) says in an ``Effects`` what the world must hear of it, and
``apply`` does that, always in the same order: stop the ranks of the placement, free slots,
show the job, show the room's GPU clients, wake the scheduler. Slots are freed before anyone is
told, so whoever hears of the move sees them free.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ...protocol import EV_JOB_CANCEL, GPU_NAMESPACE, ClientStatus
from ...protocol.gpu import JobCancel
from ...protocol.job import Job as JobRecord
from .. import notify
from ..extensions import socketio

log = logging.getLogger(__name__)

#: The server's context (``zwdx.server.ServerContext``: its store, settings, scheduler, ...), which
#: no server module may import (it is the factory above them all).
Ctx = Any


@dataclass(frozen=True)
class Release:
    """Free the slots ``job_id`` holds (on ``client_id`` only, when given)."""
    job_id: str
    client_id: str | None = None


@dataclass(frozen=True)
class Effects:
    """What a move asks of the world. ``stop``: the job whose placement's GPU clients are told
    to stop its ranks (the placement as it was before the move), with why; ``release``: the
    slots to free; ``show``: the job as it is now, for the dashboards and whoever waits on it;
    ``room``: the room whose GPU-client list changed (``joined_or_left`` when one came or went);
    ``kick``: wake the scheduler (``settle``: settle the failing and suspect jobs first)."""
    stop: tuple[JobRecord, JobCancel] | None = None
    release: tuple[Release, ...] = ()
    show: JobRecord | None = None
    room: str | None = None
    joined_or_left: bool = False
    kick: bool = False
    settle: bool = False


#: A move that asks nothing more.
NOTHING = Effects()


def stopping(record: JobRecord, reason: str, attempt: int | None = None) -> tuple[JobRecord, JobCancel]:
    """``Effects.stop`` for ``record``'s placement (``attempt``: only that attempt's ranks)."""
    if attempt is None:
        return record, JobCancel(job_id=record.id, reason=reason)
    return record, JobCancel(job_id=record.id, attempt=attempt, reason=reason)


def apply(ctx: Ctx, effects: Effects) -> None:
    """Do what ``effects`` asks, in order."""
    if effects.stop is not None:
        record, cancel = effects.stop
        tell_clients(ctx, record, EV_JOB_CANCEL, cancel.model_dump(mode="json"))
    for release in effects.release:
        ctx.store.release_slots(release.job_id, release.client_id)
    if effects.show is not None:
        notify.job_changed(effects.show)
    if effects.room is not None:
        notify.clients_changed(ctx, effects.room, joined_or_left=effects.joined_or_left)
    if effects.kick or effects.settle:
        ctx.scheduler.kick(settle=effects.settle)


def tell_clients(ctx: Ctx, job: JobRecord, event: str, payload: dict[str, Any], only: set[str] | None = None) -> None:
    """Send ``event`` to the job's GPU clients that are online (``only``: those of them)."""
    for client_id in {p.client_id for p in job.placement or []}:
        if only is not None and client_id not in only:
            continue
        client = ctx.store.get_client(client_id)
        if client and client.get("sid") and client.get("status") == ClientStatus.ONLINE.value:
            socketio.emit(event, payload, to=client["sid"], namespace=GPU_NAMESPACE)
