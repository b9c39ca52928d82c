"""How a job moves after it is placed: ranks start, finish, fail; clients vanish; users cancel.

Every transition is a conditional ``update_job`` (expect_status), so two servers or two
threads that race apply it at most once. A job completes as soon as every rank reported
completion; its slots are freed only when the GPU client says its rank processes exited (or
the client is gone), so a rank's teardown is off the user's path and still no slot runs two jobs.

Failures come in two kinds. A rank whose own code raised fails the job at once, with every
failing rank's traceback (``failures``; ``failure_info`` says when and how each failed, and the
job's view lists them first failure first, see ``views.failure_order``). A rank that lost its peers (a collective broke, or its process died
without a word) makes the job *suspect*: if a GPU client of the job is found lost within
``CLIENT_TIMEOUT`` the job goes back to the queue as ``resuming`` and restarts from its last
checkpoint (up to ``max_restarts`` times); otherwise it fails.
"""
from __future__ import annotations

import logging
import time

from .. import defaults
from ..protocol import ACTIVE, EV_JOB_CANCEL, GPU_NAMESPACE, ClientStatus, FailureKind, JobStatus
from . import notify
from .extensions import socketio

log = logging.getLogger(__name__)

_ACTIVE = [s.value for s in ACTIVE]
_WAITING = [JobStatus.QUEUED.value, JobStatus.RESUMING.value]


def _now() -> float:
    return time.time()


def _timeline(status: str, reason: str = "", **extra) -> dict:
    return {"status": status, "at": _now(), **({"reason": reason} if reason else {}), **extra}


def tell_clients(ctx, job: dict, event: str, payload: dict, only: set | None = None) -> None:
    for client_id in {p["client_id"] for p in job.get("placement") or []}:
        if only is not None and client_id not in only:
            continue
        client = ctx.store.get_client(client_id)
        if client and client.get("sid") and client.get("status") == ClientStatus.ONLINE.value:
            socketio.emit(event, payload, to=client["sid"], namespace=GPU_NAMESPACE)


def failure(rank, tb: str, kind: FailureKind) -> dict:
    """The changes that record a rank's failure: its traceback, and when and how it failed."""
    return {f"failures.{rank}": tb, f"failure_info.{rank}": {"at": _now(), "kind": kind.value}}


def rank_started(ctx, job: dict, rank: int) -> None:
    ctx.store.update_job(job["id"], {f"ranks.{rank}.status": "running", f"ranks.{rank}.started_at": _now()})
    updated = ctx.store.update_job(job["id"], {"status": JobStatus.RUNNING.value, "running_at": _now()},
                                   expect_status=[JobStatus.STARTING.value],
                                   push={"timeline": _timeline(JobStatus.RUNNING.value,
                                                               attempt=job.get("attempt", 0))})
    if updated:
        log.info("job %s: running (world size %d, attempt %d)", job["id"], updated["world_size"],
                 updated.get("attempt", 0))
        notify.job_changed(updated)


def rank_completed(ctx, job: dict, rank: int, report: dict) -> None:
    changes = {f"ranks.{rank}.status": "completed", f"ranks.{rank}.fingerprint": report.get("fingerprint"),
               f"ranks.{rank}.ended_at": _now()}
    if rank == 0:
        changes.update({"results": report.get("results") or {}, "final_loss": report.get("final_loss"),
                        "weights_artifact": report.get("weights_artifact")})
    ctx.store.update_job(job["id"], changes)
    _maybe_finish(ctx, job["id"])


def rank_failed(ctx, job: dict, rank: int, error: str, tb: str, collective: bool) -> None:
    """A rank reported an exception. ``collective``: it came from torch.distributed (a peer is
    probably gone), so wait to see whether a GPU client was lost before failing the job."""
    if collective:
        ctx.store.update_job(job["id"], {**failure(rank, tb, FailureKind.COLLECTIVE),
                                         "suspect_since": job.get("suspect_since") or _now()}, expect_status=_ACTIVE)
        log.warning("job %s: rank %d lost its peers (%s); checking the GPU clients", job["id"], rank, error)
        return
    # The job fails; other ranks failing at the same point get FAILURE_GRACE to report theirs.
    updated = ctx.store.update_job(job["id"], failure(rank, tb, FailureKind.RAISED), expect_status=_ACTIVE)
    if updated and not updated.get("failing_since"):
        ctx.store.update_job(job["id"], {"failing_since": _now(), "failing_reason": f"rank {rank} failed: {error}"},
                             expect_status=_ACTIVE)
    log.warning("job %s: rank %d failed: %s", job["id"], rank, error)
    ctx.scheduler.kick(settle=True)  # fails the job as soon as every rank reported


