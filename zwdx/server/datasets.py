"""A room's datasets (``zwdx data push|list|show|rm``) and how a job's GPU clients fetch them.

A push (``zwdx.datasets``) cuts a folder's files into chunks, asks which of them the room lacks
(``POST /datasets/chunks/missing``), uploads those (``PUT /datasets/chunks/<sha256>``, checked
against that sha256; a chunk the room has is answered 200, unread: an interrupted push resumes
where it stopped), then adds the version (``POST /datasets``, its manifest: refused while a
chunk it names is missing or a file's chunks do not add up to its size). ``manifests.py`` says
how they are kept; every byte counts against the room's ``ROOM_MAX_ARTIFACT_BYTES``.

A job pins each dataset's newest version at submit (``api.create_job``). Its GPU clients fetch
the manifest (``GET /jobs/<id>/datasets/<version>``) and the chunks (``.../chunks/<sha256>``)
with one of the job's rank keys, and only those the job pins: a donor reads the datasets of the
jobs it runs, no other. Every chunk served is counted (``zwdx_dataset_bytes_served``, ``/metrics``).
"""
from __future__ import annotations

import io
import logging
import re
import time
import uuid

from flask import Blueprint, request

from .. import defaults
from ..errors import BadRequest, Conflict, IntegrityError, NotFound, PayloadTooLarge
from ..protocol import ACTIVE, WAITING
from ..protocol.dataset import (ChunkQuery, DatasetList, DatasetRemoved, DatasetView, Manifest, MissingChunks,
                                valid_name)
from ..protocol.job import Job as JobRecord
from ..protocol.rest import ArtifactView
from .settings import settings
from . import limits, manifests, meters
from .http import OCTET, Auth, ctx, operation, save_artifact, stream

log = logging.getLogger(__name__)

bp = Blueprint("datasets", __name__)

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _sha(value: str, field: str) -> str:
    if not _SHA256.match(value):
        raise BadRequest(f"path '{field}' must be a sha256: 64 lowercase hex digits, got {value[:80]!r}", field=field)
    return value


def _name(value: str) -> str:
    if not valid_name(value):
        raise BadRequest(f"path 'name' must be a dataset name (letters, digits, '.', '_', '-'; 64 at most, a letter "
                         f"or digit first), got {value[:80]!r}", field="name")
    return value


# -- pushing ---------------------------------------------------------------------------------------
@operation(bp, "POST", "/datasets/chunks/missing", "Which of these dataset chunks the room lacks", body=ChunkQuery,
           answer=MissingChunks, tag="datasets")
def missing_chunks(room: dict, body: ChunkQuery):
    """The chunks (sha256s) of the question the room has none of, in the question's order."""
    have = {a["sha256"] for a in ctx().store.list_room_artifacts(room["id"], manifests.CHUNK)}
    return MissingChunks(missing=list(dict.fromkeys(c for c in body.chunks if c not in have)))


@operation(bp, "PUT", "/datasets/chunks/<digest>", "Upload a dataset chunk (its bytes)", body=OCTET,
           answer=ArtifactView, status=201, answers={200: ArtifactView}, errors=(400, 413, 422, 429), tag="datasets")
def put_chunk(room: dict, digest: str):
    """The bytes must have that sha256 (422 and nothing kept when they do not). A chunk the room
    has already is answered 200, unread."""
    sha256 = _sha(digest, "digest")
    if request.headers.get(defaults.SHA256_HEADER, sha256).lower() != sha256:
        raise BadRequest(f"header {defaults.SHA256_HEADER} must be the path's sha256", field=defaults.SHA256_HEADER)
    found = ctx().store.find_artifact(room["id"], manifests.CHUNK, sha256)
    if found is not None:
        return ArtifactView.model_validate(found), 200
    saved = save_artifact(room, manifests.CHUNK)
    if saved.sha256 != sha256:
        ctx().store.delete_artifact(saved.id)
        ctx().artifacts.delete(saved.id)
        raise IntegrityError(f"chunk sha256 mismatch: the path says {sha256}, received {saved.sha256}",
                             expected=sha256, received=saved.sha256)
    return saved, 201


@operation(bp, "POST", "/datasets", "Add a version of a dataset, once the room has its chunks", body=Manifest,
           answer=DatasetView, status=201, answers={200: DatasetView}, errors=(429,), tag="datasets")
def create_version(room: dict, body: Manifest):
    """The manifest names every file by relative path with its size, sha256 and chunks; each chunk
    must be the room's already (400 ``missing`` lists those that are not) and a file's chunks must
    add up to its size. The same files under the same name again: that version, answered 200."""
    store = ctx().store
    sizes = {a["sha256"]: int(a["size"]) for a in store.list_room_artifacts(room["id"], manifests.CHUNK)}
    missing = list(dict.fromkeys(c for f in body.files for c in f.chunks if c not in sizes))
    if missing:
        raise BadRequest(f"field 'files': {len(missing)} chunk(s) the manifest names are not in this room, "
                         f"{missing[0]} first: upload them (PUT /api/v1/datasets/chunks/<sha256>)", field="files",
                         missing=missing[:1000])
    for i, f in enumerate(body.files):
        if sum(sizes[c] for c in f.chunks) != f.size:
            raise BadRequest(f"field 'files.{i}.size': the chunks of {f.path!r} hold "
                             f"{sum(sizes[c] for c in f.chunks)} bytes, not {f.size}", field=f"files.{i}.size")
    version = body.version()
    for record in manifests.versions(store, room["id"], body.name):
        if record["sha256"] == version:
            return _view(room["id"], body.name), 200
    raw = body.canonical()
    allowed, by_quota = limits.artifact_allowance(room["id"], settings().max_artifact_bytes)
    if len(raw) > allowed:
        raise limits.artifact_quota_exceeded(room["id"], len(raw)) if by_quota else \
            PayloadTooLarge(f"the manifest is larger than the limit of {allowed} bytes", limit=allowed)
    artifact_id = uuid.uuid4().hex
    size, sha = ctx().artifacts.save(artifact_id, io.BytesIO(raw), len(raw), version)
    record = {"id": artifact_id, "room_id": room["id"], "kind": manifests.VERSION, "size": size, "sha256": sha,
              "job_id": None, "created_at": time.time(), "name": body.name, "data_size": body.size,
              "files": len(body.files)}
    try:
        store.add_artifact(record)
    except BaseException:
        ctx().artifacts.delete(artifact_id)
        raise
    log.info("room %s: dataset %s version %s (%d files, %d bytes)", room["id"], body.name, version[:12],
             len(body.files), body.size)
    return _view(room["id"], body.name), 201


