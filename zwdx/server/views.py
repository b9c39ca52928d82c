"""What the API shows of stored documents: secrets and internals removed."""
from __future__ import annotations

_JOB_HIDDEN = {"job_key_hash"}
_CLIENT_HIDDEN = {"sid", "modules"}  # modules: hundreds of names, for the scheduler only


def job_view(job: dict) -> dict:
    return {k: v for k, v in job.items() if k not in _JOB_HIDDEN}


def client_view(client: dict) -> dict:
    return {k: v for k, v in client.items() if k not in _CLIENT_HIDDEN}


def room_view(room: dict) -> dict:
    return {"id": room["id"], "name": room["name"], "created_at": room["created_at"]}
