"""What the HTTP routes share: the server's context, the request's JSON body and its typed
fields, artifact bytes in and out, and the job a rank process writes into.

    ctx()                       -> ServerContext of the current app (config, store, artifacts, scheduler)
    json_body()                 -> the body as a dict, or BadRequest
    field(body, name, kind)     -> one field of the body, type-checked, or BadRequest naming it
    save_artifact(room, kind)   -> stores the request's streamed bytes (size and sha256 checked)
    stream(artifact)            -> a streamed response of an artifact's bytes
    rank_job(job_id)            -> the job, after the room token and the job key are checked
"""
from __future__ import annotations

import time
import uuid

from flask import Response, current_app, request

from .. import defaults
from ..errors import BadRequest, NotFound
from .auth import job_in_room, request_job_key, request_room

#: Where every REST route lives.
P = defaults.API_PREFIX


def ctx():
    """The ``ServerContext`` of the current app (``app.extensions["zwdx"]``)."""
    return current_app.extensions["zwdx"]


def json_body() -> dict:
    body = request.get_json(silent=True)
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def field(body: dict, name: str, kind, required: bool = False, default=None):
    """``body[name]`` if it is a ``kind`` (a type or a tuple of types; a bool is no int), the
    ``default`` when it is missing or null; BadRequest naming the field otherwise."""
    value = body.get(name, default)
    if value is None:
        if required:
            raise BadRequest(f"field '{name}' is required", field=name)
        return default
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise BadRequest(f"field '{name}' must be {expected}, got {type(value).__name__}", field=name)
    return value


def save_artifact(room: dict, kind: str, job_id: str | None = None) -> dict:
    """Store the request's body as an artifact of the room (and the job): streamed to the
    artifact store within ``MAX_ARTIFACT_BYTES``, checked against the sha256 header if sent."""
    artifact_id = uuid.uuid4().hex
    size, sha = ctx().artifacts.save(artifact_id, request.stream, int(current_app.config["MAX_ARTIFACT_BYTES"]),
                                     request.headers.get(defaults.SHA256_HEADER))
    artifact = {"id": artifact_id, "room_id": room["id"], "kind": kind, "size": size, "sha256": sha,
                "job_id": job_id, "created_at": time.time()}
    return ctx().store.add_artifact(artifact)


def stream(artifact: dict) -> Response:
    """The artifact's bytes as a streamed response, with their size and sha256 in the headers."""
    try:
        chunks = ctx().artifacts.open(artifact["id"])
    except (FileNotFoundError, KeyError):
        raise NotFound(f"artifact {artifact['id']} has no bytes on this server", artifact_id=artifact["id"])
    headers = {"Content-Length": str(artifact["size"]), defaults.SHA256_HEADER: artifact["sha256"]}
    return Response(chunks, mimetype="application/octet-stream", headers=headers)


def rank_job(job_id: str) -> dict:
    """The job a rank process writes into: it must be in the token's room, and the request must
    carry the job's key."""
    job = job_in_room(job_id, request_room())
    request_job_key(job)
    return job
