"""A job being placed, as the scheduler decides it: what it says while it waits, the
assignment each of its GPU clients gets once rank 0's client offered where the ranks meet,
and letting go of a placement the job left before any GPU client was told of it."""
from __future__ import annotations

from typing import Any

from ...protocol import EV_JOB_ASSIGN, GPU_NAMESPACE, ClientStatus, JobStatus
from ...protocol.checkpoint import resumable
from ...protocol.gpu import JobAssign, Peer, RankPlace
from ...protocol.job import Job as JobRecord
from .. import addresses
from ..extensions import socketio
from ..placement import meets_over_tcp, tp_size
from .effects import Ctx, Effects, Release, apply
from .model import Job


def wait(ctx: Ctx, record: JobRecord, reason: str) -> bool:
    """A waiting job says why it waits (a resuming one, after what); shown when that changed."""
    if record.status == JobStatus.RESUMING:
        last = record.restart_history[-1].reason if record.restart_history else None
        reason = f"resuming after: {last}; {reason}"
    return said(ctx, Job(ctx.store, record), reason)


def said(ctx: Ctx, job: Job, reason: str) -> bool:
    """``job`` waits for ``reason``, as it is (written and shown only when it changed)."""
    if not job.wait(reason):
        return False
    apply(ctx, Effects(show=job.record))
    return True


def placed(ctx: Ctx, record: JobRecord) -> None:
    """The job took its slots (placed, or a DILOCO worker joined): show it and its room's clients."""
    apply(ctx, Effects(show=record, room=record.room_id))


def let_go(ctx: Ctx, record: JobRecord) -> None:
    """Free the slots of a job that left ``starting`` before its GPU clients were told of it
    (none of them will say its ranks exited)."""
    apply(ctx, Effects(release=(Release(record.id),), room=record.room_id))


def assign(ctx: Ctx, job: JobRecord, rank_keys: dict[int, str], joining: bool = False) -> None:
    """Tell every GPU client of the job its ranks, each with its key (sent to that client
    only), and every value the ranks need decided here; ``joining``: only the ranks of
    ``rank_keys``, joining the running job."""
    groups = list(dict.fromkeys(p.client_id for p in job.placement or []))  # a script's GROUP_RANK: its place
    clients = {client_id: ctx.store.get_client(client_id) or {} for client_id in groups}
    peers = _peers(job, clients) if len(groups) > 1 else []
    for group_rank, client_id in enumerate(groups):
        client = clients[client_id]
        if not client.get("sid") or client.get("status") != ClientStatus.ONLINE.value:
            continue  # gone since it was placed: the reaper declares it lost and interrupts the job
        ranks = [RankPlace(rank=p.rank, gpu_index=p.gpu_index, kind=p.kind, key=rank_keys[p.rank],
                           shadow_of=s.of if (s := job.shadows.get(str(p.rank))) is not None else None)
                 for p in job.placement or [] if p.client_id == client_id and p.rank in rank_keys]
        if not ranks:
            continue  # joining: not this client's
        assignment = _assignment(ctx, job, ranks, (group_rank, len(groups)), peers, joining,
                                 addresses.egress_addresses(list(clients.values()), client))
        socketio.emit(EV_JOB_ASSIGN, assignment.model_dump(mode="json"), to=client["sid"], namespace=GPU_NAMESPACE)


def _peers(job: JobRecord, clients: dict[str, dict[str, Any]]) -> list[Peer]:
    """The job's GPU clients' reach addresses, for a mode whose ranks meet over TCP."""
    if not meets_over_tcp({"parallelism": job.spec.parallelism.value}):
        return []
    return [Peer(client_id=c["id"], hostname=c.get("hostname") or "", addr=c["advertise_addr"], port=c["reach_port"])
            for c in clients.values() if c.get("advertise_addr") and c.get("reach_port")]


def _assignment(ctx: Ctx, job: JobRecord, ranks: list[RankPlace], group: tuple[int, int], peers: list[Peer],
                joining: bool, egress: list[str]) -> JobAssign:
    """One GPU client's ``JobAssign``: its ranks, its place among the job's clients (``group``:
    its index, their number), and the addresses its ranks may reach (``egress``)."""
    spec, master = job.spec, job.master
    assert master is not None and job.placement is not None  # assigned once rank 0's client offered it
    return JobAssign(
        job_id=job.id, attempt=job.attempt, spec=spec, world_size=job.world_size, ranks=ranks,
        master_addr=master.addr, master_port=master.port, backend=job.backend,
        checkpoint=job.latest_checkpoint if resumable(job.latest_checkpoint, spec.parallelism) else None,
        collective_timeout=spec.training.collective_timeout or ctx.settings.collective_timeout,
        group_rank=group[0], group_world_size=group[1], peers=peers, joining=joining, addresses=egress,
        tp_size=tp_size(spec, job.placement))
