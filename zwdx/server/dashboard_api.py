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

from flask import Blueprint, current_app, jsonify, request

from .. import defaults
from ..errors import BadRequest
from ..protocol import FINISHED, EventKind, JobStatus
from ..protocol.job import Job as JobRecord
from .auth import request_room

bp = Blueprint("dashboard_api", __name__)
P = defaults.API_PREFIX

#: Mean throughput of finished jobs (they report no more), per server process.
_CACHE_KEY = "zwdx.dashboard.throughput"


def mean_throughput(store, job: JobRecord) -> float | None:
    values = [ev["data"]["throughput"] for ev in store.get_events(job.id, kind=EventKind.METRIC.value)
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


def summary(store, job: JobRecord) -> dict:
    start = job.running_at or job.started_at
    end = job.ended_at
    return {"id": job.id, "name": job.name, "status": job.status.value,
            "created_at": job.created_at, "started_at": job.started_at,
            "running_at": job.running_at, "ended_at": end,
            "duration": end - start if start and end else None,
            "final_loss": job.final_loss, "result": first_result(job), "world_size": job.world_size,
            "requested_world_size": job.spec.world_size, "parallelism": job.spec.parallelism.value,
            "epochs": job.spec.epochs, "mean_throughput": _cached_throughput(store, job),
            "reason": job.reason}


@bp.get(f"{P}/dashboard/history")
def history():
    room = request_room()
    known = {s.value for s in JobStatus}
    asked = request.args.get("status")
    statuses = [s for s in asked.split(",") if s] if asked else [s.value for s in FINISHED]
    wrong = [s for s in statuses if s not in known]
    if wrong:
        raise BadRequest(f"query 'status' must be a comma-separated list of {', '.join(sorted(known))}; "
                         f"got {', '.join(wrong)}", field="status")
    store = current_app.extensions["zwdx"].store
    return jsonify({"jobs": [summary(store, job) for job in store.list_jobs(room["id"], statuses)]})
