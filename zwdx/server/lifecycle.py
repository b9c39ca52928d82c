"""How a job moves after it is placed, and who is told: ranks start, finish, fail; clients
vanish; users cancel.

Each function makes one move of ``job.Job`` (which writes it, once, however many servers or
threads race), then tells the GPU clients (``job_cancel``), the dashboards (``notify``) and
the scheduler (``kick``). A job completes as soon as every rank reported completion; its slots
are freed only when the GPU client says its rank processes exited (or the client is gone),
so a rank's teardown is off the user's path and still no slot runs two jobs.
"""
from __future__ import annotations

import logging
import time

from .. import defaults
from ..protocol import ACTIVE, EV_JOB_CANCEL, GPU_NAMESPACE, ClientStatus, EventKind, JobStatus, Parallelism, RankStatus
from ..protocol.gpu import JobCancel
from ..protocol.job import Job as JobRecord
from . import notify
from .extensions import socketio
from .job import NO_RENDEZVOUS, Job

log = logging.getLogger(__name__)


def tell_clients(ctx, job: JobRecord, event: str, payload: dict, only: set | None = None) -> None:
    for client_id in {p.client_id for p in job.placement or []}:
        if only is not None and client_id not in only:
            continue
        client = ctx.store.get_client(client_id)
        if client and client.get("sid") and client.get("status") == ClientStatus.ONLINE.value:
            socketio.emit(event, payload, to=client["sid"], namespace=GPU_NAMESPACE)


def _stop_ranks(ctx, job: JobRecord, reason: str) -> None:
    tell_clients(ctx, job, EV_JOB_CANCEL, JobCancel(job_id=job.id, reason=reason).model_dump(mode="json"))


def rank_started(ctx, job: JobRecord, rank: int) -> None:
    handle = Job(ctx.store, job)
    if handle.rank_running(rank, **_kept(ctx, job, rank)):
        log.info("job %s: running (world size %d, attempt %d)", job.id, handle.record.world_size,
                 handle.record.attempt)
        notify.job_changed(handle.record)


def _kept(ctx, job: JobRecord, rank: int) -> dict:
    """How the rank's slot keeps it (isolation, a container's image and limits), as its GPU client
    registered them: what the job's page shows its ranks ran under."""
    place = next((p for p in job.placement or [] if p.rank == rank), None)
    if place is None:
        return {}
    slot = next((s for s in ctx.store.list_slots(job.room_id, place.client_id) if s.get("index") == place.gpu_index),
                None) or {}
    terms = slot.get("terms")
    if terms and job.spec.resources.image:  # the job's own image, of those its donor allows
        terms = {**terms, "image": job.spec.resources.image, "image_id": ""}
    return {"isolation": slot.get("isolation"), "terms": terms}


def rank_layout(ctx, job: JobRecord, rank: int, layout) -> bool:
    """A running rank said what it holds of the model: kept on its state, and the dashboards told."""
    handle = Job(ctx.store, job)
    if not handle.rank_layout(rank, layout):
        return False
    notify.job_changed(handle.record)
    return True


def rank_completed(ctx, job: JobRecord, rank: int, fingerprint: str | None = None, results: dict | None = None,
                   final_loss: float | None = None, weights_artifact: str | None = None,
                   global_fingerprint: str | None = None) -> None:
    handle = Job(ctx.store, job)
    if handle.rank_completed(rank, fingerprint, results, final_loss, weights_artifact, global_fingerprint):
        log.info("job %s: completed, final loss %s", job.id, handle.record.final_loss)
        _compare_fingerprints(ctx, handle.record)
        notify.job_changed(ctx.store.get_job(job.id) or handle.record)
        ctx.scheduler.kick()


def _compare_fingerprints(ctx, job: JobRecord) -> None:
    """Every rank that holds the whole model reports a sha256 of its final weights, equal on
    each after a correct run: ranks that disagree are a warning on the job (a faulty or
    dishonest donor, or a job whose ranks were not in step), never silence."""
    held: dict[str, list[int]] = {}
    for r, state in job.ranks.items():
        if state.status == RankStatus.COMPLETED and state.fingerprint:
            held.setdefault(state.fingerprint, []).append(int(r))
    if len(held) < 2:
        return
    groups = sorted(held.values(), key=lambda ranks: (-len(ranks), ranks))
    text = ("the ranks' final weights differ: " + "; ".join(
        f"rank(s) {', '.join(map(str, sorted(ranks)))} hold {fp[:12]}" for fp, ranks in
        sorted(held.items(), key=lambda kv: (-len(kv[1]), kv[1]))) + " (one of them trained something else: "
        "a faulty or dishonest donor; the weights that came back are rank 0's)")
    if len(groups[0]) > len(groups[1]):
        text += f"; the majority is rank(s) {', '.join(map(str, sorted(groups[0])))}"
    log.warning("job %s: %s", job.id, text)
    ctx.store.set_job(job.id, {"warnings": [*job.warnings, text]})
    notify.events_added(job, ctx.store.add_events(job.id, [{
        "kind": EventKind.LOG.value, "rank": None, "key": f"fingerprints:{job.attempt}", "step": None,
        "data": {"text": f"WARNING: {text}"}, "ts": time.time()}]))


