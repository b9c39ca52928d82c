"""Checkpoints of a job: files uploaded by the ranks of its current attempt (each with its rank
key; the rank and attempt are recorded with the file), committed by rank 0 (its key), the last
``keep_checkpoints`` kept, read back by resumed ranks (their keys) and the submitter (a
submitter token).

Nothing a rank says decides what a checkpoint is (``zwdx.protocol.checkpoint``). The server
takes the format from the job's parallelism: a file that format does not have, or one that
belongs to another rank than the key's, is refused at upload; a commit that names another
format is refused, and so is one that lacks a file the format needs from any rank of the
attempt. Only files uploaded in the current attempt count, each by the rank it belongs to. A
committed checkpoint never changes: its number takes no more uploads and no second commit, a
later commit must carry a higher number, and its files are served as committed. A refused
call changes nothing.
"""
from __future__ import annotations

import logging
import time

from flask import Blueprint
from pydantic import TypeAdapter, ValidationError

from ..errors import BadRequest, Conflict, Forbidden, NotFound
from ..protocol import ArtifactKind, CheckpointFormat
from ..protocol import checkpoint as files_of
from ..protocol.job import CheckpointEntry, Job as JobRecord
from ..protocol.report import CheckpointCommit, FileName
from ..protocol.rest import ArtifactView, CheckpointList
from . import jobs
from .auth import Sender, only_rank
from .http import OCTET, Auth, ctx, operation, save_artifact, stream

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


def _format(job: JobRecord) -> CheckpointFormat:
    return files_of.format_for(job.spec.parallelism)


def _writers(job: JobRecord) -> int:
    return files_of.writers(job.spec.parallelism, job.world_size or 0)


def _committed(job: JobRecord, n: int) -> CheckpointEntry | None:
    return next((c for c in job.checkpoints if c.n == n), None)


def _not_committed_yet(job: JobRecord, n: int) -> None:
    """Conflict when checkpoint ``n`` (or a later one) is committed: a committed checkpoint never changes."""
    latest = job.latest_checkpoint
    if _committed(job, n) is not None or (latest is not None and n <= latest.n):
        raise Conflict(f"checkpoint {n} of job {job.id} is committed, or a later one is "
                       f"(latest: {latest.n if latest else n}): a committed checkpoint never changes, and numbers grow",
                       job_id=job.id)


def _uploaded(job: JobRecord, n: int, fmt: CheckpointFormat) -> dict[str, str]:
    """File name -> artifact id of the files of checkpoint ``n`` that the ranks of the job's
    current attempt uploaded, each by the rank it belongs to (the later of two uploads of a
    name wins)."""
    found = {}
    for artifact in ctx().store.list_artifacts(job.id, ArtifactKind.CHECKPOINT.value):
        name = artifact.get("name")
        if artifact.get("checkpoint") != n or artifact.get("attempt") != job.attempt or not isinstance(name, str):
            continue
        if artifact.get("rank") != files_of.owner(fmt, name, _writers(job)):
            continue  # sent by another rank than the one it belongs to (refused at upload since)
        found[name] = artifact["id"]
    return found


@operation(bp, "PUT", "/jobs/<job_id>/checkpoints/<n>/<name>", "Upload one file of checkpoint n",
           auth=Auth.JOB, body=OCTET, answer=ArtifactView, status=201, errors=(400, 409, 413, 422, 429),
           tag="checkpoints")
def put_checkpoint_file(job: JobRecord, sender: Sender, n: int, name: str):
    """A file of the job's checkpoint format (``torch`` for DDP: ``state.pt``, ``rng-<rank>.pt``,
    ``extra.pt``; ``shards`` for FSDP: ``shard-<rank>.safetensors`` and ``shard-<rank>.json``),
    sent by the rank it belongs to (``state.pt`` and ``extra.pt``: rank 0), with that rank's
    key; any other name is a 400, another rank's file a 403, and nothing is stored. Sent again
    before the commit, the later file wins; a committed checkpoint takes no more files (409).
    The rank and the attempt whose key sent it are kept with it."""
    _file_name(name)
    fmt, world = _format(job), _writers(job)
    owner = files_of.owner(fmt, name, world)
    if owner is None:
        raise BadRequest(f"path 'name': a {fmt.value} checkpoint of {world} rank(s) has no file {name!r}; it holds "
                         f"{files_of.describe(fmt, world)}", field="name")
    if owner != sender.rank:
        raise Forbidden(f"checkpoint file {name!r} is rank {owner}'s to send; this is rank {sender.rank}'s key",
                        job_id=job.id, rank=sender.rank)
    _not_committed_yet(job, n)
    return save_artifact({"id": job.room_id}, ArtifactKind.CHECKPOINT.value, job.id, checkpoint=n, name=name,
                         rank=sender.rank, attempt=sender.attempt), 201


