"""REST routes that only the dashboard uses.

    GET /api/v1/dashboard/history[?status=completed,failed]
        -> {"jobs": [{id, name, status, created_at, started_at, running_at, ended_at, duration,
                      final_loss, result, world_size, requested_world_size, parallelism, epochs,
                      mean_throughput, reason}]}

The history is the room's finished jobs (or those of the given statuses) in submission order.
``mean_throughput`` is the mean of the job's "throughput" metric events (samples/s, reported
by rank 0), None when it reported none; ``duration`` runs from the first running moment (or
the start) to the end. ``result`` is the job's headline figure, ``{"name", "value"}``: its final
loss when it has one, else the first number among its ``results`` (train_func's, then
eval_func's), None when there is none; ``name`` is what the submitter named the job ("" if nothing).
"""
from __future__ import annotations

import math

from flask import Blueprint, current_app

from ..protocol import FINISHED, EventKind, JobKind
from ..protocol.job import Job as JobRecord
from ..protocol.rest import HistoryAnswer, HistoryQuery
from . import series
from .http import ctx, operation

bp = Blueprint("dashboard_api", __name__)

#: Mean throughput of finished jobs (they report no more), per server process.
_CACHE_KEY = "zwdx.dashboard.throughput"


def mean_throughput(store, job: JobRecord) -> float | None:
    values = [ev["data"]["throughput"] for ev in series.every_event(store, job.id, EventKind.METRIC.value)
              if isinstance(ev.get("data"), dict) and isinstance(ev["data"].get("throughput"), (int, float))]
    return sum(values) / len(values) if values else None


def _cached_throughput(store, job: JobRecord) -> float | None:
    if job.status not in FINISHED:
        return mean_throughput(store, job)
    cache = current_app.extensions.setdefault(_CACHE_KEY, {})
    if job.id not in cache:
        cache[job.id] = mean_throughput(store, job)
    return cache[job.id]


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def first_result(job: JobRecord) -> dict | None:
    """The final loss, else the first numeric result, as ``{"name", "value"}``; or None."""
    if _number(job.final_loss):
        return {"name": "loss", "value": job.final_loss}
    for name, value in (job.results or {}).items():
        if _number(value):
            return {"name": name, "value": value}
    return None


def _mode(job: JobRecord) -> str:
    """How the job trains, for the history: its parallelism, or "script" for a script job
    (whose script sets up its own)."""
    return "script" if job.spec.kind == JobKind.SCRIPT else job.spec.parallelism.value


def summary(store, job: JobRecord) -> dict:
    """A finished job's row of the history (``HistoryRow``)."""
    start = job.running_at or job.started_at
    end = job.ended_at
    return {"id": job.id, "name": job.name, "status": job.status.value,
            "created_at": job.created_at, "started_at": job.started_at,
            "running_at": job.running_at, "ended_at": end,
            "duration": end - start if start and end else None,
            "final_loss": job.final_loss, "result": first_result(job), "world_size": job.world_size,
            "requested_world_size": job.spec.resources.world_size, "parallelism": _mode(job),
            "epochs": job.spec.training.epochs, "mean_throughput": _cached_throughput(store, job),
            "reason": job.reason}


@operation(bp, "GET", "/dashboard/history", "The room's finished jobs, for the dashboard", query=HistoryQuery,
           answer=HistoryAnswer, tag="dashboard")
def history(room: dict, query: HistoryQuery):
    """Every finished status by default; ``status`` picks others (comma-separated)."""
    statuses = [s for s in query.status.split(",") if s] if query.status else [s.value for s in FINISHED]
    store = ctx().store
    return HistoryAnswer.model_validate({"jobs": [summary(store, job) for job in store.list_jobs(room["id"], statuses)]})
