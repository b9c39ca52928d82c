"""Who is asking: room tokens (held by submitters and GPU clients) and job keys (held by the
GPU clients running one job). Both are random secrets stored only as sha256 hashes."""
from __future__ import annotations

import hashlib
import hmac
import secrets

from flask import current_app, request

from .. import defaults
from ..errors import AuthError, Forbidden, NotFound
from ..protocol.job import Job as JobRecord


def new_secret(prefix: str) -> str:
    return f"{prefix}_{secrets.token_urlsafe(32)}"


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def room_for_token(token: str | None) -> dict:
    """The room this token opens, or AuthError. Rooms never change once created, so each
    server process asks the store once per room (a token not recognised is asked every time)."""
    if not token:
        raise AuthError(f"this call needs a room token in the {defaults.TOKEN_HEADER} header")
    ctx = current_app.extensions["zwdx"]
    token_hash = hash_secret(token.strip())
    room = ctx.rooms.get(token_hash)
    if room is None:
        room = ctx.store.find_room_by_token_hash(token_hash)
        if room is None:
            raise AuthError("room token not recognised: no room has this token")
        ctx.rooms[token_hash] = room
    return room


def request_room() -> dict:
    """The room of the token on the current request."""
    token = request.headers.get(defaults.TOKEN_HEADER)
    if token is None:
        auth = request.headers.get("Authorization", "")
        if auth.lower().startswith("bearer "):
            token = auth[7:]
    return room_for_token(token)


def job_in_room(job_id: str, room: dict) -> JobRecord:
    """The job, if it belongs to the room; NotFound otherwise (never leak other rooms' jobs)."""
    job = current_app.extensions["zwdx"].store.get_job(job_id)
    if job is None or job.room_id != room["id"]:
        raise NotFound(f"no job {job_id} in this room", job_id=job_id)
    return job


def request_job_key(job: JobRecord) -> None:
    """Check the job key on the current request (GPU clients writing into a job)."""
    key = request.headers.get(defaults.JOB_KEY_HEADER)
    if not key:
        raise AuthError(f"this call needs the job key in the {defaults.JOB_KEY_HEADER} header",
                        job_id=job.id)
    if not job.job_key_hash or not hmac.compare_digest(hash_secret(key), job.job_key_hash):
        raise Forbidden("job key does not match this job", job_id=job.id)
