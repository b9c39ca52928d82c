"""What the API shows of stored records, as the answers of ``zwdx.protocol``: secrets and
internals removed; a job's failures by rank with ``failure_order`` (``JobView``)."""
from __future__ import annotations

from ..protocol.job import Job as JobRecord, JobView, Submitted
from ..protocol.rest import RoomView

_CLIENT_HIDDEN = {"sid", "modules", "lost_after", "secret_hash"}  # modules: hundreds of names, for the scheduler only


def job_view(job: JobRecord, **extra) -> JobView:
    """The job for the REST API and the dashboards; ``extra``: ``queue_position``."""
    return JobView.of(job, **extra)


def submitted_view(job: JobRecord, unschedulable: str | None) -> Submitted:
    """The answer to a submit: the job, and why the room as it is could never run it (or None)."""
    return Submitted.of(job, unschedulable=unschedulable)


def client_view(client: dict) -> dict:
    """A GPU client's document without what only the server uses (``ClientView`` declares the rest)."""
    return {k: v for k, v in client.items() if k not in _CLIENT_HIDDEN}


def room_view(room: dict) -> RoomView:
    return RoomView(id=room["id"], name=room["name"], created_at=room["created_at"])