def fail(ctx, job_id: str, reason: str, failures: dict | None = None) -> dict | None:
    """Fail an active or waiting job, keep each rank's traceback, stop the other ranks."""
    changes = {"status": JobStatus.FAILED.value, "ended_at": _now(), "reason": reason}
    for rank, tb in (failures or {}).items():
        changes[f"failures.{rank}"] = tb
    job = ctx.store.update_job(job_id, changes, expect_status=_ACTIVE + _WAITING,
                               push={"timeline": _timeline(JobStatus.FAILED.value, reason)})
    if job is None:  # already finished: still keep the traceback
        if failures:
            ctx.store.update_job(job_id, {f"failures.{r}": tb for r, tb in failures.items()})
        return None
    log.warning("job %s: failed: %s", job_id, reason)
    tell_clients(ctx, job, EV_JOB_CANCEL, {"job_id": job_id, "reason": reason})
    notify.job_changed(job)
    ctx.scheduler.kick()
    return job


def cancel(ctx, job_id: str, reason: str = "cancelled by the submitter") -> dict | None:
    job = ctx.store.update_job(job_id, {"status": JobStatus.CANCELLED.value, "ended_at": _now(), "reason": reason},
                               expect_status=_ACTIVE + _WAITING,
                               push={"timeline": _timeline(JobStatus.CANCELLED.value, reason)})
    if job is None:
        return None
    log.info("job %s: cancelled", job_id)
    tell_clients(ctx, job, EV_JOB_CANCEL, {"job_id": job_id, "reason": reason})
    notify.job_changed(job)
    ctx.scheduler.kick()
    return job


def interrupt(ctx, job_id: str, reason: str) -> dict | None:
    """A GPU client of the running job is gone: stop the other ranks and queue the job again
    as ``resuming`` (it goes on from its last checkpoint), or fail it after too many restarts."""
    job = ctx.store.get_job(job_id)
    if job is None or job["status"] not in _ACTIVE:
        return None
    restarts = int(job.get("restarts") or 0)
    limit = int(job["spec"].get("max_restarts", defaults.MAX_RESTARTS))
    if restarts >= limit:
        history = "; ".join(r.get("reason", "") for r in job.get("restart_history") or [])
        return fail(ctx, job_id, f"{reason}; gave up after {restarts} restart(s)" + (f" ({history})" if history else ""),
                    None)
    ckpt = job.get("latest_checkpoint")
    updated = ctx.store.update_job(job_id, {
        "status": JobStatus.RESUMING.value, "restarts": restarts + 1, "suspect_since": None, "failures": {},
        "failure_info": {},
        "waiting_reason": reason, "ranks": {}, "exits": {}},
        expect_status=_ACTIVE,
        push={"timeline": _timeline(JobStatus.RESUMING.value, reason,
                                    checkpoint=(ckpt or {}).get("n")),
              "restart_history": {"at": _now(), "reason": reason, "failures": job.get("failures") or {},
                                  "from_checkpoint": ckpt}})
    if updated is None:
        return None
    log.warning("job %s: interrupted (%s); resuming from %s", job_id, reason,
                f"checkpoint {ckpt['n']} (epoch {ckpt.get('epoch')})" if ckpt else "the start")
    tell_clients(ctx, job, EV_JOB_CANCEL, {"job_id": job_id, "reason": f"job interrupted: {reason}"})
    notify.job_changed(updated)
    ctx.scheduler.kick()
    return updated


