"""The REST API under /api/v1, for the SDK, the dashboard and GPU clients' rank processes.

Callers prove who they are with a room token (header X-Zwdx-Room-Token); rank processes
writing into a job add its job key (X-Zwdx-Job-Key). Errors come back as
``{"error": {"code", "message", ...}}`` with the matching HTTP status.
"""
from __future__ import annotations

import logging
import time
import uuid

from flask import Blueprint, current_app, jsonify, request
from werkzeug.exceptions import HTTPException

from .. import defaults
from ..errors import BadRequest, Conflict, NotFound, Unschedulable, ZwdxError
from ..protocol import ACTIVE, SYSTEM_METRICS, ArtifactKind, EventKind, JobStatus, Parallelism
from ..protocol.base import parse
from ..protocol.job import Job as JobRecord, JobSpec, TimelineEntry
from . import lifecycle, notify
from .auth import hash_secret, job_in_room, new_secret, request_room
from .http import P, ctx, field, json_body, rank_job, save_artifact, stream
from .job import Job
from .placement import room_totals, unschedulable
from .views import client_view, job_view, room_view, submitted_view

log = logging.getLogger(__name__)

bp = Blueprint("api", __name__)


def register_error_handlers(app) -> None:
    @app.errorhandler(ZwdxError)
    def _zwdx_error(err: ZwdxError):
        return jsonify(err.to_dict()), err.http_status

    @app.errorhandler(HTTPException)
    def _http_error(err: HTTPException):
        if not request.path.startswith(P) and request.path != "/health":
            return err
        code = (err.name or "error").lower().replace(" ", "_")
        return jsonify({"error": {"code": code, "message": err.description}}), err.code

    @app.errorhandler(Exception)
    def _unexpected(err: Exception):
        log.exception("server: unexpected error on %s %s", request.method, request.path)
        return jsonify({"error": {"code": "internal", "message": f"{type(err).__name__}: {err}"}}), 500


def _module_name(name) -> bool:
    return isinstance(name, str) and len(name) <= defaults.MAX_MODULE_NAME and name.isidentifier()


# -- health -----------------------------------------------------------------------------------
@bp.get("/health")
def health():
    ok = ctx().store.ping()
    return jsonify({"status": "ok" if ok else "store unavailable", "store": type(ctx().store).__name__,
                    "async_mode": current_app.config["ASYNC_MODE"]}), 200 if ok else 503


# -- rooms ------------------------------------------------------------------------------------
@bp.post(f"{P}/rooms")
def create_room():
    body = request.get_json(silent=True) or {}
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    name = field(body, "name", str, default="") or f"room-{uuid.uuid4().hex[:6]}"
    if len(name) > 100:
        raise BadRequest("field 'name' must be at most 100 characters", field="name")
    token = new_secret("zr")
    room = {"id": uuid.uuid4().hex[:12], "name": name, "token_hash": hash_secret(token),
            "created_at": time.time()}
    ctx().store.create_room(room)
    log.info("room %s (%s): created", room["id"], name)
    return jsonify({**room_view(room), "token": token}), 201


@bp.get(f"{P}/room")
def get_room():
    room = request_room()
    clients = ctx().store.list_clients(room["id"])
    return jsonify({**room_view(room), "clients": [client_view(c) for c in clients], "totals": room_totals(clients)})


# -- artifacts --------------------------------------------------------------------------------
@bp.post(f"{P}/artifacts")
def upload_bundle():
    """A job bundle, uploaded by the SDK before it creates the job."""
    room = request_room()
    return jsonify(save_artifact(room, ArtifactKind.BUNDLE.value)), 201


@bp.get(f"{P}/artifacts/<artifact_id>")
def download_artifact(artifact_id: str):
    room = request_room()
    artifact = ctx().store.get_artifact(artifact_id)
    if artifact is None or artifact["room_id"] != room["id"]:
        raise NotFound(f"no artifact {artifact_id} in this room", artifact_id=artifact_id)
    return stream(artifact)


