"""Checkpoints of a job: files uploaded by its ranks (job key), committed by rank 0, the
last ``keep_checkpoints`` kept, read back by resumed ranks and the submitter (room token)."""
from __future__ import annotations

import logging
import time

from flask import Blueprint, jsonify

from ..errors import BadRequest, NotFound
from ..protocol import ArtifactKind
from ..protocol.base import parse
from ..protocol.job import CheckpointEntry
from . import notify
from .auth import job_in_room, request_room
from .http import P, ctx, field, json_body, rank_job, save_artifact, stream
from .job import Job

log = logging.getLogger(__name__)

bp = Blueprint("checkpoints", __name__)

_NAME_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def _file_name(name: str) -> str:
    if not name or len(name) > 200 or set(name) - _NAME_OK or name in (".", ".."):
        raise BadRequest(f"bad checkpoint file name {name!r}")
    return name


@bp.put(f"{P}/jobs/<job_id>/checkpoints/<int:n>/<name>")
def put_checkpoint_file(job_id: str, n: int, name: str):
    """One file of checkpoint ``n`` (a rank's shard, or the whole state for DDP)."""
    job = rank_job(job_id)
    artifact = save_artifact({"id": job.room_id}, ArtifactKind.CHECKPOINT.value, job.id)
    ctx().store.update_artifact(artifact["id"], {"checkpoint": n, "name": _file_name(name)})
    return jsonify(artifact), 201


@bp.post(f"{P}/jobs/<job_id>/checkpoints/<int:n>/commit")
def commit_checkpoint(job_id: str, n: int):
    """Rank 0, once every rank uploaded its files: checkpoint ``n`` is complete. Older ones
    beyond the job's ``keep_checkpoints`` are deleted."""
    job = rank_job(job_id)
    body = json_body()
    names = field(body, "files", list, required=True)
    files = {}
    for artifact in ctx().store.list_artifacts(job.id, ArtifactKind.CHECKPOINT.value):
        if artifact.get("checkpoint") == n:
            files[artifact["name"]] = artifact["id"]  # a re-upload of a name wins
    missing = [name for name in names if name not in files]
    if missing:
        raise BadRequest(f"checkpoint {n} lacks uploaded file(s) {', '.join(map(str, missing))}", missing=missing)
    entry = parse(CheckpointEntry, {
        "n": n, "epoch": body.get("epoch"), "step": body.get("step"), "format": body.get("format"),
        "epoch_complete": bool(body.get("epoch_complete", True)), "world_size": job.world_size,
        "attempt": job.attempt, "files": {name: files[name] for name in names}, "at": time.time()}, "checkpoint")
    handle = Job(ctx().store, job)
    kept = {c.n for c in handle.checkpoint_committed(entry)}
    for artifact in ctx().store.list_artifacts(job.id, ArtifactKind.CHECKPOINT.value):
        if artifact.get("checkpoint") not in kept:
            ctx().artifacts.delete(artifact["id"])
            ctx().store.delete_artifact(artifact["id"])
    log.info("job %s: checkpoint %d committed (epoch %s, step %s)", job.id, n, entry.epoch, entry.step)
    notify.job_changed(handle.record)
    return jsonify(entry.model_dump(mode="json")), 201


@bp.get(f"{P}/jobs/<job_id>/checkpoints")
def list_checkpoints(job_id: str):
    job = job_in_room(job_id, request_room())
    return jsonify({"job_id": job.id, "checkpoints": [c.model_dump(mode="json") for c in job.checkpoints]})


@bp.get(f"{P}/jobs/<job_id>/checkpoints/<int:n>/<name>")
def get_checkpoint_file(job_id: str, n: int, name: str):
    job = job_in_room(job_id, request_room())
    for artifact in ctx().store.list_artifacts(job.id, ArtifactKind.CHECKPOINT.value):
        if artifact.get("checkpoint") == n and artifact.get("name") == name:
            return stream(artifact)
    raise NotFound(f"job {job_id} has no checkpoint {n} file {name}", job_id=job_id)