# -- reading and removing --------------------------------------------------------------------------
def _view(room_id: str, name: str, files: bool = False) -> DatasetView:
    found = manifests.versions(ctx().store, room_id, name)
    if not found:
        raise NotFound(f"this room has no dataset {name!r}", dataset=name)
    views = [manifests.view(r) for r in found]
    manifest = manifests.describe(manifests.read(ctx().artifacts, found[0])) if files else None
    return DatasetView(name=name, latest=views[0], versions=views, manifest=manifest)


@operation(bp, "GET", "/datasets", "The room's datasets", answer=DatasetList, tag="datasets")
def list_datasets(room: dict):
    """Each dataset with its versions, the newest first; datasets by name."""
    names = sorted({r["name"] for r in manifests.versions(ctx().store, room["id"])})
    return DatasetList(datasets=[_view(room["id"], n) for n in names])


@operation(bp, "GET", "/datasets/<name>", "A dataset: its versions, and its newest version's files",
           answer=DatasetView, errors=(400, 404), tag="datasets")
def get_dataset(room: dict, name: str):
    return _view(room["id"], _name(name), files=True)


@operation(bp, "DELETE", "/datasets/<name>", "Remove a dataset (every version)", answer=DatasetRemoved,
           errors=(400, 404, 409), tag="datasets")
def remove_dataset(room: dict, name: str):
    """Every version goes, and the chunks no other dataset of the room names. Refused (409) while
    a job waiting or running pins one of its versions."""
    store, artifacts = ctx().store, ctx().artifacts
    found = manifests.versions(store, room["id"], _name(name))
    if not found:
        raise NotFound(f"this room has no dataset {name!r}", dataset=name)
    pinned = {r["sha256"] for r in found}
    for job in store.list_jobs(room["id"], statuses=[*WAITING, *ACTIVE]):
        if any(p.version in pinned for p in job.spec.datasets):
            raise Conflict(f"job {job.id} ({job.status.value}) uses dataset {name!r}: cancel it, or wait for it to "
                           f"end, before removing the dataset", job_id=job.id, dataset=name)
    keep: set[str] = set()
    for record in manifests.versions(store, room["id"]):
        if record["name"] != name:
            keep |= manifests.chunks_of(artifacts, record)
    freed = 0
    for record in found + [c for c in store.list_room_artifacts(room["id"], manifests.CHUNK)
                           if c["sha256"] not in keep]:
        if store.delete_artifact(record["id"]):
            artifacts.delete(record["id"])
            freed += int(record["size"])
    log.info("room %s: dataset %s removed (%d version(s), %d bytes freed)", room["id"], name, len(found), freed)
    return DatasetRemoved(name=name, versions=len(found), bytes_freed=freed)


# -- a job's GPU clients ---------------------------------------------------------------------------
def _pinned(job: JobRecord, version: str) -> dict:
    """The version's record, if the job pins it (and it is still the room's)."""
    _sha(version, "version")
    if not any(p.version == version for p in job.spec.datasets):
        raise NotFound(f"job {job.id} uses no dataset version {version}", job_id=job.id, version=version)
    record = ctx().store.find_artifact(job.room_id, manifests.VERSION, version)
    if record is None:
        raise NotFound(f"dataset version {version} of job {job.id} was removed from the room", job_id=job.id,
                       version=version)
    return record


@operation(bp, "GET", "/jobs/<job_id>/datasets/<version>", "The manifest of a dataset version the job uses",
           auth=Auth.JOB, answer=Manifest, errors=(400,), tag="ranks")
def get_job_manifest(job: JobRecord, version: str):
    """For the job's GPU clients (any rank's key): the files and chunks of a version it pins."""
    return manifests.read(ctx().artifacts, _pinned(job, version))


@operation(bp, "GET", "/jobs/<job_id>/datasets/<version>/chunks/<digest>",
           "A chunk of a dataset version the job uses", auth=Auth.JOB, answer=OCTET, errors=(400,), tag="ranks")
def get_job_chunk(job: JobRecord, version: str, digest: str):
    """Only a chunk the version names; its bytes are counted as served."""
    record = _pinned(job, version)
    sha256 = _sha(digest, "digest")
    if sha256 not in manifests.chunks_of(ctx().artifacts, record):
        raise NotFound(f"dataset version {version} has no chunk {sha256}", version=version, sha256=sha256)
    chunk = ctx().store.find_artifact(job.room_id, manifests.CHUNK, sha256)
    if chunk is None:
        raise NotFound(f"chunk {sha256} is not in the room", sha256=sha256)
    meters.dataset_served(job.room_id, int(chunk["size"]))
    return stream(chunk)
