"""The REST API's bodies, answers and queries (under ``/api/v1``), one model each.

Bodies a caller sends are ``Message`` (strict, unknown fields refused); answers are ``Answer``
(a client of an older version ignores fields it does not know); queries are ``Query`` (strings
from the URL, converted; unknown parameters ignored, as browsers and proxies add their own).
The OpenAPI spec (``GET /api/v1/openapi.json``) is generated from these models. The job's own
record and view are in ``zwdx.protocol.job``; what a job's rank processes report (events, their
status, checkpoints) in ``zwdx.protocol.report``.
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import (BaseModel, ConfigDict, Field, ModelWrapValidatorHandler, StringConstraints, ValidationError,
                      field_validator, model_validator)

from .. import defaults
from .base import Answer, Count, Message
from .job import CheckpointEntry, JobView
from .report import Measured, Reported, clipped
from . import flat
from .spec import SubmitSpec
from .vocab import (ArtifactKind, ClientStatus, EventKind, Isolation, JobStatus, SlotKind)

#: A name a person gives (a room, a job).
Name = Annotated[str, StringConstraints(max_length=100)]


class Query(BaseModel):
    """Query parameters: strings converted to their types; unknown ones ignored."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# -- health and rooms ----------------------------------------------------------------------------
class Health(Answer):
    """``GET /health``: "ok", or "store unavailable" (with 503); the server's zwdx version and
    protocol (``zwdx.protocol.base.PROTOCOL``; None: a server from before versions were said)."""
    status: str
    store: str
    async_mode: str
    zwdx: str | None = None
    protocol: str | None = None


class CreateRoom(Message):
    name: Name = ""


class RoomView(Answer):
    id: str
    name: str
    created_at: float
    #: Seconds a GPU client of the room may stay offline before it is dropped (0: never); None:
    #: the server's ``CLIENT_RETENTION``.
    client_retention: float | None = None


class RoomSettings(Message):
    """``PATCH /room``: the room's settings; a field left out keeps its value."""
    client_retention: Annotated[float, Field(ge=0, le=10 * 365 * 86400)] | None = None


class PruneClients(Message):
    """``POST /room/clients/prune``: drop the room's GPU clients offline for at least
    ``offline_for`` seconds (0: every one offline now) that run no ranks."""
    offline_for: Annotated[float, Field(ge=0, le=10 * 365 * 86400)] = 0.0


class PrunedClients(Answer):
    pruned: list[str]


class RoomCreated(RoomView):
    """The room and its first two tokens, shown only in this answer (``zwdx.protocol.tokens``):
    ``submitter_token`` submits jobs and opens the dashboard, ``donor_token`` connects GPU
    clients. ``token`` is the submitter token again, under the name an older zwdx used."""
    submitter_token: str
    donor_token: str
    token: str


class SlotView(Answer):
    id: str
    client_id: str
    room_id: str
    index: int
    kind: SlotKind = SlotKind.CUDA
    name: str = ""
    memory_total: int = 0
    memory_free: int = 0
    utilization: float | None = None
    #: How job code on the slot is kept from its GPU client and other jobs (None: not told).
    isolation: Isolation | None = None
    #: A container's image and limits (``isolation: docker``; ``protocol.gpu.Terms``' fields).
    terms: dict[str, Any] | None = None
    job_id: str | None = None
    rank: int | None = None


class LinkView(Answer):
    """A GPU client's link to the server as it measured it at register: round trip in seconds,
    bytes per second up (to the server) and down."""
    rtt: float
    up: float
    down: float
    measured_at: float


class ClientView(Answer):
    id: str
    room_id: str
    hostname: str = ""
    host_id: str | None = None
    status: ClientStatus
    versions: dict[str, str] = {}
    advertise_addr: str | None = None
    last_seen: float | None = None
    connected_at: float | None = None
    registered_at: float | None = None
    disconnected_at: float | None = None
    lost_at: float | None = None
    #: Where its peers' reachability probes reach it (on ``advertise_addr``).
    reach_port: int | None = None
    link: LinkView | None = None
    #: GPU clients it could not reach, or that could not reach it, lately: DDP and FSDP jobs
    #: keep them apart (``zwdx/server/reach.py``).
    unreachable: list[str] = []
    slots: list[SlotView] = []
    #: The donor token it registered with (its id, never the secret): revoking it keeps the
    #: donor out of the room (``zwdx room tokens revoke``).
    token_id: str | None = None
    #: DILOCO jobs of the room that named it a suspect (``zwdx/server/suspects.py``).
    suspected_in: list[str] = []


