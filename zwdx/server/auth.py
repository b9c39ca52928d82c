"""Who is asking, and what they may do (``zwdx.protocol.tokens`` names the secrets).

    submitter token (zs_)  REST routes of its room (``Auth.ROOM``) and dashboards on /ui
    donor token (zd_)      GPU clients on /gpu, and nothing else
    legacy token (zr_)     both, until rotated into a pair (a room made before roles)
    rank key (rk_)         the REST routes one rank of a running job writes and reads
                           (``Auth.JOB``), for its own rank only
    client secret (zc_)    proves a GPU client's id at register (``events.py``)

Every secret is stored only as its sha256 and compared by it. A token's record is read from
the store at most every ``CREDENTIAL_CACHE_S`` seconds per server process: one revoked or
rotated on this process stops working at once, on another one within that time.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
import uuid
from dataclasses import dataclass

from flask import current_app, request

from .. import defaults
from ..errors import AuthError, Forbidden, NotFound
from ..protocol import ACTIVE, CredentialRole, JobStatus
from ..protocol.job import Job as JobRecord
from ..protocol.tokens import DONOR_PREFIX, PREFIXES, SUBMITTER_PREFIX, role_of


def new_secret(prefix: str) -> str:
    return f"{prefix}_{secrets.token_urlsafe(32)}"


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class Caller:
    """A room's token, as the store knows it, and its room."""
    credential: dict
    room: dict

    @property
    def legacy(self) -> bool:
        return bool(self.credential.get("legacy"))

    @property
    def submits(self) -> bool:
        return self.credential.get("role") == CredentialRole.SUBMITTER.value

    @property
    def donates(self) -> bool:
        return self.credential.get("role") == CredentialRole.DONOR.value or self.legacy


class CredentialCache:
    """token hash -> (caller, read at), per server process (``ServerContext.credentials``)."""

    def __init__(self, ttl: float = defaults.CREDENTIAL_CACHE_S):
        self.ttl = ttl
        self._held: dict[str, tuple[Caller, float]] = {}
        self._lock = threading.Lock()

    def get(self, token_hash: str) -> Caller | None:
        with self._lock:
            held = self._held.get(token_hash)
        return held[0] if held and held[1] > time.monotonic() - self.ttl else None

    def put(self, token_hash: str, caller: Caller) -> None:
        with self._lock:
            if len(self._held) > 100_000:  # a flood of distinct tokens: forget, do not grow
                self._held.clear()
            self._held[token_hash] = (caller, time.monotonic())

    def forget(self, credential_id: str) -> None:
        """Drop what is held of this credential (it was revoked or rotated here)."""
        with self._lock:
            for token_hash in [h for h, (c, _) in self._held.items() if c.credential["id"] == credential_id]:
                del self._held[token_hash]


def caller_for_token(token: str | None) -> Caller:
    """The room token's record and room; ``AuthError`` when it opens nothing (none given, not
    known, or revoked)."""
    if not token or not isinstance(token, str):
        raise AuthError(f"this call needs a room token in the {defaults.TOKEN_HEADER} header")
    ctx = current_app.extensions["zwdx"]
    token_hash = hash_secret(token.strip())
    caller = ctx.credentials.get(token_hash)
    if caller is None:
        credential = ctx.store.find_credential(token_hash)
        room = ctx.store.get_room(credential["room_id"]) if credential else None
        if credential is None or room is None:
            raise AuthError("room token not recognised: no room has this token")
        caller = Caller(credential, room)
        ctx.credentials.put(token_hash, caller)
    if caller.credential.get("revoked_at") is not None:
        raise AuthError("room token revoked: it opens nothing any more (ask the room's owner for another)")
    return caller


def submitter(token: str | None) -> Caller:
    """A caller whose token submits (a submitter or a legacy token); ``Forbidden`` for a donor's."""
    caller = caller_for_token(token)
    if not caller.submits:
        raise Forbidden(f"this is a donor token: it connects GPU clients (zwdx gpu-client) and opens nothing "
                        f"else; submitting, reading jobs and the dashboard take the room's submitter token "
                        f"({SUBMITTER_PREFIX}_...)")
    return caller


