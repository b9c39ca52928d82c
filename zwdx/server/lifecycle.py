"""How a job moves after it is placed: ranks start, finish, fail; clients vanish; users cancel.

Every transition is a conditional ``update_job`` (expect_status), so two servers or two
threads that race apply it at most once. Slots are freed only when the GPU client says its
rank processes exited (or the client is gone), so no slot runs two jobs.
"""
from __future__ import annotations

import logging
import time

from ..protocol import ACTIVE, EV_JOB_CANCEL, GPU_NAMESPACE, ClientStatus, JobStatus
from . import notify, socketio

log = logging.getLogger(__name__)

_ACTIVE = [s.value for s in ACTIVE]


def _now() -> float:
    return time.time()


def _timeline(status: str, reason: str = "") -> dict:
    return {"status": status, "at": _now(), **({"reason": reason} if reason else {})}


def _tell_clients(ctx, job: dict, event: str, payload: dict) -> None:
    for client_id in {p["client_id"] for p in job.get("placement") or []}:
        client = ctx.store.get_client(client_id)
        if client and client.get("sid") and client.get("status") == ClientStatus.ONLINE.value:
            socketio.emit(event, payload, to=client["sid"], namespace=GPU_NAMESPACE)


def rank_started(ctx, job: dict, rank: int) -> None:
    ctx.store.update_job(job["id"], {f"ranks.{rank}.status": "running",
                                     f"ranks.{rank}.started_at": _now()})
    updated = ctx.store.update_job(job["id"], {"status": JobStatus.RUNNING.value, "running_at": _now()},
                                   expect_status=[JobStatus.STARTING.value],
                                   push={"timeline": _timeline(JobStatus.RUNNING.value)})
    if updated:
        log.info("job %s: running (world size %d)", job["id"], updated["world_size"])
        notify.job_changed(updated)


def rank_completed(ctx, job: dict, rank: int, report: dict) -> None:
    changes = {f"ranks.{rank}.status": "completed",
               f"ranks.{rank}.fingerprint": report.get("fingerprint"),
               f"ranks.{rank}.ended_at": _now()}
    if rank == 0:
        changes.update({"results": report.get("results") or {},
                        "final_loss": report.get("final_loss"),
                        "weights_artifact": report.get("weights_artifact")})
    ctx.store.update_job(job["id"], changes)
    _maybe_finish(ctx, job["id"])


def fail(ctx, job_id: str, reason: str, failures: dict | None = None) -> dict | None:
    """Fail an active or queued job, keep each rank's traceback, stop the other ranks."""
    changes = {"status": JobStatus.FAILED.value, "ended_at": _now(), "reason": reason}
    for rank, tb in (failures or {}).items():
        changes[f"failures.{rank}"] = tb
    job = ctx.store.update_job(job_id, changes,
                               expect_status=_ACTIVE + [JobStatus.QUEUED.value],
                               push={"timeline": _timeline(JobStatus.FAILED.value, reason)})
    if job is None:  # already finished: still keep the traceback
        if failures:
            ctx.store.update_job(job_id, {f"failures.{r}": tb for r, tb in failures.items()})
        return None
    log.warning("job %s: failed: %s", job_id, reason)
    _tell_clients(ctx, job, EV_JOB_CANCEL, {"job_id": job_id, "reason": reason})
    notify.job_changed(job)
    ctx.scheduler.kick()
    return job


def cancel(ctx, job_id: str, reason: str = "cancelled by the submitter") -> dict | None:
    job = ctx.store.update_job(job_id, {"status": JobStatus.CANCELLED.value, "ended_at": _now(),
                                        "reason": reason},
                               expect_status=_ACTIVE + [JobStatus.QUEUED.value],
                               push={"timeline": _timeline(JobStatus.CANCELLED.value, reason)})
    if job is None:
        return None
    log.info("job %s: cancelled", job_id)
    _tell_clients(ctx, job, EV_JOB_CANCEL, {"job_id": job_id, "reason": reason})
    notify.job_changed(job)
    ctx.scheduler.kick()
    return job


def ranks_exited(ctx, client_id: str, job_id: str, exits: dict) -> None:
    """A GPU client says its rank processes of this job are gone; free its slots."""
    job = ctx.store.get_job(job_id)
    if job is None:
        return
    changes = {f"exits.{rank}": code for rank, code in exits.items()}
    ctx.store.update_job(job_id, changes)
    ctx.store.release_slots(job_id, client_id)
    bad = {r: c for r, c in exits.items() if c != 0}
    if bad and job["status"] in _ACTIVE:
        ranks = ", ".join(f"rank {r} exit code {c}" for r, c in sorted(bad.items()))
        failures = {str(r): f"rank process exited with code {c} before reporting" for r, c in bad.items()
                    if str(r) not in (job.get("failures") or {})}
        fail(ctx, job_id, f"rank process died ({ranks})", failures)
    _maybe_finish(ctx, job_id)
    notify.clients_changed(ctx, job["room_id"])
    ctx.scheduler.kick()


def _maybe_finish(ctx, job_id: str) -> None:
    job = ctx.store.get_job(job_id)
    if job is None or job["status"] not in _ACTIVE:
        return
    ranks = job.get("ranks") or {}
    exits = job.get("exits") or {}
    world = job["world_size"]
    done = all((ranks.get(str(r)) or {}).get("status") == "completed" for r in range(world))
    exited = all(str(r) in exits for r in range(world))
    if done and exited:
        updated = ctx.store.update_job(job_id, {"status": JobStatus.COMPLETED.value, "ended_at": _now()},
                                       expect_status=_ACTIVE,
                                       push={"timeline": _timeline(JobStatus.COMPLETED.value)})
        if updated:
            log.info("job %s: completed, final loss %s", job_id, updated.get("final_loss"))
            notify.job_changed(updated)
            ctx.scheduler.kick()


def client_lost(ctx, client_id: str, reason: str) -> None:
    """A GPU client disconnected or went silent: jobs with ranks on it cannot go on."""
    client = ctx.store.get_client(client_id)
    if client is None:
        return
    ctx.store.update_client(client_id, {"status": ClientStatus.OFFLINE.value, "sid": None})
    log.warning("gpu-client %s: lost (%s)", client_id, reason)
    for job_id in {s["job_id"] for s in ctx.store.list_slots(client["room_id"])
                   if s["client_id"] == client_id and s["job_id"]}:
        fail(ctx, job_id, f"gpu client {client_id} ({client.get('hostname')}) lost: {reason}")
        ctx.store.release_slots(job_id, client_id)
    notify.clients_changed(ctx, client["room_id"])
    ctx.scheduler.kick()
