"""What a job's ranks and GPU clients report, and what follows: a rank started, said what it
holds, completed or failed; rank 0 committed a checkpoint or uploaded a script's outputs; a
registering GPU client says which ranks it still runs.

``report`` is the one call behind ``POST /jobs/<id>/ranks/<rank>`` (``api.post_rank_status``
parses and authorizes, then calls it); the others are its steps and the Socket.IO side's.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from ...protocol import ACTIVE, EventKind, JobStatus, RankStatus
from ...protocol.gpu import JobCancel
from ...protocol.job import CheckpointEntry, Job as JobRecord
from ...protocol.layout import RankLayout
from ...protocol.report import RankReport, RankReportAnswer, StepCheck
from .. import notify
from .effects import Ctx, Effects, apply
from .lifecycle import ranks_exited
from .model import Job
from .rules import in_step, rejoined

log = logging.getLogger(__name__)


def report(ctx: Ctx, job: JobRecord, rank: int, body: RankReport, weights: Callable[[], str | None]) -> RankReportAnswer:
    """Rank ``rank`` of ``job`` reports (its sender checked already). Once the job failed, a
    rank may still report its own failure (its traceback is kept); nothing else. ``weights``:
    the weights artifact the job returns, asked only once the rank completes."""
    if (state := job.ranks.get(str(rank))) is not None and state.status == RankStatus.DROPPED \
            and not rejoined(job, rank):
        return RankReportAnswer(ok=False, ignored=f"rank {rank} was dropped (a DILOCO worker the job goes on without)")
    if body.status == RankStatus.FAILED and (job.status == JobStatus.FAILED or job.status in ACTIVE):
        # on a failed job too: every failing rank's traceback is kept
        rank_failed(ctx, job, rank, body.error or "error", body.traceback or "(no traceback)", body.collective,
                    body.exit_code, body.check)
        return RankReportAnswer(ok=True)
    if job.status not in ACTIVE:
        return RankReportAnswer(ok=False, ignored=f"job is {job.status.value}")
    if body.status == RankStatus.RUNNING:
        rank_started(ctx, job, rank)
    else:
        rank_completed(ctx, job, rank, fingerprint=body.fingerprint, results=body.results or {},
                       final_loss=body.final_loss, weights_artifact=weights(),
                       global_fingerprint=body.global_fingerprint)
    return RankReportAnswer(ok=True)


def rank_started(ctx: Ctx, job: JobRecord, rank: int) -> None:
    handle = Job(ctx.store, job)
    if handle.rank_running(rank, **_kept(ctx, job, rank)):
        log.info("job %s: running (world size %d, attempt %d)", job.id, handle.record.world_size,
                 handle.record.attempt)
        apply(ctx, Effects(show=handle.record))


def _kept(ctx: Ctx, job: JobRecord, rank: int) -> dict[str, Any]:
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


def rank_layout(ctx: Ctx, job: JobRecord, rank: int, layout: RankLayout) -> bool:
    """A running rank said what it holds of the model: kept on its state, and the dashboards told."""
    handle = Job(ctx.store, job)
    if not handle.rank_layout(rank, layout):
        return False
    apply(ctx, Effects(show=handle.record))
    return True


def rank_completed(ctx: Ctx, job: JobRecord, rank: int, fingerprint: str | None = None, results: dict[str, Any] | None = None,
                   final_loss: float | None = None, weights_artifact: str | None = None,
                   global_fingerprint: str | None = None) -> None:
    handle = Job(ctx.store, job)
    if handle.rank_completed(rank, fingerprint, results, final_loss, weights_artifact, global_fingerprint):
        log.info("job %s: completed, final loss %s", job.id, handle.record.final_loss)
        _compare_fingerprints(ctx, handle.record)
        apply(ctx, Effects(show=ctx.store.get_job(job.id) or handle.record, kick=True))


def _compare_fingerprints(ctx: Ctx, job: JobRecord) -> None:
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
    job_line(ctx, job, text, "fingerprints")


def job_line(ctx: Ctx, job: JobRecord, text: str, key: str, warn: bool = True) -> None:
    """A line the server writes in a job's log (``key``: its event's, with the attempt), logged
    here too; with ``warn``, a WARNING line and one more of the job's ``warnings``."""
    (log.warning if warn else log.info)("job %s: %s", job.id, text)
    if warn:
        fresh = ctx.store.get_job(job.id) or job
        ctx.store.jobs.warnings(job.id, [*fresh.warnings, text])
    notify.events_added(job, ctx.store.add_events(job.id, [{
        "kind": EventKind.LOG.value, "rank": None, "key": f"{key}:{job.attempt}", "step": None,
        "data": {"text": f"WARNING: {text}" if warn else text}, "ts": time.time()}]))


