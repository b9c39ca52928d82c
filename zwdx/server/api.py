"""The REST API under /api/v1, for the SDK, the dashboard and GPU clients' rank processes.

Submitters prove who they are with a submitter token of the room (header X-Zwdx-Room-Token; a
donor token opens no route); the rank processes of a running job with their rank's key
(X-Zwdx-Rank-Key), which speaks for that rank only (``auth.py``). Every route is an ``operation``
(``http.py``): its body and query arrive checked, as the models of ``zwdx.protocol.rest``, and
it answers one of them; ``GET /api/v1/openapi.json`` describes them all. Errors come back as
``{"error": {"code", "message", ...}}`` with the matching HTTP status.
"""
from __future__ import annotations

import logging
import time
import uuid

from flask import Blueprint, current_app, jsonify, request
from werkzeug.exceptions import HTTPException

from .. import __version__, defaults
from ..errors import BadRequest, Conflict, Forbidden, NotFound, Unschedulable, ZwdxError
from ..protocol import ArtifactKind, CredentialRole, JobKind, JobStatus, Parallelism, \
    RankStatus
from ..protocol.job import Job as JobRecord, JobSpec, JobView, Submitted, TimelineEntry
from ..protocol.base import PROTOCOL
from ..protocol.layout import RankLayout
from ..protocol.report import EventsBatch, RankReport, RankReportAnswer, Stored, to_wire
from ..protocol.spec import nest
from ..protocol.rest import (ArtifactView, CreateRoom, EventsPage, EventsQuery, Health, JobDetail, JobList, JobQuery,
                             JobsQuery, MetricsAnswer, MetricsQuery, PruneClients, PrunedClients, RoomCreated,
                             RoomDetail, RoomSettings, RoomView, SubmitJob)
from . import clients, global_weights, jobs, limits, manifests, notify, series, shadows, suspects
from .auth import Sender, issue_credential, only_rank
from .http import OCTET, P, Auth, ctx, job_artifact, operation, save_artifact, stream
from .jobs import Job
from .placement import room_totals, unschedulable
from .store.base import event_bytes
from .views import client_view, job_view, named_clients, room_view, submitted_view

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

    @app.errorhandler(OverflowError)
    def _too_large_for_mongodb(err: OverflowError):
        if "8-byte ints" not in str(err):  # pymongo's: the write was refused whole, nothing changed
            return _unexpected(err)
        return _zwdx_error(BadRequest("the request holds an integer past 64 bits, which the MongoDB store cannot "
                                      "hold (the embedded store can): send it as a float or a string", field="body"))

    @app.errorhandler(Exception)
    def _unexpected(err: Exception):
        log.exception("server: unexpected error on %s %s", request.method, request.path)
        return jsonify({"error": {"code": "internal", "message": f"{type(err).__name__}: {err}"}}), 500