@operation(bp, "POST", "/jobs/<job_id>/checkpoints/<n>/commit", "Commit checkpoint n (rank 0)",
           auth=Auth.JOB, body=CheckpointCommit, answer=CheckpointEntry, status=201, errors=(409,),
           tag="checkpoints")
def commit_checkpoint(job: JobRecord, sender: Sender, n: int, body: CheckpointCommit):
    """Rank 0's key only (403 for another rank's). Once every rank uploaded its files, checkpoint ``n`` is complete; older ones beyond the
    job's ``keep_checkpoints`` are deleted. Refused (400, nothing changes): a ``format`` other
    than the job's (the server decides it: ``torch`` for DDP, ``shards`` for FSDP); ``files``
    that are not exactly those the format requires of the attempt's ranks (``missing`` lists
    those it lacks), or that the ranks of the current attempt did not upload (``missing``).
    Refused with 409: a number not above the latest committed one, a job no longer running."""
    only_rank(sender, 0, "committing a checkpoint", job.id)
    fmt, world = _format(job), _writers(job)
    if body.format is not None and body.format != fmt:
        raise BadRequest(f"field 'format': a {job.spec.parallelism.value} job's checkpoints are {fmt.value!r} (the server "
                         f"decides the format from the job), not {body.format.value!r}", field="format")
    _not_committed_yet(job, n)
    named, required = set(body.files), files_of.required(fmt, world)
    unknown = sorted(named - required - files_of.optional(fmt))
    if unknown:
        raise BadRequest(f"field 'files': a {fmt.value} checkpoint of {world} rank(s) has no file(s) {', '.join(unknown)}; "
                         f"it holds {files_of.describe(fmt, world)}", field="files", unknown=unknown)
    lacking = sorted(required - named)
    if lacking:
        raise BadRequest(f"field 'files': checkpoint {n} lacks {', '.join(lacking)}: a {fmt.value} checkpoint of {world} "
                         f"rank(s) holds {files_of.describe(fmt, world)}", field="files", missing=lacking)
    files = _uploaded(job, n, fmt)
    missing = sorted(name for name in named if name not in files)
    if missing:
        raise BadRequest(f"checkpoint {n} lacks uploaded file(s) {', '.join(missing)} (from the ranks of attempt "
                         f"{job.attempt})", field="files", missing=missing)
    entry = CheckpointEntry.model_validate({
        **body.model_dump(exclude={"files", "format"}, exclude_none=True), "format": fmt, "n": n, "world_size": world,
        "attempt": job.attempt, "files": {name: files[name] for name in sorted(named)}, "at": time.time()})
    kept = jobs.checkpoint_committed(ctx(), job, entry)
    if kept is None:
        raise Conflict(f"job {job.id} is {job.status.value}: it commits no checkpoint", job_id=job.id)
    _forget_older(job.id, n, kept)
    return entry, 201


def _forget_older(job_id: str, n: int, kept: list[CheckpointEntry]) -> None:
    """Delete the checkpoint files up to ``n`` that no kept checkpoint holds: older checkpoints,
    files sent twice, an earlier attempt's. Later numbers may be on their way: they stay."""
    held = {artifact_id for entry in kept for artifact_id in entry.files.values()}
    for artifact in ctx().store.list_artifacts(job_id, ArtifactKind.CHECKPOINT.value):
        number = artifact.get("checkpoint")
        if artifact["id"] not in held and (not isinstance(number, int) or number <= n):
            ctx().artifacts.delete(artifact["id"])
            ctx().store.delete_artifact(artifact["id"])


@operation(bp, "GET", "/jobs/<job_id>/checkpoints", "A job's committed checkpoints", answer=CheckpointList,
           tag="checkpoints")
def list_checkpoints(job: JobRecord):
    return CheckpointList(job_id=job.id, checkpoints=job.checkpoints)


@operation(bp, "GET", "/jobs/<job_id>/checkpoints/<n>/<name>", "Download one file of checkpoint n",
           auth=Auth.ROOM_OR_JOB, answer=OCTET, tag="checkpoints")
def get_checkpoint_file(job: JobRecord, n: int, name: str):
    """A file of a committed checkpoint, as committed: a submitter token of the room, or a rank
    key of the job (a resumed rank reads the checkpoint it goes on from)."""
    entry = _committed(job, n)
    artifact_id = entry.files.get(name) if entry is not None else None
    artifact = ctx().store.get_artifact(artifact_id) if artifact_id else None
    if artifact is None or artifact.get("job_id") != job.id or artifact.get("kind") != ArtifactKind.CHECKPOINT.value:
        raise NotFound(f"job {job.id} has no committed checkpoint {n} file {name}", job_id=job.id)
    return stream(artifact)