# -- jobs -------------------------------------------------------------------------------------
@bp.post(f"{P}/jobs")
def create_job():
    room = request_room()
    body = json_body()
    parallelism = field(body, "parallelism", str, default="DDP").upper()
    if parallelism not in {p.value for p in Parallelism}:
        raise BadRequest(f"field 'parallelism' must be one of DDP, FSDP, got {parallelism!r}", field="parallelism")
    epochs = field(body, "epochs", int)  # None: the train function's own default wins (1 if it has none)
    if epochs is not None and epochs < 1:
        raise BadRequest("field 'epochs' must be at least 1 or null", field="epochs")
    world_size = field(body, "world_size", int)
    if world_size is not None and world_size < 1:
        raise BadRequest("field 'world_size' must be at least 1", field="world_size")
    memory = field(body, "memory_required", int, default=0)
    if memory < 0:
        raise BadRequest("field 'memory_required' must be >= 0 bytes", field="memory_required")
    versions = field(body, "versions", dict, required=True)
    if not isinstance(versions.get("python"), str):
        raise BadRequest("field 'versions.python' (the submitter's Python version) is required",
                         field="versions.python")
    bundle_id = field(body, "bundle_artifact", str, required=True)
    bundle = ctx().store.get_artifact(bundle_id)
    if bundle is None or bundle["room_id"] != room["id"] or bundle["kind"] != ArtifactKind.BUNDLE.value:
        raise BadRequest(f"field 'bundle_artifact': no uploaded bundle {bundle_id} in this room",
                         field="bundle_artifact")
    if bundle.get("job_id"):
        raise Conflict(f"bundle {bundle_id} already belongs to job {bundle['job_id']}")
    timeout = field(body, "collective_timeout", (int, float))
    min_world = field(body, "min_world_size", int)
    if min_world is not None and (min_world < 1 or (world_size is not None and min_world > world_size)):
        raise BadRequest("field 'min_world_size' must be at least 1 and at most world_size", field="min_world_size")
    max_restarts = field(body, "max_restarts", int, default=defaults.MAX_RESTARTS)
    if max_restarts < 0:
        raise BadRequest("field 'max_restarts' must be >= 0", field="max_restarts")
    keep = field(body, "keep_checkpoints", int, default=defaults.KEEP_CHECKPOINTS)
    if keep < 1:
        raise BadRequest("field 'keep_checkpoints' must be at least 1", field="keep_checkpoints")
    every_epoch = field(body, "checkpoint_every_epoch", bool, default=True)
    name = field(body, "name", str, default="")
    required = field(body, "required_modules", list, default=[])
    if len(required) > defaults.MAX_REQUIRED_MODULES or not all(_module_name(m) for m in required):
        raise BadRequest(f"field 'required_modules' must be a list of at most {defaults.MAX_REQUIRED_MODULES} "
                         f"top-level module names (Python identifiers)", field="required_modules")
    refuse = field(body, "fail_if_unschedulable", bool, default=False)
    now = time.time()
    spec = parse(JobSpec, {
        "parallelism": parallelism, "epochs": epochs, "world_size": world_size, "memory_required": memory,
        "versions": versions, "bundle_artifact": bundle_id, "bundle_sha256": bundle["sha256"],
        "bundle_size": bundle["size"], "collective_timeout": timeout, "min_world_size": min_world,
        "max_restarts": max_restarts, "keep_checkpoints": keep, "checkpoint_every_epoch": every_epoch,
        "required_modules": sorted(set(required))})
    job = JobRecord(id=uuid.uuid4().hex[:12], room_id=room["id"], status=JobStatus.QUEUED, name=name[:100],
                    created_at=now, spec=spec, timeline=[TimelineEntry(status=JobStatus.QUEUED, at=now)])
    reason = unschedulable(spec.model_dump(mode="json"), ctx().store.list_clients(room["id"]))
    if reason and refuse:  # nothing stored: not the job, not its bundle
        ctx().artifacts.delete(bundle_id)
        ctx().store.delete_artifact(bundle_id)
        log.info("job refused in room %s: %s", room["id"], reason)
        raise Unschedulable(f"the room cannot run this job as it is now: {reason}", reason=reason)
    job = Job.submit(ctx().store, job).record
    ctx().store.update_artifact(bundle_id, {"job_id": job.id})
    log.info("job %s: queued in room %s (%s, world size %s)", job.id, room["id"], parallelism,
             world_size or "all")
    notify.job_changed(job)
    ctx().scheduler.kick()
    return jsonify(submitted_view(job, reason)), 201


@bp.get(f"{P}/jobs")
def list_jobs():
    room = request_room()
    status = request.args.get("status")
    statuses = status.split(",") if status else None
    return jsonify({"jobs": [job_view(j) for j in ctx().store.list_jobs(room["id"], statuses)]})


@bp.get(f"{P}/jobs/<job_id>")
def get_job(job_id: str):
    job = job_in_room(job_id, request_room())
    extra = {}
    if job.status == JobStatus.QUEUED:  # 1 for the head of the room's queue
        extra["queue_position"] = ctx().store.count_jobs(job.room_id, [JobStatus.QUEUED], before_seq=job.seq) + 1
    view = job_view(job, **extra)
    if "events_after" in request.args:  # a waiting SDK: the job and its new events in one call
        try:
            after = int(request.args["events_after"])
        except ValueError:
            raise BadRequest("query 'events_after' must be an integer")
        view["events"] = ctx().store.get_events(job.id, after=after, limit=10000)
    return jsonify(view)