@bp.route(f"{P}/<path:rest>", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
def no_route(rest: str):
    """Any other path under the API, or a method a path does not have: not found (the
    dashboard's routes, which take every other GET, stay out of the API)."""
    raise NotFound(f"no API route {request.method} {P}/{rest}")


# -- health -----------------------------------------------------------------------------------
@operation(bp, "GET", "/health", "Whether the server and its store answer", auth=Auth.NONE, answer=Health,
           answers={503: Health}, prefix="", tag="server")
def health():
    ok = ctx().store.ping()
    answer = Health(status="ok" if ok else "store unavailable", store=type(ctx().store).__name__,
                    async_mode=current_app.extensions["zwdx"].settings.async_mode, zwdx=__version__, protocol=PROTOCOL)
    return answer, 200 if ok else 503


# -- rooms ------------------------------------------------------------------------------------
@operation(bp, "POST", "/rooms", "Create a room", auth=Auth.NONE, body=CreateRoom, answer=RoomCreated, status=201,
           errors=(429,), tag="rooms")
def create_room(body: CreateRoom):
    """The answer holds the room's first submitter token and donor token, shown this once: the
    server keeps only their sha256 (``GET /room/tokens`` lists them by name; more are made there).
    One address may create ``RATE_LIMIT_ROOMS`` rooms (429 past it)."""
    name = body.name or f"room-{uuid.uuid4().hex[:6]}"
    room = {"id": uuid.uuid4().hex[:12], "name": name, "created_at": time.time()}
    ctx().store.create_room(room)
    _, submitter = issue_credential(ctx().store, room["id"], CredentialRole.SUBMITTER, "made with the room")
    _, donor = issue_credential(ctx().store, room["id"], CredentialRole.DONOR, "made with the room")
    log.info("room %s (%s): created", room["id"], name)
    return RoomCreated(**room_view(room).model_dump(), submitter_token=submitter, donor_token=donor,
                       token=submitter), 201


@operation(bp, "GET", "/room", "The room of the token: its GPU clients, what they offer, its quotas", answer=RoomDetail,
           tag="rooms")
def get_room(room: dict):
    clients = ctx().presence.overlay(ctx().store.list_clients(room["id"]))
    named = named_clients(ctx().store, room["id"])
    return RoomDetail.model_validate({**room_view(room).model_dump(),
                                      "clients": [{**client_view(c), "suspected_in": named.get(c["id"], [])}
                                                  for c in clients],
                                      "totals": room_totals(clients), "usage": limits.usage(room["id"])})


@operation(bp, "PATCH", "/room", "Change the room's settings", body=RoomSettings, answer=RoomView, tag="rooms")
def set_room(room: dict, body: RoomSettings):
    """``client_retention``: seconds a GPU client may stay offline before it is dropped from the
    room's list (0: never); a field left out keeps its value."""
    changes = body.model_dump(exclude_unset=True)
    if changes:
        room = ctx().store.update_room(room["id"], changes) or room
    return room_view(room)


@operation(bp, "POST", "/room/clients/prune", "Drop the room's offline GPU clients", body=PruneClients,
           answer=PrunedClients, tag="rooms")
def prune_clients(room: dict, body: PruneClients):
    """Every GPU client of the room offline for at least ``offline_for`` seconds (0: all offline
    now), unless it still runs ranks. One that comes back registers again."""
    gone = clients.drop(ctx(), room["id"], time.time() - body.offline_for, "pruned by the room's owner")
    return PrunedClients(pruned=gone)


# -- artifacts --------------------------------------------------------------------------------
@operation(bp, "POST", "/artifacts", "Upload a job's bundle", body=OCTET, answer=ArtifactView, status=201,
           errors=(413, 422, 429), tag="artifacts")
def upload_bundle(room: dict):
    """The SDK uploads the bundle before it creates the job; the server stores the bytes and
    never opens them."""
    return save_artifact(room, ArtifactKind.BUNDLE.value), 201


@operation(bp, "GET", "/artifacts/<artifact_id>", "Download an artifact of the room", answer=OCTET,
           tag="artifacts")
def download_artifact(room: dict, artifact_id: str):
    artifact = ctx().store.get_artifact(artifact_id)
    if artifact is None or artifact["room_id"] != room["id"]:
        raise NotFound(f"no artifact {artifact_id} in this room", artifact_id=artifact_id)
    return stream(artifact)


# -- jobs -------------------------------------------------------------------------------------
def _release_bundle(room: dict, data: dict) -> None:
    """A refused submit's bundle (uploaded for it, no job's yet) is deleted at once, so that it
    stops counting against the room's quota; a working dir stays, the room's other jobs run it."""
    spec = data.get("spec", data) if isinstance(data, dict) else None  # the tree, or an earlier SDK's flat body
    code = nest(spec).get("code") if isinstance(spec, dict) else None
    global_weights.release_start(room, nest(spec) if isinstance(spec, dict) else None)  # a DILOCO job's, likewise
    bundle_id = code.get("bundle_artifact") if isinstance(code, dict) else None
    bundle = ctx().store.get_artifact(bundle_id) if isinstance(bundle_id, str) else None
    if bundle and bundle["room_id"] == room["id"] and bundle["kind"] == ArtifactKind.BUNDLE.value \
            and not bundle.get("job_id"):
        ctx().artifacts.delete(bundle_id)
        ctx().store.delete_artifact(bundle_id)


@operation(bp, "POST", "/jobs", "Submit a job over an uploaded bundle", body=SubmitJob, answer=Submitted,
           status=201, errors=(409, 429), tag="jobs", refused=_release_bundle)
def create_job(room: dict, body: SubmitJob):
    """The job waits in the room's queue until slots are free. ``unschedulable`` says why the
    room as it is now could never run it; with ``fail_if_unschedulable`` such a job is refused
    (409). A room with ``ROOM_MAX_JOBS`` jobs waiting or running already is refused (429
    ``quota_exceeded``). A refused submit stores nothing, and its bundle is deleted at once
    (``_release_bundle``): it counts against the room's quota no longer."""
    bundle_id, script = body.spec.code.bundle_artifact, body.spec.kind == JobKind.SCRIPT
    bundle = ctx().store.get_artifact(bundle_id)
    kind, what = (ArtifactKind.WORKDIR, "working dir") if script else (ArtifactKind.BUNDLE, "bundle")
    if bundle is None or bundle["room_id"] != room["id"] or bundle["kind"] != kind.value:
        raise BadRequest(f"field 'bundle_artifact': no uploaded {what} {bundle_id} in this room",
                         field="bundle_artifact")
    if bundle.get("job_id"):  # a working dir is the room's, any number of its jobs run it
        raise Conflict(f"bundle {bundle_id} already belongs to job {bundle['job_id']}")
    global_weights.start_of(room, body)  # its DILOCO start weights: 400 unless the room's, for a new job
    limits.check_job_quota(room)
    pins = manifests.pin(ctx().store, room["id"], body.spec.datasets)  # a name the room lacks: 400 naming it
    now = time.time()
    code = body.spec.code
    spec = JobSpec.model_validate({**body.spec.model_dump(), "datasets": [p.model_dump() for p in pins],
                                   "code": {**code.model_dump(), "required_modules": sorted(set(code.required_modules)),
                                            "bundle_sha256": bundle["sha256"], "bundle_size": bundle["size"]}})
    job = JobRecord(id=uuid.uuid4().hex[:12], room_id=room["id"], status=JobStatus.QUEUED, name=body.name,
                    created_at=now, spec=spec, timeline=[TimelineEntry(status=JobStatus.QUEUED, at=now)])
    recent = ctx().recent_clients
    reason = unschedulable(spec.model_dump(mode="json"), recent.of(room["id"], fresh=body.fail_if_unschedulable),
                           recent.kept)
    if reason and body.fail_if_unschedulable:  # nothing stored: not the job, not its bundle (_release_bundle)
        log.info("job refused in room %s: %s", room["id"], reason)
        raise Unschedulable(f"the room cannot run this job as it is now: {reason}", reason=reason)
    job = Job.submit(ctx().store, job).record
    ctx().store.update_artifact(bundle_id, {"used_at": now} if script else {"job_id": job.id})
    global_weights.attach_start(job)
    log.info("job %s: queued in room %s (%s, world size %s)", job.id, room["id"],
             f"script {spec.script.path}" if spec.script else spec.parallelism.value, spec.resources.world_size or "all")
    notify.job_changed(job)
    ctx().scheduler.kick()
    return submitted_view(job, reason), 201


@operation(bp, "GET", "/jobs", "The room's jobs, in submission order", query=JobsQuery, answer=JobList, tag="jobs")
def list_jobs(room: dict, query: JobsQuery):
    statuses = query.status.split(",") if query.status else None
    return JobList(jobs=[job_view(j) for j in ctx().store.list_jobs(room["id"], statuses)])


@operation(bp, "GET", "/jobs/<job_id>", "A job (with its new events, for a waiting SDK)", query=JobQuery,
           answer=JobDetail, tag="jobs")
def get_job(job: JobRecord, query: JobQuery):
    """``queue_position`` (1 for the head of the room's queue) while it is queued; with
    ``events_after``, the job's events after that ``seq`` too, in one call; with ``wait`` as
    well, the answer is held until the job has news (``_held``)."""
    detail = _job_detail(job, query)
    if query.wait and not detail.events and not job.status.finished:
        detail = _held(job, query, detail)
    return detail


def _job_detail(job: JobRecord, query: JobQuery) -> JobDetail:
    extra = {}
    if job.status == JobStatus.QUEUED:
        extra["queue_position"] = ctx().store.count_jobs(job.room_id, [JobStatus.QUEUED], before_seq=job.seq) + 1
    if query.events_after is not None:
        extra["events"], _ = series.events_page(ctx().store, job.id, query.events_after, 10000)
    return JobDetail.of(job, **extra)


def _held(job: JobRecord, query: JobQuery, detail: JobDetail) -> JobDetail:
    """A long poll: the job once it has new events, or what the SDK shows of it (status, why it
    waits, its place in the queue) changed, or ``query.wait`` seconds passed. It sleeps on this
    process's changes to the job (``notify.watching``) and looks at the store every
    ``LONG_POLL_RECHECK`` seconds for those of other processes. A held poll is one greenlet
    asleep: one such call costs the server far less than the polls it replaces."""
    def shown(d: JobDetail) -> tuple:
        return d.status, d.waiting_reason, d.queue_position, d.attempt
    seen = shown(detail)
    deadline = time.monotonic() + query.wait
    with notify.watching(job.id) as changed:
        while (left := deadline - time.monotonic()) > 0:
            changed.wait(min(left, defaults.LONG_POLL_RECHECK))
            changed.clear()
            record = ctx().store.get_job(job.id)
            if record is None:
                break
            detail = _job_detail(record, query)
            if detail.events or record.status.finished or shown(detail) != seen:
                break
    return detail


@operation(bp, "POST", "/jobs/<job_id>/cancel", "Cancel a job", answer=JobView, errors=(409,), tag="jobs")
def cancel_job(job: JobRecord):
    """A job that ended already is a conflict (409)."""
    updated = jobs.cancel(ctx(), job.id)
    if updated is None:
        raise Conflict(f"job {job.id} already {job.status.value}", job_id=job.id, status=job.status.value)
    return job_view(updated)


@operation(bp, "GET", "/jobs/<job_id>/events", "A job's metric and log events, in order, a page at a time",
           query=EventsQuery, answer=EventsPage, tag="jobs")
def get_events(job: JobRecord, query: EventsQuery):
    """At most ``limit`` events and about 1 MiB (``series.events_page``); ``next`` is the
    ``after`` of the next page, null once this one reached the job's last event."""
    events, after = series.events_page(ctx().store, job.id, query.after, query.limit,
                                       query.kind.value if query.kind else None)
    return EventsPage.model_validate({"job_id": job.id, "events": events, "next": after})


@operation(bp, "GET", "/jobs/<job_id>/metrics", "A job's metric series, a page at a time", query=MetricsQuery,
           answer=MetricsAnswer, tag="jobs")
def get_metrics(job: JobRecord, query: MetricsQuery):
    """Every series by name, each point ``{step, value, rank, ts}``; ``throughput`` and
    ``gpu_utilization`` are always there (empty where nothing was sampled). A page holds about
    2,000 points; ``next`` and ``stride`` ask for the next one. A series shows at most
    ``MAX_SERIES_POINTS`` points: a longer one keeps the first and last of each span of
    ``stride`` events (``series.py``)."""
    stride = query.stride or series.stride_for(ctx().store, job.id, current_app.extensions["zwdx"].settings.max_series_points)
    found, after = series.metrics_page(ctx().store, job.id, query.after, stride)
    return MetricsAnswer.model_validate({"job_id": job.id, "series": found, "stride": stride, "next": after})


@operation(bp, "GET", "/jobs/<job_id>/weights", "Download a job's trained weights (safetensors)", answer=OCTET,
           tag="jobs")
def get_weights(job: JobRecord):
    """Only the weights artifact of this job: an id that names anything else is not read."""
    artifact = job_artifact(job, job.weights_artifact, ArtifactKind.WEIGHTS.value) if job.weights_artifact else None
    if artifact is None:
        raise NotFound(f"job {job.id} has no trained weights (status {job.status.value})", job_id=job.id,
                       status=job.status.value)
    return stream(artifact)


# -- written by the rank processes of a job (a rank's key: that rank only) ------------------------
@operation(bp, "GET", "/jobs/<job_id>/bundle", "Download the job's bundle (its rank processes)", auth=Auth.JOB,
           answer=OCTET, tag="ranks")
def get_bundle(job: JobRecord):
    """Any rank's key of the job's current attempt (a GPU client fetches it once for its ranks)."""
    artifact = ctx().store.get_artifact(job.spec.code.bundle_artifact)
    if artifact is None or artifact.get("room_id") != job.room_id:
        raise NotFound(f"job {job.id} has no bundle on this server", job_id=job.id)
    return stream(artifact)


@operation(bp, "POST", "/jobs/<job_id>/events", "Report metric and log events", auth=Auth.JOB, body=EventsBatch,
           answer=Stored, tag="ranks", late=True)
def post_events(job: JobRecord, sender: Sender, body: EventsBatch):
    """A rank reports its own events only: an event of another rank is refused (403) and none
    of the batch is stored. An event whose ``(rank, key)`` the job holds already is stored
    once: a batch sent twice counts once. ``stored`` says how many were new. Each rank posts at
    most ``RATE_LIMIT_EVENTS`` (429 ``too_many_requests``: retry later); a batch that would take
    the room past ``ROOM_MAX_EVENTS`` or ``ROOM_MAX_ARTIFACT_BYTES`` is refused whole (429
    ``quota_exceeded``); below the server's free-space floor, 507 (``disk.py``)."""
    if shadows.of(job, sender.rank) is not None:
        return Stored(stored=0)  # a shadow's metrics and logs are its worker's again: not the job's
    others = sorted({ev.rank for ev in body.events if ev.rank not in (None, sender.rank)})
    if others:
        raise Forbidden(f"rank {sender.rank}'s key reports rank {sender.rank}'s events only, not rank(s) "
                        f"{', '.join(map(str, others))}'s", job_id=job.id, rank=sender.rank)
    limits.check_event_rate(job.id, sender.rank)
    clean = [{"kind": ev.kind.value, "rank": sender.rank, "key": ev.key or uuid.uuid4().hex, "step": ev.step,
              "data": to_wire(ev.data), "ts": ev.ts or time.time()} for ev in body.events]  # model_dump's JSON, cheaper
    limits.check_event_quota(job.room_id, len(clean), request.content_length or sum(map(event_bytes, clean)))
    stored = ctx().events.add(job.id, clean)  # with the other requests of the moment (batches.py)
    notify.events_added(job, stored)
    return Stored(stored=len(stored))


@operation(bp, "POST", "/jobs/<job_id>/ranks/<rank>", "Report a rank's start, result or failure",
           auth=Auth.JOB, body=RankReport, answer=RankReportAnswer, tag="ranks", late=True)
def post_rank_status(job: JobRecord, sender: Sender, rank: int, body: RankReport):
    """Only the rank's own key reports for it (403 otherwise). Once the job failed, a rank may
    still report its own failure for a moment (its traceback is kept); nothing else.
    ``weights_artifact`` must name weights uploaded for this job (``PUT /jobs/<id>/weights``), and
    a DDP/FSDP step ``check`` only ranks of the attempt's placement: anything else is refused (400)
    and nothing is recorded. A shadow's reports are not the job's, but a DDP/FSDP shadow's failure
    (and its final weights' fingerprint, for the weights check).
    """
    # a DDP/FSDP shadow fails as any rank (``jobs.in_step``); a DILOCO one's failure is noted, the job goes on
    if shadows.of(job, rank) is not None and not (jobs.in_step(job) and body.status == RankStatus.FAILED):
        only_rank(sender, rank, f"a report for rank {rank}", job.id)
        if body.status == RankStatus.FAILED:
            shadows.gone(job, [rank], f"it failed: {body.error or 'error'}")
        elif body.status == RankStatus.COMPLETED and shadows.finished(job, rank, body.fingerprint):
            return RankReportAnswer(ok=True, ignored=f"rank {rank} is a shadow: its fingerprint is kept for the "
                                                     f"weights check, the rest is not the job's")
        return RankReportAnswer(ok=True, ignored=f"rank {rank} is a shadow: what it reports is not the job's")
    if shadows.of(job, rank) is None and (job.world_size is None or not 0 <= rank < job.world_size):
        raise BadRequest(f"rank {rank} is not part of job {job.id}", field="rank")
    only_rank(sender, rank, f"a report for rank {rank}", job.id)
    check = body.check
    said = {*check.named, *check.distances, *(s for d in check.distances.values() for s in d)} if check else set()
    if strangers := sorted({int(r) for r in said} - {p.rank for p in job.placement or []}):  # never named
        raise BadRequest(f"field 'check': rank(s) {', '.join(map(str, strangers))} are not of job {job.id}'s "
                         f"attempt {job.attempt}", field="check")
    if not sender.live and body.status != RankStatus.FAILED:
        raise Forbidden(f"job {job.id} is {job.status.value}: its ranks may only report their failure now",
                        job_id=job.id, status=job.status.value)
    if body.weights_artifact is not None and \
            job_artifact(job, body.weights_artifact, ArtifactKind.WEIGHTS.value) is None:
        raise BadRequest(f"field 'weights_artifact': no weights {body.weights_artifact} uploaded for job {job.id}",
                         field="weights_artifact")
    answer = jobs.report(ctx(), job, rank, body,
                         weights=lambda: global_weights.weights(job, rank, body.weights_artifact))
    if answer.ok and body.status == RankStatus.COMPLETED:
        suspects.compare_weights(ctx().store.get_job(job.id))  # once done: the final weights against the ranks' word
    return answer


@operation(bp, "POST", "/jobs/<job_id>/ranks/<rank>/layout", "Report what a rank holds of the model",
           auth=Auth.JOB, body=RankLayout, answer=RankReportAnswer, tag="ranks")
def post_rank_layout(job: JobRecord, sender: Sender, rank: int, body: RankLayout):
    """Only the rank's own key reports its layout (403 otherwise), once it runs: the job's page
    draws it (``protocol.layout``). A layout that breaks a bound is refused (400) and changes
    nothing; one from a rank not running, or from a shadow, is ``ignored``."""
    if shadows.of(job, rank) is not None:
        only_rank(sender, rank, f"a layout for rank {rank}", job.id)
        return RankReportAnswer(ok=False, ignored=f"rank {rank} is a shadow")
    if job.world_size is None or not 0 <= rank < job.world_size:
        raise BadRequest(f"rank {rank} is not part of job {job.id}", field="rank")
    only_rank(sender, rank, f"a layout for rank {rank}", job.id)
    if not jobs.rank_layout(ctx(), job, rank, body):
        return RankReportAnswer(ok=False, ignored=f"rank {rank} is not running")
    return RankReportAnswer(ok=True)


@operation(bp, "PUT", "/jobs/<job_id>/weights", "Upload the trained weights (rank 0)", auth=Auth.JOB, body=OCTET,
           answer=ArtifactView, status=201, errors=(413, 422, 429), tag="ranks")
def put_weights(job: JobRecord, sender: Sender):
    """Safetensors bytes, from rank 0's key only (a DILOCO job whose rank 0 was dropped: the first
    worker not dropped, as every worker holds the global weights); the answer's ``id`` is what
    that rank reports as ``weights_artifact``."""
    first = 0
    if job.spec.parallelism == Parallelism.DILOCO:
        first = next((r for r in range(job.world_size or 0) if (state := job.ranks.get(str(r))) is None
                      or state.status != RankStatus.DROPPED), 0)
    only_rank(sender, first, "uploading the weights", job.id)
    return save_artifact({"id": job.room_id}, ArtifactKind.WEIGHTS.value, job.id), 201