def rank_failed(ctx, job: JobRecord, rank: int, error: str, tb: str, collective: bool,
                exit_code: int | None = None) -> None:
    """A rank reported an exception. ``collective``: it came from torch.distributed (a peer is
    probably gone), so wait to see whether a GPU client was lost before failing the job; so
    too for a script that exited badly (``exit_code``)."""
    handle = Job(ctx.store, job)
    if not handle.rank_failed(rank, error, tb, collective, exit_code) or job.status not in ACTIVE:
        return
    if collective or exit_code is not None:
        log.warning("job %s: rank %d lost its peers (%s); checking the GPU clients", job.id, rank, error)
        return
    log.warning("job %s: rank %d failed: %s", job.id, rank, error)
    ctx.scheduler.kick(settle=True)  # fails the job as soon as every rank reported


def _announce(ctx, handle: Job, reason: str) -> JobRecord:
    """The job stopped running (failed, cancelled, interrupted): stop its ranks, show it, and
    let the scheduler use its slots once they are free."""
    _stop_ranks(ctx, handle.record, reason)
    notify.job_changed(handle.record)
    ctx.scheduler.kick()
    return handle.record


def fail(ctx, job_id: str, reason: str) -> JobRecord | None:
    """Fail an active or waiting job and stop its ranks; None if it had ended already."""
    handle = Job.load(ctx.store, job_id)
    if handle is None or not handle.fail(reason):
        return None
    log.warning("job %s: failed: %s", job_id, reason)
    return _announce(ctx, handle, reason)


def cancel(ctx, job_id: str, reason: str = "cancelled by the submitter") -> JobRecord | None:
    handle = Job.load(ctx.store, job_id)
    if handle is None or not handle.cancel(reason):
        return None
    log.info("job %s: cancelled", job_id)
    return _announce(ctx, handle, reason)


def interrupt(ctx, job_id: str, reason: str) -> JobRecord | None:
    """A GPU client of the running job is gone: stop the other ranks and queue the job again
    as ``resuming`` (it goes on from its last checkpoint), or fail it after too many restarts."""
    handle = Job.load(ctx.store, job_id)
    moved = handle and handle.interrupt(reason)
    if moved is None:
        return None
    record = handle.record
    if moved == JobStatus.FAILED:
        log.warning("job %s: failed: %s", job_id, record.reason)
        return _announce(ctx, handle, record.reason)
    ckpt = record.latest_checkpoint
    log.warning("job %s: interrupted (%s); resuming from %s", job_id, reason,
                f"checkpoint {ckpt.n} (epoch {ckpt.epoch})" if ckpt else "the start")
    return _announce(ctx, handle, f"job interrupted: {reason}")


def drop(ctx, job: JobRecord, ranks: list[int], reason: str) -> bool:
    """A DILOCO job goes on without these workers (``Job.drop``); False when it cannot (it is no
    DILOCO job, or no other worker is left), and the caller does what it does for DDP and FSDP.
    True when there was nothing to drop (those ranks completed already)."""
    if job.spec.parallelism != Parallelism.DILOCO or job.status not in ACTIVE:
        return False
    per = job.spec.diloco.ranks_per_worker  # a worker is all its ranks: one lost drops them all
    ranks = sorted({r - r % per + i for r in ranks for i in range(per)})
    ranks = [r for r in ranks if (state := job.ranks.get(str(r))) is None or state.status != RankStatus.COMPLETED]
    if not ranks:
        return True
    handle = Job(ctx.store, job)
    if not handle.drop(ranks, reason):
        return False
    log.warning("job %s: %s; rank(s) %s dropped, the other workers go on", job.id, reason, ranks)
    notify.job_changed(handle.record)
    ctx.scheduler.kick()
    return True


def ranks_exited(ctx, client_id: str, job_id: str, exits: dict, attempt: int = 0) -> None:
    """A GPU client says its rank processes of this job (this attempt) are gone; free its slots.
    A DILOCO worker that died without a word is dropped, and the others go on."""
    handle = Job.load(ctx.store, job_id)
    if handle is None:
        return
    if handle.record.attempt != attempt:
        log.info("job %s: late exits of attempt %d from gpu-client %s ignored", job_id, attempt, client_id)
        return
    record = handle.record
    died = [int(rank) for rank, code in exits.items() if int(code) != 0 and str(rank) not in record.failures]
    if died and drop(ctx, record, died, f"rank process(es) {', '.join(map(str, died))} on gpu client {client_id} "
                                         f"exited ({', '.join(f'{r}: {exits[r]}' for r in exits)})"):
        handle.refresh()
    bad = handle.ranks_exited(exits)
    ctx.store.release_slots(job_id, client_id)
    record = handle.record
    notify.clients_changed(ctx, record.room_id)
    ctx.scheduler.kick(settle=bool(bad or record.failing_since or record.suspect_since))


