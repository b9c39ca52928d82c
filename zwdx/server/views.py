"""What the API shows of stored records: secrets and internals removed; a job's failures by
rank with ``failure_order`` (``zwdx.protocol.job.JobView``)."""
from __future__ import annotations

from ..protocol.job import Job as JobRecord, JobView, Submitted

_CLIENT_HIDDEN = {"sid", "modules"}  # modules: hundreds of names, for the scheduler only


def job_view(job: JobRecord, **extra) -> dict:
    """The job as JSON for the REST API and the dashboards; ``extra``: ``queue_position``."""
    return JobView.of(job, **extra).model_dump(mode="json")


def submitted_view(job: JobRecord, unschedulable: str | None) -> dict:
    """The answer to a submit: the job, and why the room as it is could never run it (or None)."""
    return Submitted.of(job, unschedulable=unschedulable).model_dump(mode="json")


def client_view(client: dict) -> dict:
    return {k: v for k, v in client.items() if k not in _CLIENT_HIDDEN}


def room_view(room: dict) -> dict:
    return {"id": room["id"], "name": room["name"], "created_at": room["created_at"]}
