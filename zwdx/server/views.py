"""What the API shows of stored records, as the answers of ``zwdx.protocol``: secrets and
internals removed; a job's failures by rank with ``failure_order`` (``JobView``)."""
from __future__ import annotations

import time

from ..protocol.job import Job as JobRecord, JobView, Submitted
from ..protocol.rest import RoomView
from .placement import apart_from

_CLIENT_HIDDEN = {"sid", "modules", "lost_after", "secret_hash", "server"}  # modules: hundreds of names, for the scheduler only


def job_view(job: JobRecord, **extra) -> JobView:
    """The job for the REST API and the dashboards; ``extra``: ``queue_position``."""
    return JobView.of(job, **extra)


def submitted_view(job: JobRecord, unschedulable: str | None) -> Submitted:
    """The answer to a submit: the job, and why the room as it is could never run it (or None)."""
    return Submitted.of(job, unschedulable=unschedulable)


def client_view(client: dict, now: float | None = None) -> dict:
    """A GPU client's document without what only the server uses (``ClientView`` declares the
    rest); ``unreachable`` as the peers it is kept apart from now (``reach.py``)."""
    view = {k: v for k, v in client.items() if k not in _CLIENT_HIDDEN}
    view["unreachable"] = apart_from(client, time.time() if now is None else now)
    return view


def room_view(room: dict) -> RoomView:
    return RoomView(id=room["id"], name=room["name"], created_at=room["created_at"],
                    client_retention=room.get("client_retention"))


def named_clients(store, room_id: str) -> dict[str, list[str]]:
    """GPU client id -> the room's jobs that named it a suspect (``suspects.py``: DILOCO's rounds,
    the spot and step checks, the weights check), each job once."""
    out: dict[str, list[str]] = {}
    for job in store.list_jobs(room_id):
        for suspect in job.suspects.values():
            if suspect.client_id and job.id not in out.setdefault(suspect.client_id, []):
                out[suspect.client_id].append(job.id)
    return out