def ranks_exited(ctx, client_id: str, job_id: str, exits: dict, attempt: int = 0) -> None:
    """A GPU client says its rank processes of this job (this attempt) are gone; free its slots."""
    job = ctx.store.get_job(job_id)
    if job is None:
        return
    if int(job.get("attempt") or 0) != attempt:
        log.info("job %s: late exits of attempt %d from gpu-client %s ignored", job_id, attempt, client_id)
        return
    ctx.store.update_job(job_id, {f"exits.{rank}": code for rank, code in exits.items()}, expect_status=_ACTIVE)
    ctx.store.release_slots(job_id, client_id)
    job = ctx.store.get_job(job_id)
    ranks = job.get("ranks") or {}
    # A rank that reported completion is done, whatever its teardown returned.
    bad = {r: c for r, c in exits.items() if c != 0 and (ranks.get(str(r)) or {}).get("status") != "completed"}
    if bad and job["status"] in _ACTIVE:
        unreported = {r: c for r, c in bad.items() if str(r) not in (job.get("failures") or {})}
        if unreported:
            # Died without a word: maybe its peer vanished, maybe it crashed. Suspect, then decide.
            changes = {}
            for r, c in unreported.items():
                changes.update(failure(r, f"rank process exited with code {c} before reporting", FailureKind.EXITED))
            changes["suspect_since"] = job.get("suspect_since") or _now()
            changes["suspect_reason"] = "rank process died (" + ", ".join(
                f"rank {r} exit code {c}" for r, c in sorted(unreported.items())) + ")"
            ctx.store.update_job(job_id, changes, expect_status=_ACTIVE)
    notify.clients_changed(ctx, job["room_id"])
    ctx.scheduler.kick(settle=bool(bad or job.get("failing_since") or job.get("suspect_since")))


#: Seconds the other ranks of a job get to report their own failure after the first one.
FAILURE_GRACE = 2.0


def settle_suspects(ctx) -> None:
    """Fail jobs whose ranks raised (once every rank reported or the grace is over), and jobs
    whose ranks broke when no GPU client turned out lost within the timeout."""
    deadline = _now() - float(ctx.config["CLIENT_TIMEOUT"]) - 1.0
    for job in ctx.store.list_jobs(statuses=_ACTIVE):
        if job.get("failing_since"):
            failures, exits = job.get("failures") or {}, job.get("exits") or {}
            heard = all(str(r) in failures or str(r) in exits for r in range(job.get("world_size") or 0))
            if heard or job["failing_since"] < _now() - FAILURE_GRACE:
                fail(ctx, job["id"], job.get("failing_reason") or "a rank failed")
            continue
        since = job.get("suspect_since")
        if not since:
            continue
        lost = [p["client_id"] for p in job.get("placement") or []
                if (ctx.store.get_client(p["client_id"]) or {}).get("status") != ClientStatus.ONLINE.value]
        if lost:
            continue  # the reaper will declare them lost and interrupt the job
        if since < deadline or _all_exited(job):
            fail(ctx, job["id"], job.get("suspect_reason") or "a rank lost its peers and no GPU client was lost")


def _all_exited(job: dict) -> bool:
    exits = job.get("exits") or {}
    return all(str(r) in exits for r in range(job.get("world_size") or 0))


def _maybe_finish(ctx, job_id: str) -> None:
    job = ctx.store.get_job(job_id)
    if job is None or job["status"] not in _ACTIVE:
        return
    ranks = job.get("ranks") or {}
    if all((ranks.get(str(r)) or {}).get("status") == "completed" for r in range(job["world_size"])):
        updated = ctx.store.update_job(job_id, {"status": JobStatus.COMPLETED.value, "ended_at": _now()},
                                       expect_status=_ACTIVE,
                                       push={"timeline": _timeline(JobStatus.COMPLETED.value)})
        if updated:
            log.info("job %s: completed, final loss %s", job_id, updated.get("final_loss"))
            notify.job_changed(updated)
            ctx.scheduler.kick()


def client_lost(ctx, client_id: str, reason: str) -> None:
    """A GPU client disconnected or went silent for too long: its ranks are gone."""
    client = ctx.store.get_client(client_id)
    if client is None:
        return
    ctx.store.update_client(client_id, {"status": ClientStatus.OFFLINE.value, "sid": None, "lost_after": None,
                                        "lost_at": _now()})
    log.warning("gpu-client %s: lost (%s)", client_id, reason)
    for job_id in {s["job_id"] for s in ctx.store.list_slots(client["room_id"], client_id) if s["job_id"]}:
        interrupt(ctx, job_id, f"gpu client {client_id} ({client.get('hostname')}) lost: {reason}")
        ctx.store.release_slots(job_id, client_id)
    notify.clients_changed(ctx, client["room_id"], joined_or_left=True)
    ctx.scheduler.kick()
