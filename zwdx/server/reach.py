"""Which GPU clients of a room cannot reach each other, as their DDP/FSDP jobs found out.

DDP and FSDP need every GPU client of a job to open TCP to rank 0's (the rendezvous) and to
the others' (gloo and NCCL connect every pair). Before its ranks start, each GPU client of such
a job connects to every other's reachability port (``JobAssign.peers``, ``gpu_client/agent/reach.py``);
one that cannot says so at once (``Unreachable``), instead of its ranks waiting out the
collective timeout. Then:

- the job is placed again, once, without the pair (``jobs.interrupt``: it resumes, as
  after a lost GPU client) when the room has GPU clients enough that reach each other; else
  it fails at once, naming the pair(s) (client ids and hosts) and what the connection said,
  and suggesting ``parallelism="DILOCO"`` (which syncs through the server and needs no
  connection between GPU clients);
- the pair is remembered on both clients' records (``unreachable``: the peer's id and until
  when, ``UNREACHABLE_TTL`` seconds), and the scheduler places DDP/FSDP jobs only among clients no
  pair of which is remembered (``placement.apart``); DILOCO jobs go anywhere.

A GPU client speaks only for itself, of a job of its room that it and the peers it names are
placed on, at the job's current attempt.

Where a rank in a container may connect: ``addresses.py``.
"""
from __future__ import annotations

import logging
import time

from ..protocol import ACTIVE, JobStatus
from ..protocol.gpu import Ack, Unreachable
from . import jobs, notify
from .placement import meets_over_tcp, plan, room_slots

log = logging.getLogger(__name__)


def _who(client: dict | None, client_id: str) -> str:
    host = (client or {}).get("hostname") or "?"
    return f"{client_id} (host {host})"


def remember(ctx, a: str, b: str, ttl: float, now: float | None = None) -> None:
    """Note on both clients' records that ``a`` and ``b`` could not reach each other, until
    ``now + ttl`` (entries past their time are dropped as it writes). A list of
    ``{"client_id", "until"}``, not a mapping: a client id may hold a dot, which MongoDB reads
    as a path in a key."""
    now = time.time() if now is None else now
    for one, other in ((a, b), (b, a)):
        client = ctx.store.get_client(one)
        if client is None:
            continue
        keep = [e for e in client.get("unreachable") or [] if isinstance(e, dict)
                and e.get("client_id") != other and isinstance(e.get("until"), (int, float)) and e["until"] > now]
        ctx.store.update_client(one, {"unreachable": [*keep, {"client_id": other, "until": now + ttl}]})


def message(reporter: dict | None, reporter_id: str, peers: dict[str, tuple[dict | None, str]], parallelism: str) -> str:
    """Why the job failed: the pairs, what each connection said, and what to do."""
    pairs = "; ".join(f"gpu clients {_who(reporter, reporter_id)} and {_who(peer, peer_id)} cannot reach each "
                      f"other ({reporter_id} -> {peer_id}: {error})" for peer_id, (peer, error) in peers.items())
    return (f"{pairs}. {parallelism} needs every GPU client of a job to open TCP to the others; submit with "
            f"parallelism=\"DILOCO\", which syncs through the server and needs no connection between GPU clients "
            f"(the scheduler keeps these GPU clients apart for DDP and FSDP jobs from now on)")


def reported(ctx, room_id: str, client_id: str, report: Unreachable) -> Ack:
    """A GPU client of a job could not reach these peers of it: remember the pairs and fail the job."""
    job = ctx.store.get_job(report.job_id)
    if job is None or job.room_id != room_id:
        return Ack(ok=False, error="no such job in this room")
    placed = {p.client_id for p in job.placement or []}
    if client_id not in placed:
        return Ack(ok=False, error=f"job {job.id} has no rank on this gpu client")
    strangers = sorted(set(report.peers) - placed - {client_id})
    if strangers or client_id in report.peers:
        return Ack(ok=False, error=f"gpu client(s) {', '.join(strangers or [client_id])} are no peers of this gpu "
                                   f"client in job {job.id}")
    if not meets_over_tcp({"parallelism": job.spec.parallelism.value}):
        return Ack(ok=False, error=f"job {job.id} is {job.spec.parallelism.value}: its GPU clients need not reach "
                                   f"each other")
    if report.attempt != job.attempt or job.status not in ACTIVE:
        return Ack(ok=True)  # an attempt that ended already: nothing to stop
    ttl = ctx.settings.unreachable_ttl
    for peer_id in report.peers:
        remember(ctx, client_id, peer_id, ttl)
    reporter = ctx.store.get_client(client_id)
    why = message(reporter, client_id, {p: (ctx.store.get_client(p), e) for p, e in report.peers.items()},
                  job.spec.parallelism.value)
    log.warning("job %s: gpu-client %s cannot reach %s", job.id, client_id, ", ".join(report.peers))
    if _placeable_apart(ctx, job):
        jobs.interrupt(ctx, job.id, f"{why}; placing the job again without the pair")
    else:
        jobs.fail(ctx, job.id, why)
    notify.clients_changed(ctx, room_id)
    return Ack(ok=True)


def _placeable_apart(ctx, job) -> bool:
    """Whether the job could go on GPU clients that reach each other, its own slots counted free,
    and it was not placed again for this once already."""
    if any("cannot reach each other" in entry.reason for entry in job.restart_history):
        return False
    clients = {c["id"]: c for c in ctx.store.list_clients(job.room_id)}
    slots = [{**s, "job_id": None} if s.get("job_id") == job.id else s for s in room_slots(clients)]
    asked = {"spec": job.spec.model_dump(mode="json"), "status": JobStatus.QUEUED.value, "world_size": None}
    if job.restarts:  # a job that resumed before goes on at the size it ran at
        asked = {**asked, "status": JobStatus.RESUMING.value, "world_size": job.world_size}
    chosen, _ = plan(asked, slots, clients)
    return chosen is not None