def not_started(ctx, record: JobRecord, reason: str, clients) -> JobRecord | None:
    """The job's placement did not start: its ranks are told to stop, its slots freed (a GPU
    client that never starts ranks never says they exited either), and it waits to be placed
    again on other GPU clients than ``clients``, or fails after ``START_TRIES`` such placements
    (``Job.not_started``). None if it moved on meanwhile."""
    handle = Job(ctx.store, record)
    moved = handle.not_started(reason, clients, int(ctx.config.get("START_TRIES", defaults.START_TRIES) or 0))
    if moved is None:
        return None
    log.warning("job %s: %s; %s", record.id, reason, "failed" if moved == JobStatus.FAILED else "placing it again")
    cancel = JobCancel(job_id=record.id, attempt=record.attempt, reason=reason)
    tell_clients(ctx, record, EV_JOB_CANCEL, cancel.model_dump(mode="json"))  # the placement as it was
    ctx.store.release_slots(record.id)
    notify.job_changed(handle.record)
    notify.clients_changed(ctx, record.room_id)
    ctx.scheduler.kick()
    return handle.record


def _start_overdue(ctx, room_id: str | None) -> None:
    """Give up the placements of the room's starting jobs none of whose ranks reported running
    within ``START_TIMEOUT``."""
    timeout = float(ctx.config.get("START_TIMEOUT", defaults.START_TIMEOUT) or 0)
    if not timeout:
        return
    for record in ctx.store.list_jobs(room_id, statuses=[JobStatus.STARTING]):
        reason = Job(ctx.store, record).start_overdue(timeout)
        if reason is None:
            continue
        # Held against the GPU clients that never said they run it (a fake one, beside honest ones
        # whose ranks wait in the rendezvous for its); against all of them if each said so.
        held, mark = list(dict.fromkeys(p.client_id for p in record.placement or [])), f"{record.id}:{record.attempt}"
        silent = [c for c in held if mark not in ((ctx.store.get_client(c) or {}).get("running_jobs") or [])]
        why = f"gpu client(s) {', '.join(silent)} never said they run it" if silent else \
            f"each of gpu client(s) {', '.join(held)} said it runs it"
        not_started(ctx, record, f"{reason}; {why}", silent or held)


def settle_suspects(ctx, room_id: str | None = None) -> None:
    """Fail the active jobs (of the room, when given) that are overdue (``Job.overdue``): their
    ranks raised and every rank reported, or their ranks lost their peers and no GPU client
    turned out lost."""
    assign_timeout = 2 * float(ctx.config.get("RESERVE_TIMEOUT", defaults.RESERVE_TIMEOUT)) + 5.0
    for record in ctx.store.list_jobs(room_id, statuses=list(ACTIVE), unsettled=True):  # the others are not overdue
        handle = Job(ctx.store, record)
        offline = set()
        if record.suspect_since is not None:
            offline = {p.client_id for p in record.placement or []
                       if (ctx.store.get_client(p.client_id) or {}).get("status") != ClientStatus.ONLINE.value}
        reason = handle.overdue(offline, float(ctx.config["CLIENT_TIMEOUT"]), assign_timeout)
        if reason == NO_RENDEZVOUS and handle.unplace(f"placed again: {reason}"):
            log.warning("job %s: %s; placing it again", record.id, reason)
            ctx.store.release_slots(record.id)  # no GPU client was told of it
            notify.job_changed(handle.record)
            notify.clients_changed(ctx, record.room_id)
            ctx.scheduler.kick()
        elif reason is not None and fail(ctx, record.id, reason) and record.master is None:
            ctx.store.release_slots(record.id)  # no GPU client was told of it: none will say its ranks exited
    _start_overdue(ctx, room_id)


def client_lost(ctx, client_id: str, reason: str) -> None:
    """A GPU client disconnected or went silent for too long: its ranks are gone."""
    client = ctx.store.get_client(client_id)
    if client is None:
        return
    ctx.store.update_client(client_id, {"status": ClientStatus.OFFLINE.value, "sid": None, "lost_after": None,
                                        "lost_at": time.time()})
    log.warning("gpu-client %s: lost (%s)", client_id, reason)
    for job_id in {s["job_id"] for s in ctx.store.list_slots(client["room_id"], client_id) if s["job_id"]}:
        why = f"gpu client {client_id} ({client.get('hostname')}) lost: {reason}"
        job = ctx.store.get_job(job_id)
        ranks = [p.rank for p in (job.placement or []) if p.client_id == client_id] if job else []
        if job is None or not drop(ctx, job, ranks, why):
            interrupt(ctx, job_id, why)
        ctx.store.release_slots(job_id, client_id)
    notify.clients_changed(ctx, client["room_id"], joined_or_left=True)
    ctx.scheduler.kick()
