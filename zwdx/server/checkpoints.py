"""Checkpoints of a job: files uploaded by the ranks of its current attempt (each with its rank
key, recorded with the file), committed by rank 0 (its key), the last ``keep_checkpoints``
kept, read back by resumed ranks (their keys) and the submitter (a submitter token)."""
from __future__ import annotations

import logging
import time

from flask import Blueprint
from pydantic import TypeAdapter, ValidationError

from ..errors import BadRequest, NotFound
from ..protocol import ArtifactKind, CheckpointFormat, Parallelism
from ..protocol.job import CheckpointEntry, Job as JobRecord
from ..protocol.report import CheckpointCommit, FileName
from ..protocol.rest import ArtifactView, CheckpointList
from . import notify
from .auth import Sender, only_rank
from .http import OCTET, Auth, ctx, operation, save_artifact, stream
from .job import Job

log = logging.getLogger(__name__)

bp = Blueprint("checkpoints", __name__)


_FILE_NAME = TypeAdapter(FileName)


def _file_name(name: str) -> str:
    """``name`` if it is a checkpoint file's name (``FileName``), else BadRequest naming ``name``."""
    try:
        _FILE_NAME.validate_python(name)
    except ValidationError:
        raise BadRequest(f"path 'name': bad checkpoint file name {name!r} (letters, digits and ._-, at most 200)",
                         field="name") from None
    return name


@operation(bp, "PUT", "/jobs/<job_id>/checkpoints/<n>/<name>", "Upload one file of checkpoint n",
           auth=Auth.JOB, body=OCTET, answer=ArtifactView, status=201, errors=(400, 413, 422, 429), tag="checkpoints")
def put_checkpoint_file(job: JobRecord, sender: Sender, n: int, name: str):
    """A rank's shard (FSDP), or the whole state (DDP). Sent again, the later file wins. The
    rank and the attempt whose key sent it are kept with it."""
    _file_name(name)
    return save_artifact({"id": job.room_id}, ArtifactKind.CHECKPOINT.value, job.id, checkpoint=n, name=name,
                         rank=sender.rank, attempt=sender.attempt), 201


@operation(bp, "POST", "/jobs/<job_id>/checkpoints/<n>/commit", "Commit checkpoint n (rank 0)",
           auth=Auth.JOB, body=CheckpointCommit, answer=CheckpointEntry, status=201, tag="checkpoints")
def commit_checkpoint(job: JobRecord, sender: Sender, n: int, body: CheckpointCommit):
    """Rank 0's key only. Once every rank uploaded its files, checkpoint ``n`` is complete;
    older ones beyond the job's ``keep_checkpoints`` are deleted. Only files the ranks of the
    current attempt uploaded count: a file named in ``files`` that they did not upload is a 400
    listing them (``missing``)."""
    only_rank(sender, 0, "committing a checkpoint", job.id)
    files = {}
    for artifact in ctx().store.list_artifacts(job.id, ArtifactKind.CHECKPOINT.value):
        if artifact.get("checkpoint") == n and artifact.get("attempt") == job.attempt:
            files[artifact["name"]] = artifact["id"]  # a re-upload of a name wins
    missing = [name for name in body.files if name not in files]
    if missing:
        raise BadRequest(f"checkpoint {n} lacks uploaded file(s) {', '.join(missing)}", field="files", missing=missing)
    fmt = body.format or (CheckpointFormat.DCP if job.spec.parallelism == Parallelism.FSDP else CheckpointFormat.TORCH)
    entry = CheckpointEntry.model_validate({
        **body.model_dump(exclude={"files", "format"}, exclude_none=True), "format": fmt, "n": n, "world_size": job.world_size,
        "attempt": job.attempt, "files": {name: files[name] for name in body.files}, "at": time.time()})
    handle = Job(ctx().store, job)
    kept = {c.n for c in handle.checkpoint_committed(entry)}
    for artifact in ctx().store.list_artifacts(job.id, ArtifactKind.CHECKPOINT.value):
        if artifact.get("checkpoint") not in kept:
            ctx().artifacts.delete(artifact["id"])
            ctx().store.delete_artifact(artifact["id"])
    log.info("job %s: checkpoint %d committed (epoch %s, step %s)", job.id, n, entry.epoch, entry.step)
    notify.job_changed(handle.record)
    return entry, 201


@operation(bp, "GET", "/jobs/<job_id>/checkpoints", "A job's committed checkpoints", answer=CheckpointList,
           tag="checkpoints")
def list_checkpoints(job: JobRecord):
    return CheckpointList(job_id=job.id, checkpoints=job.checkpoints)


@operation(bp, "GET", "/jobs/<job_id>/checkpoints/<n>/<name>", "Download one file of checkpoint n",
           auth=Auth.ROOM_OR_JOB, answer=OCTET, tag="checkpoints")
def get_checkpoint_file(job: JobRecord, n: int, name: str):
    """A submitter token of the room, or a rank key of the job (a resumed rank reads the
    checkpoint it goes on from)."""
    for artifact in ctx().store.list_artifacts(job.id, ArtifactKind.CHECKPOINT.value):
        if artifact.get("checkpoint") == n and artifact.get("name") == name:
            return stream(artifact)
    raise NotFound(f"job {job.id} has no checkpoint {n} file {name}", job_id=job.id)