class RoomTotals(Answer):
    """What the room's online GPU clients offer (each host's RAM counted once)."""
    clients_online: int
    slots: int
    slots_busy: int
    memory_total: int
    memory_free: int
    hosts: int


class RoomUsage(Answer):
    """What the room uses of its quotas; a limit of 0 is none (``zwdx server --room-max-jobs``,
    ``--room-max-artifact-bytes``, ``--room-max-events``)."""
    #: Jobs waiting or running, and how many it may have at once.
    jobs: int
    jobs_limit: int
    #: Bytes of its artifacts (bundles, checkpoints, weights); ``artifact_bytes_limit`` bounds
    #: them and ``event_bytes`` together.
    artifact_bytes: int
    artifact_bytes_limit: int
    #: Metric and log events its jobs hold, their bytes (their JSON), and how many it may keep.
    events: int = 0
    event_bytes: int = 0
    events_limit: int = 0


class RoomDetail(RoomView):
    clients: list[ClientView]
    totals: RoomTotals
    usage: RoomUsage | None = None


class ClientsUpdate(Answer):
    """``clients_update`` on the ``/ui`` namespace: the room's whole GPU-client list (``full``,
    on connect), or what changed since the last push: the clients whose view changed or that
    are new, and the ids of those ``removed``."""
    clients: list[ClientView]
    totals: RoomTotals
    full: bool = True
    removed: list[str] = []


# -- artifacts -----------------------------------------------------------------------------------
class ArtifactView(Answer):
    id: str
    room_id: str
    kind: ArtifactKind
    size: int
    sha256: str
    job_id: str | None = None
    created_at: float
    checkpoint: int | None = None
    name: str | None = None


# -- jobs ----------------------------------------------------------------------------------------
class SubmitJob(Message):
    """``POST /api/v1/jobs``: a job over an uploaded bundle, or a script of an uploaded working
    dir (``zwdx.protocol.script``). ``spec`` is the one tree (``zwdx.protocol.spec``); a body of
    the flat shape earlier SDKs send (every option a field of its own) is read as that tree."""
    spec: SubmitSpec
    #: The job's name (cut to 100 characters); "": the SDK names it after train_func.
    name: Annotated[str, clipped(100)] = ""
    fail_if_unschedulable: bool = False

    @model_validator(mode="wrap")
    @classmethod
    def _flat(cls, data: Any, handler: ModelWrapValidatorHandler[SubmitJob]) -> SubmitJob:
        """A flat body is checked as it was, and its errors name its flat fields."""
        if not isinstance(data, dict) or "spec" in data:
            return handler(data)
        own = {k: data[k] for k in ("name", "fail_if_unschedulable") if k in data}
        spec = {k: v for k, v in data.items() if k not in own}
        flat.check(spec)
        try:
            return handler({**own, "spec": spec})
        except ValidationError as exc:
            raise flat.flat_errors(exc, ("spec",)) from None


class JobList(Answer):
    """``GET /api/v1/jobs``: the room's jobs in submission order."""
    jobs: list[JobView]


class JobsQuery(Query):
    """``GET /api/v1/jobs?status=queued,running``"""
    status: str | None = None

    @field_validator("status")
    @classmethod
    def _statuses(cls, value: str | None) -> str | None:
        return _statuses(value)


class JobQuery(Query):
    """``GET /api/v1/jobs/<id>?events_after=N``: with it, the job's events after ``seq`` N too.
    ``&wait=S`` (with ``events_after``) holds the answer up to S seconds until the job has new
    events, changes status, or ends: a long poll, one call where polls would be many."""
    events_after: Count | None = None
    wait: Annotated[float, Field(ge=0, le=defaults.LONG_POLL_MAX)] | None = None

    @model_validator(mode="after")
    def _wait_needs_events_after(self) -> JobQuery:
        if self.wait and self.events_after is None:
            raise ValueError("wait needs events_after (the last event seen)")
        return self


class LinkQuery(Query):
    """``GET /api/v1/link?bytes=N``: N bytes to time a GPU client's download (0: a round trip)."""
    bytes: Annotated[int, Field(ge=0, le=defaults.LINK_PROBE_MAX_BYTES)] = 0


class LinkReceived(Answer):
    """``POST /api/v1/link``: how many bytes of the upload the server read."""
    bytes: int


# -- events (metrics and log lines) ---------------------------------------------------------------
class EventView(Answer):
    seq: int
    kind: EventKind
    rank: int | None = None
    key: str | None = None
    step: int | None = None
    #: A metric's numbers: NaN and infinities as "NaN", "Infinity", "-Infinity".
    data: dict[str, Measured] = {}
    ts: float | None = None

    @field_validator("data", mode="before")
    @classmethod
    def _object(cls, value: Any) -> Any:
        return value if isinstance(value, dict) else {} if value is None else {"value": value}


