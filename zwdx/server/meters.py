"""What this server process counts as it happens, for ``GET /metrics`` (``prometheus.py``).

    meters.request_done(method, route, status, seconds)   # after every REST request
    meters.job_placed(job, at)                             # queued|resuming -> starting
    meters.job_moved(job, to, at)                          # resuming, or an end

Counters and histograms of prometheus-client, in a registry of zwdx's own (several apps in one
test process share it: read them as differences). Labels stay bounded: a route's rule (never
its path), a status, a room id; never a job id. With several server processes each counts its
own, as Prometheus expects (it sums them).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from ..protocol import WAITING, JobStatus
from ..protocol.job import Job as JobRecord

REGISTRY = CollectorRegistry(auto_describe=True)

#: Seconds: a REST request (Flask's handling of it; Socket.IO is not a route).
REQUEST_SECONDS = Histogram(
    "zwdx_http_request_duration_seconds", "Time to answer a REST request", ["method", "route", "status"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=REGISTRY)

#: Seconds a job waited to be placed: from its submit (or its last loss of a GPU client) to its start.
WAIT_SECONDS = Histogram(
    "zwdx_job_wait_seconds", "Time a job waited in its room's queue before it was placed", ["room"],
    buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600, 24 * 3600), registry=REGISTRY)

#: Seconds from a job's submit to its end, by how it ended.
DURATION_SECONDS = Histogram(
    "zwdx_job_duration_seconds", "Time from a job's submit to its end", ["status"],
    buckets=(1, 5, 15, 60, 300, 900, 1800, 3600, 4 * 3600, 12 * 3600, 24 * 3600, 7 * 24 * 3600), registry=REGISTRY)

JOBS_ENDED = Counter("zwdx_jobs_ended", "Jobs that ended, by room and how", ["room", "status"], registry=REGISTRY)

RESTARTS = Counter("zwdx_job_restarts", "Times a job went back to waiting after losing a GPU client", ["room"],
                   registry=REGISTRY)

DATASET_BYTES = Counter("zwdx_dataset_bytes_served", "Bytes of dataset chunks sent to GPU clients", ["room"],
                        registry=REGISTRY)


def dataset_served(room_id: str, size: int) -> None:
    DATASET_BYTES.labels(room_id).inc(size)


def request_done(method: str, route: str, status: int, seconds: float) -> None:
    REQUEST_SECONDS.labels(method, route, str(status)).observe(seconds)


def job_placed(job: JobRecord, at: float) -> None:
    """A waiting job got its slots: how long it waited since it began to wait."""
    since = job.created_at
    for entry in reversed(job.timeline):
        if entry.status in WAITING:
            since = entry.at
            break
    WAIT_SECONDS.labels(job.room_id).observe(max(0.0, at - since))


def job_moved(job: JobRecord, to: JobStatus, at: float) -> None:
    """A job's status changed to ``to`` (only the moves that count: a restart or an end)."""
    if to == JobStatus.RESUMING:
        RESTARTS.labels(job.room_id).inc()
    elif to.finished:
        JOBS_ENDED.labels(job.room_id, to.value).inc()
        DURATION_SECONDS.labels(to.value).observe(max(0.0, at - job.created_at))
