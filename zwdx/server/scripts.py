"""What script jobs (``zwdx run``, ``zwdx.protocol.script``) add to the API: their working dirs
and their outputs, both plain archives the server stores and never opens.

- A working dir is the room's, found by its sha256: ``GET /workdirs/<digest>`` says whether the
  room has it, ``PUT /workdirs/<digest>`` uploads it (checked against that sha256), so an
  unchanged tree is uploaded once and any number of the room's jobs run it. The sweeper keeps
  it while a job that keeps its artifacts names it, or while it was uploaded or used within
  ``UNATTACHED_GRACE``.
- A job's outputs are the files its rank 0's script wrote under ``$ZWDX_OUTPUT_DIR``, one tar
  uploaded by rank 0 (``PUT /jobs/<id>/outputs``, its rank key) as the script ends, read by
  the submitter (``GET /jobs/<id>/outputs``). A resumed job's last attempt's outputs win.
"""
from __future__ import annotations

import logging
import re

from flask import Blueprint, request

from .. import defaults
from ..errors import BadRequest, IntegrityError, NotFound
from ..protocol import ArtifactKind
from ..protocol.job import Job as JobRecord
from ..protocol.rest import ArtifactView
from .auth import Sender, only_rank
from .http import OCTET, Auth, ctx, job_artifact, operation, save_artifact, stream
from . import jobs

log = logging.getLogger(__name__)

bp = Blueprint("scripts", __name__)

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _digest(sha256: str) -> str:
    if not _SHA256.match(sha256):
        raise BadRequest(f"path 'digest' must be a sha256: 64 lowercase hex digits, got {sha256[:80]!r}",
                         field="digest")
    return sha256


# -- working dirs ----------------------------------------------------------------------------------
@operation(bp, "GET", "/workdirs/<digest>", "Whether the room has a working dir of that sha256 (digest)",
           answer=ArtifactView, errors=(400, 404), tag="scripts")
def get_workdir(room: dict, digest: str):
    """The room's working dir with those bytes (its ``id`` is what a script job names as its
    ``bundle_artifact``), or 404: upload it with ``PUT``."""
    sha256 = _digest(digest)
    found = ctx().store.find_artifact(room["id"], ArtifactKind.WORKDIR.value, sha256)
    if found is None:
        raise NotFound(f"this room has no working dir {sha256}", sha256=sha256)
    return ArtifactView.model_validate(found)


@operation(bp, "PUT", "/workdirs/<digest>", "Upload a script job's working dir (a gzipped tar)", body=OCTET,
           answer=ArtifactView, status=201, answers={200: ArtifactView}, errors=(400, 413, 422, 429), tag="scripts")
def put_workdir(room: dict, digest: str):
    """The bytes must have that sha256 (422 and nothing kept when they do not; ``X-Zwdx-Sha256``,
    if sent, must say the same). A working dir the room has already is answered 200, unread."""
    sha256 = _digest(digest)
    if request.headers.get(defaults.SHA256_HEADER, sha256).lower() != sha256:
        raise BadRequest(f"header {defaults.SHA256_HEADER} must be the path's sha256", field=defaults.SHA256_HEADER)
    found = ctx().store.find_artifact(room["id"], ArtifactKind.WORKDIR.value, sha256)
    if found is not None:
        return ArtifactView.model_validate(found), 200
    saved = save_artifact(room, ArtifactKind.WORKDIR.value)
    if saved.sha256 != sha256:  # no header to check it on the way in: checked now, and nothing kept
        ctx().store.delete_artifact(saved.id)
        ctx().artifacts.delete(saved.id)
        raise IntegrityError(f"working dir sha256 mismatch: the path says {sha256}, received {saved.sha256}",
                             expected=sha256, received=saved.sha256)
    log.info("room %s: working dir %s uploaded (%d bytes)", room["id"], sha256[:12], saved.size)
    return saved, 201


# -- outputs -----------------------------------------------------------------------------------------
@operation(bp, "PUT", "/jobs/<job_id>/outputs", "Upload a script job's outputs (rank 0, a tar)", auth=Auth.JOB,
           body=OCTET, answer=ArtifactView, status=201, errors=(413, 422, 429), tag="ranks", late=True)
def put_outputs(job: JobRecord, sender: Sender):
    """Rank 0's key only; also for a moment after the job failed (a failed script's outputs
    are kept too). They replace an earlier attempt's."""
    only_rank(sender, 0, "uploading the outputs", job.id)
    saved = save_artifact({"id": job.room_id}, ArtifactKind.OUTPUT.value, job.id, attempt=sender.attempt)
    jobs.outputs_uploaded(ctx(), job, saved.id)
    return saved, 201


@operation(bp, "GET", "/jobs/<job_id>/outputs", "Download a script job's outputs (a tar)", answer=OCTET,
           tag="scripts")
def get_outputs(job: JobRecord):
    """What rank 0's script wrote under ``$ZWDX_OUTPUT_DIR``; 404 when it wrote nothing (or
    has not ended yet)."""
    artifact = job_artifact(job, job.outputs_artifact, ArtifactKind.OUTPUT.value) if job.outputs_artifact else None
    if artifact is None:
        raise NotFound(f"job {job.id} has no outputs (status {job.status.value})", job_id=job.id,
                       status=job.status.value)
    return stream(artifact)