class EventsQuery(Query):
    after: Count = 0
    limit: Annotated[int, Field(ge=1, le=10_000)] = 10_000
    kind: EventKind | None = None


class EventsAnswer(Answer):
    job_id: str
    events: list[EventView]


class EventsPage(EventsAnswer):
    """``GET /api/v1/jobs/<id>/events``: one page, of at most ``limit`` events and about 1 MiB;
    ``next`` is the ``after`` of the next page, null once this page reached the job's last event."""
    next: int | None = None


class JobEvents(EventsAnswer):
    """``job_events`` on the ``/ui`` namespace."""


class JobDetail(JobView):
    """``GET /api/v1/jobs/<id>``: the job; with ``?events_after=N`` its events after ``seq`` N too."""
    events: list[EventView] | None = Field(default=None, exclude_if=lambda value: value is None)


class MetricPoint(Answer):
    step: int | None = None
    value: Reported | None = None
    rank: int | None = None
    ts: float | None = None


class MetricsQuery(Query):
    """``GET /api/v1/jobs/<id>/metrics?after=N&stride=S``: the page after the job's event ``seq``
    N, thinned by spans of S events (the first page says S: pass it back with ``next``)."""
    after: Count = 0
    stride: Annotated[int, Field(ge=1, le=2**53)] | None = None


class MetricsAnswer(Answer):
    """One page of a job's metric series; ``throughput`` and ``gpu_utilization`` always there.
    A series has at most ``MAX_SERIES_POINTS`` points over all pages: past that, it keeps the
    first and the last point of each span of ``stride`` events. ``next``: the ``after`` of the
    next page (with the same ``stride``), null once this page reached the job's last event."""
    job_id: str
    series: dict[str, list[MetricPoint]]
    stride: int = 1
    next: int | None = None


class CheckpointList(Answer):
    job_id: str
    checkpoints: list[CheckpointEntry]


# -- the dashboard --------------------------------------------------------------------------------
class HistoryQuery(Query):
    """``GET /api/v1/dashboard/history?status=completed,failed`` (default: every finished status)."""
    status: str | None = None

    @field_validator("status")
    @classmethod
    def _statuses(cls, value: str | None) -> str | None:
        return _statuses(value)


class Headline(Answer):
    """A job's headline figure: its final loss, else the first number among its results."""
    name: str
    value: Reported


class HistoryRow(Answer):
    id: str
    name: str = ""
    status: JobStatus
    created_at: float | None = None
    started_at: float | None = None
    running_at: float | None = None
    ended_at: float | None = None
    duration: float | None = None
    final_loss: Reported | None = None
    result: Headline | None = None
    world_size: int | None = None
    requested_world_size: int | None = None
    parallelism: str | None = None
    epochs: int | None = None
    mean_throughput: Reported | None = None
    reason: str | None = None


class HistoryAnswer(Answer):
    jobs: list[HistoryRow]


# -- the API's own description -------------------------------------------------------------------
class OpenApiDocument(Answer):
    """``GET /api/v1/openapi.json``: this API as an OpenAPI 3.1 document."""
    model_config = ConfigDict(extra="allow")
    openapi: str
    info: dict[str, Any]
    paths: dict[str, Any]


# -- errors ----------------------------------------------------------------------------------------
class Problem(Answer):
    """One wrong field of a bad request."""
    field: str
    message: str


class ErrorDetail(Answer):
    """What went wrong; other fields give its context (``job_id``, ``status``, ``limit``, ``missing``, ...)."""
    model_config = ConfigDict(extra="allow")
    #: ``bad_request``, ``unauthorized``, ``forbidden``, ``not_found``, ``conflict``, ``unschedulable``,
    #: ``payload_too_large``, ``integrity_error``, ...
    code: str
    message: str
    #: The path of the field that was wrong (``slots.0.index``), for a bad request.
    field: str | None = None
    #: Every wrong field (up to 20), for a body or a query that is not its type.
    problems: list[Problem] | None = None


class ErrorAnswer(Answer):
    """Every error: ``{"error": {"code", "message", ...context}}`` with the matching HTTP status."""
    error: ErrorDetail


def _statuses(value: str | None) -> str | None:
    if value is None:
        return None
    known = {s.value for s in JobStatus}
    wrong = [s for s in value.split(",") if s and s not in known]
    if wrong:
        raise ValueError(f"must be a comma-separated list of {', '.join(sorted(known))}; got {', '.join(wrong)}")
    return value