def rank_failed(ctx: Ctx, job: JobRecord, rank: int, error: str, tb: str, collective: bool,
                exit_code: int | None = None, check: StepCheck | None = None) -> None:
    """A rank reported an exception. ``collective``: it came from torch.distributed (a peer is
    probably gone), so wait to see whether a GPU client was lost before failing the job; so
    too for a script that exited badly (``exit_code``). ``check``: the DDP/FSDP step check that
    stopped it, kept for the attempt's settling (``lifecycle.step_checked``); ignored from a
    job whose steps are not checked."""
    if check is not None and not in_step(job):
        log.warning("job %s: rank %d reported a step check, but the job's steps are not checked: ignored", job.id,
                    rank)
        check = None
    handle = Job(ctx.store, job)
    if not handle.rank_failed(rank, error, tb, collective, exit_code, check) or job.status not in ACTIVE:
        return
    if collective or exit_code is not None:
        log.warning("job %s: rank %d lost its peers (%s); checking the GPU clients", job.id, rank, error)
        return
    log.warning("job %s: rank %d failed: %s", job.id, rank, error)
    apply(ctx, Effects(settle=True))  # fails the job as soon as every rank reported


def forget_ranks_gone(ctx: Ctx, room_id: str, client_id: str, running: dict[str, int]) -> None:
    """A GPU client registered saying which jobs it still runs ranks of (job id -> attempt): the
    slots the store thinks it keeps busy with others hold ranks that are gone."""
    for slot in ctx.store.list_slots(room_id, client_id):
        if slot["job_id"] and slot["job_id"] not in running:
            job = ctx.store.get_job(slot["job_id"])
            ranks_exited(ctx, client_id, slot["job_id"], {str(slot["rank"]): -1}, job.attempt if job else 0)


def not_wanted(ctx: Ctx, client_id: str, running: dict[str, int]) -> list[JobCancel]:
    """Of the ranks a registering GPU client still runs, those of jobs that went on without it
    (or ended): what it is told to stop them."""
    cancels = []
    for job_id, attempt in running.items():
        job = ctx.store.get_job(job_id)
        mine = job and job.status in ACTIVE and job.attempt == attempt and \
            any(p.client_id == client_id for p in job.placement or [])
        if not mine:
            cancels.append(JobCancel(job_id=job_id, attempt=attempt, reason="the job went on without this gpu client"))
    return cancels


def checkpoint_committed(ctx: Ctx, job: JobRecord, entry: CheckpointEntry) -> list[CheckpointEntry] | None:
    """Rank 0 committed a checkpoint (its files checked already): the job's latest, shown. The
    checkpoints the job keeps, or None: it is not starting or running (nothing changed)."""
    handle = Job(ctx.store, job)
    kept = handle.checkpoint_committed(entry)
    if kept is not None:
        log.info("job %s: checkpoint %d committed (epoch %s, step %s)", job.id, entry.n, entry.epoch, entry.step)
        apply(ctx, Effects(show=handle.record))
    return kept


def outputs_uploaded(ctx: Ctx, job: JobRecord, artifact_id: str) -> bool:
    """Rank 0 of a script job uploaded its outputs (``Job.outputs_uploaded``)."""
    return Job(ctx.store, job).outputs_uploaded(artifact_id)