@bp.post(f"{P}/jobs/<job_id>/cancel")
def cancel_job(job_id: str):
    job = job_in_room(job_id, request_room())
    updated = lifecycle.cancel(ctx(), job.id)
    if updated is None:
        raise Conflict(f"job {job_id} already {job.status.value}", job_id=job_id, status=job.status.value)
    return jsonify(job_view(updated))


@bp.get(f"{P}/jobs/<job_id>/events")
def get_events(job_id: str):
    job = job_in_room(job_id, request_room())
    try:
        after = int(request.args.get("after", 0))
        limit = int(request.args.get("limit", 10000))
    except ValueError:
        raise BadRequest("query 'after' and 'limit' must be integers")
    kind = request.args.get("kind")
    events = ctx().store.get_events(job.id, after=after, kind=kind, limit=limit)
    return jsonify({"job_id": job.id, "events": events})


@bp.get(f"{P}/jobs/<job_id>/metrics")
def get_metrics(job_id: str):
    job = job_in_room(job_id, request_room())
    series: dict[str, list] = {name: [] for name in SYSTEM_METRICS}
    for ev in ctx().store.get_events(job.id, kind=EventKind.METRIC.value):
        for name, value in (ev.get("data") or {}).items():
            series.setdefault(name, []).append({"step": ev.get("step"), "value": value, "rank": ev.get("rank"),
                                                "ts": ev.get("ts")})
    return jsonify({"job_id": job.id, "series": series})


@bp.get(f"{P}/jobs/<job_id>/weights")
def get_weights(job_id: str):
    job = job_in_room(job_id, request_room())
    artifact_id = job.weights_artifact
    if not artifact_id:
        raise NotFound(f"job {job_id} has no trained weights (status {job.status.value})", job_id=job_id,
                       status=job.status.value)
    return stream(ctx().store.get_artifact(artifact_id))


# -- written by the rank processes of a job (room token + job key) ------------------------------
@bp.get(f"{P}/jobs/<job_id>/bundle")
def get_bundle(job_id: str):
    job = rank_job(job_id)
    return stream(ctx().store.get_artifact(job.spec.bundle_artifact))


@bp.post(f"{P}/jobs/<job_id>/events")
def post_events(job_id: str):
    job = rank_job(job_id)
    body = json_body()
    events = body.get("events")
    if not isinstance(events, list):
        raise BadRequest("field 'events' must be a list")
    clean = []
    for ev in events:
        if not isinstance(ev, dict) or ev.get("kind") not in {k.value for k in EventKind}:
            raise BadRequest("each event needs 'kind' (metric, log or status)")
        clean.append({"kind": ev["kind"], "rank": ev.get("rank"), "key": str(ev.get("key") or uuid.uuid4().hex),
                      "step": ev.get("step"), "data": ev.get("data"), "ts": ev.get("ts") or time.time()})
    stored = ctx().store.add_events(job.id, clean)
    notify.events_added(job, stored)
    return jsonify({"stored": len(stored)})


@bp.post(f"{P}/jobs/<job_id>/ranks/<int:rank>")
def post_rank_status(job_id: str, rank: int):
    job = rank_job(job_id)
    body = json_body()
    status = field(body, "status", str, required=True)
    if job.world_size is None or not 0 <= rank < job.world_size:
        raise BadRequest(f"rank {rank} is not part of job {job_id}")
    if status == "failed" and job.status == JobStatus.FAILED:  # every failing rank's traceback
        tb = field(body, "traceback", str, default="(no traceback)")
        lifecycle.rank_failed(ctx(), job, rank, str(body.get("error") or "error"), tb, bool(body.get("collective")))
        return jsonify({"ok": True})
    if job.status not in ACTIVE:
        return jsonify({"ok": False, "ignored": f"job is {job.status.value}"})
    if status == "running":
        lifecycle.rank_started(ctx(), job, rank)
    elif status == "completed":
        final_loss = body.get("final_loss")
        if isinstance(final_loss, bool) or not isinstance(final_loss, (int, float)):
            final_loss = None  # the loss is a number; anything else stays in results only
        lifecycle.rank_completed(ctx(), job, rank, fingerprint=field(body, "fingerprint", str),
                                 results=field(body, "results", dict, default={}), final_loss=final_loss,
                                 weights_artifact=field(body, "weights_artifact", str))
    elif status == "failed":
        tb = field(body, "traceback", str, default="(no traceback)")
        lifecycle.rank_failed(ctx(), job, rank, str(body.get("error") or "error"), tb, bool(body.get("collective")))
    else:
        raise BadRequest("field 'status' must be running, completed or failed", field="status")
    return jsonify({"ok": True})


@bp.put(f"{P}/jobs/<job_id>/weights")
def put_weights(job_id: str):
    job = rank_job(job_id)
    artifact = save_artifact({"id": job.room_id}, ArtifactKind.WEIGHTS.value, job.id)
    return jsonify(artifact), 201