def donor(token: str | None) -> Caller:
    """A caller whose token connects GPU clients (a donor or a legacy token); ``Forbidden`` for a
    submitter's."""
    caller = caller_for_token(token)
    if not caller.donates:
        raise Forbidden(f"this is a submitter token: GPU clients connect with the room's donor token "
                        f"({DONOR_PREFIX}_..., printed by `zwdx room create`, or `zwdx room tokens create --role "
                        f"donor`)")
    return caller


def request_token() -> str | None:
    """The room token on the current request: its header, or ``Authorization: Bearer``."""
    token = request.headers.get(defaults.TOKEN_HEADER)
    if token is None:
        auth = request.headers.get("Authorization", "")
        if auth.lower().startswith("bearer "):
            token = auth[7:]
    return token


def request_room() -> dict:
    """The room of the submitter token on the current request."""
    return submitter(request_token()).room


def job_in_room(job_id: str, room: dict) -> JobRecord:
    """The job, if it belongs to the room; NotFound otherwise (never leak other rooms' jobs)."""
    job = current_app.extensions["zwdx"].store.get_job(job_id)
    if job is None or job.room_id != room["id"]:
        raise NotFound(f"no job {job_id} in this room", job_id=job_id)
    return job


@dataclass(frozen=True)
class Sender:
    """The rank whose key a request carries: of the job's current attempt, placed on ``client_id``.
    ``live``: the job runs (False: it failed moments ago, see ``rank_sender``)."""
    rank: int
    client_id: str
    attempt: int
    live: bool = True


def rank_sender(job_id: str, key: str | None, late: bool = False) -> tuple[JobRecord, Sender]:
    """The job and the rank a rank key speaks for. The key must be one the server gave a rank of
    the job's current attempt, and the job must be starting or running; with ``late``, a job
    that failed less than ``FAILURE_REPORT_GRACE`` seconds ago still takes it (a rank's own
    failure and last log lines). ``AuthError`` without a key, ``Forbidden`` for any other: a
    job that does not exist reads as one the key does not open."""
    if not key or not isinstance(key, str):
        raise AuthError(f"this call needs the rank's key in the {defaults.RANK_KEY_HEADER} header")
    job = current_app.extensions["zwdx"].store.get_job(job_id)
    key_hash = hash_secret(key.strip())
    match = next((int(rank) for rank, held in (job.rank_keys.items() if job else ())
                  if hmac.compare_digest(key_hash, held.hash)), None)
    if match is None:
        hint = f" (that is a {role_of(key)})" if role_of(key) != "token" else ""
        raise Forbidden(f"this rank key opens no rank of job {job_id}'s current attempt{hint}", job_id=job_id)
    held = job.rank_keys[str(match)]
    sender = Sender(rank=match, client_id=held.client_id, attempt=held.attempt)
    if job.status in ACTIVE and held.attempt == job.attempt:
        return job, sender
    if late and job.status == JobStatus.FAILED and held.attempt == job.attempt and \
            time.time() < (job.ended_at or 0.0) + defaults.FAILURE_REPORT_GRACE:
        return job, Sender(sender.rank, sender.client_id, sender.attempt, live=False)
    raise Forbidden(f"job {job.id} is {job.status.value}: the keys of its ranks expired with it", job_id=job.id,
                    status=job.status.value)


def only_rank(sender: Sender, rank: int, what: str, job_id: str) -> None:
    """``Forbidden`` unless the request's key is rank ``rank``'s."""
    if sender.rank != rank:
        raise Forbidden(f"{what} takes rank {rank}'s key; this is rank {sender.rank}'s", job_id=job_id,
                        rank=sender.rank)


def issue_credential(store, room_id: str, role: CredentialRole, name: str = "") -> tuple[dict, str]:
    """A new token of the room: its record (stored, with the secret's hash) and the secret,
    which nothing keeps: the caller shows it once."""
    secret = new_secret(PREFIXES[role])
    credential = {"id": uuid.uuid4().hex[:12], "room_id": room_id, "role": role.value, "name": name,
                  "hash": hash_secret(secret), "created_at": time.time(), "rotated_at": None, "revoked_at": None,
                  "legacy": False}
    return store.add_credential(credential), secret
