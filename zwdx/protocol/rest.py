"""The REST API's bodies, answers and queries (under ``/api/v1``), one model each.

Bodies a caller sends are ``Message`` (strict, unknown fields refused); answers are ``Answer``
(a client of an older version ignores fields it does not know); queries are ``Query`` (strings
from the URL, converted; unknown parameters ignored, as browsers and proxies add their own).
The OpenAPI spec (``GET /api/v1/openapi.json``) is generated from these models. The job's own
record and view are in ``zwdx.protocol.job``.
"""
from __future__ import annotations

from typing import Annotated, Any, Union

from typing_extensions import TypeAliasType

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator,
                      model_validator)

from .. import defaults
from .base import Answer, Bytes, ByValue, Count, Id, Message
from .gpu import ModuleName
from .job import CheckpointEntry, JobView
from .vocab import ArtifactKind, CheckpointFormat, ClientStatus, EventKind, JobStatus, Parallelism, RankStatus, SlotKind

#: A name a person gives (a room, a job).
Name = Annotated[str, StringConstraints(max_length=100)]
#: A metric's or a result's name.
Key = Annotated[str, StringConstraints(min_length=1, max_length=200)]
def _not_dots(name: str) -> str:
    if name in (".", ".."):
        raise ValueError("a file name cannot be . or ..")
    return name


#: A number the ranks reported: NaN and infinities are numbers here (a loss that diverged).
Reported = Annotated[float, Field(allow_inf_nan=True)]


def _clip(limit: int, keep: str = "head"):
    """Text cut to ``limit`` characters (the head, or the tail of a traceback) instead of refused:
    a rank's failure is recorded however long its message."""
    def clip(text: str) -> str:
        if len(text) <= limit:
            return text
        return text[:limit] if keep == "head" else "..." + text[-(limit - 3):]
    return AfterValidator(clip)


#: A JSON value that a rank measured or returned: its numbers may be NaN or infinite.
Measured = TypeAliasType("Measured", Union[int, Reported, str, bool, None, list["Measured"],
                                           dict[str, "Measured"]])

#: A checkpoint file's name: letters, digits and ``._-``, not ``.`` or ``..``.
FileName = Annotated[str, StringConstraints(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._-]+$"),
                     AfterValidator(_not_dots)]


class Query(BaseModel):
    """Query parameters: strings converted to their types; unknown ones ignored."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# -- health and rooms ----------------------------------------------------------------------------
class Health(Answer):
    """``GET /health``: "ok", or "store unavailable" (with 503)."""
    status: str
    store: str
    async_mode: str


class CreateRoom(Message):
    name: Name = ""


class RoomView(Answer):
    id: str
    name: str
    created_at: float


class RoomCreated(RoomView):
    """The room and its token: shown only in this answer."""
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
    job_id: str | None = None
    rank: int | None = None


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
    slots: list[SlotView] = []


class RoomTotals(Answer):
    """What the room's online GPU clients offer (each host's RAM counted once)."""
    clients_online: int
    slots: int
    slots_busy: int
    memory_total: int
    memory_free: int
    hosts: int


class RoomDetail(RoomView):
    clients: list[ClientView]
    totals: RoomTotals


class ClientsUpdate(Answer):
    """``clients_update`` on the ``/ui`` namespace."""
    clients: list[ClientView]
    totals: RoomTotals


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
class Versions(Message):
    """The submitter's runtime: its Python minor version decides where the bundle can load;
    other entries (``torch``, ``cloudpickle``, ...) are names and version strings."""
    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[Annotated[str, StringConstraints(max_length=64)],
                             Annotated[str, StringConstraints(max_length=64)]]
    python: Annotated[str, StringConstraints(min_length=1, max_length=32, pattern=r"^[0-9]+\.[0-9]+")]
    torch: Annotated[str, StringConstraints(max_length=64)] | None = None
    cloudpickle: Annotated[str, StringConstraints(max_length=64)] | None = None

    @model_validator(mode="after")
    def _few(self):
        if len(self.__pydantic_extra__ or {}) > 64:
            raise ValueError("at most 64 versions")
        return self


class SubmitJob(Message):
    """``POST /api/v1/jobs``: a job over an uploaded bundle."""
    versions: Versions
    #: The id of the bundle uploaded with ``POST /api/v1/artifacts``.
    bundle_artifact: Id
    parallelism: Annotated[Parallelism, ByValue] = Parallelism.DDP
    #: None: the train function's own default (1 if it declares none).
    epochs: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    #: None: every eligible idle slot of the room.
    world_size: Annotated[int, Field(ge=1, le=100_000)] | None = None
    #: Bytes of free memory needed on every slot.
    memory_required: Bytes = 0
    #: The job's name (cut to 100 characters); "": the SDK names it after train_func.
    name: Annotated[str, _clip(100)] = ""
    collective_timeout: Annotated[float, Field(gt=0, le=7 * 24 * 3600)] | None = None
    min_world_size: Annotated[int, Field(ge=1, le=100_000)] | None = None
    max_restarts: Annotated[int, Field(ge=0, le=1000)] = defaults.MAX_RESTARTS
    keep_checkpoints: Annotated[int, Field(ge=1, le=1000)] = defaults.KEEP_CHECKPOINTS
    checkpoint_every_epoch: bool = True
    required_modules: Annotated[list[ModuleName], Field(max_length=defaults.MAX_REQUIRED_MODULES)] = []
    fail_if_unschedulable: bool = False

    @field_validator("parallelism", mode="before")
    @classmethod
    def _upper(cls, value):
        return value.upper() if isinstance(value, str) else value

    @field_validator("required_modules", mode="wrap")
    @classmethod
    def _modules(cls, value, handler):
        try:
            return handler(value)
        except ValidationError as exc:
            if exc.errors()[0]["type"] == "list_type":
                raise
            raise ValueError(f"must be a list of at most {defaults.MAX_REQUIRED_MODULES} top-level module names "
                             f"(Python identifiers)") from None

    @field_validator("min_world_size")
    @classmethod
    def _min_at_most_world(cls, value, info):
        world_size = info.data.get("world_size")
        if value is not None and world_size is not None and value > world_size:
            raise ValueError(f"must be at most world_size ({world_size})")
        return value


class JobList(Answer):
    """``GET /api/v1/jobs``: the room's jobs in submission order."""
    jobs: list[JobView]


class JobsQuery(Query):
    """``GET /api/v1/jobs?status=queued,running``"""
    status: str | None = None

    @field_validator("status")
    @classmethod
    def _statuses(cls, value):
        return _statuses(value)


class JobQuery(Query):
    """``GET /api/v1/jobs/<id>?events_after=N``: with it, the job's events after ``seq`` N too."""
    events_after: Count | None = None


# -- events (metrics and log lines) ---------------------------------------------------------------
class EventIn(Message):
    """One metric or log event a rank reports; a metric's values are numbers (NaN and
    infinities too: a loss that diverged) or null."""
    kind: Annotated[EventKind, ByValue]
    rank: Annotated[int, Field(ge=0, le=100_000)] | None = None
    #: Unique per job and rank: a batch sent twice is stored once.
    key: Annotated[str, StringConstraints(min_length=1, max_length=100)] | None = None
    step: Count | None = None
    data: dict[Key, Measured]
    ts: Annotated[float, Field(ge=0, le=1e11)] | None = None

    @model_validator(mode="after")
    def _shape(self):
        if self.kind is EventKind.METRIC:
            if len(self.data) > 200:
                raise ValueError("a metric event holds at most 200 values")
            for name, value in self.data.items():
                if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                    raise ValueError(f"metric {name!r} must be a number or null, got {type(value).__name__}")
        elif self.kind is EventKind.LOG:
            if set(self.data) != {"text"} or not isinstance(self.data["text"], str) or \
                    len(self.data["text"]) > 100_000:
                raise ValueError("a log event's data is {\"text\": a string of at most 100000 characters}")
        return self


class EventsBatch(Message):
    """``POST /api/v1/jobs/<id>/events`` (job key)."""
    events: Annotated[list[EventIn], Field(max_length=1000)]


class Stored(Answer):
    stored: int


class EventView(Answer):
    seq: int
    kind: EventKind
    rank: int | None = None
    key: str | None = None
    step: int | None = None
    data: dict[str, Any] = {}
    ts: float | None = None

    @field_validator("data", mode="before")
    @classmethod
    def _object(cls, value):
        return value if isinstance(value, dict) else {} if value is None else {"value": value}


class EventsQuery(Query):
    after: Count = 0
    limit: Annotated[int, Field(ge=1, le=10_000)] = 10_000
    kind: EventKind | None = None


class EventsAnswer(Answer):
    job_id: str
    events: list[EventView]


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


class MetricsAnswer(Answer):
    """Every metric series of a job; ``throughput`` and ``gpu_utilization`` always there."""
    job_id: str
    series: dict[str, list[MetricPoint]]


# -- what ranks report (job key) -------------------------------------------------------------------
class RankReport(Message):
    """``POST /api/v1/jobs/<id>/ranks/<rank>``: a rank started, completed or failed."""
    status: Annotated[RankStatus, ByValue]
    #: What train_func and eval_func returned (rank 0's are the job's).
    results: Annotated[dict[Key, Measured], Field(max_length=200)] | None = None
    final_loss: Reported | None = None
    #: sha256 of the rank's trained weights.
    fingerprint: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")] | None = None
    #: Rank 0: the id of the weights it uploaded (``PUT /jobs/<id>/weights``), an artifact of
    #: this job; anything else is refused.
    weights_artifact: Id | None = None
    error: Annotated[str, _clip(1000)] | None = None
    traceback: Annotated[str, _clip(200_000, keep="tail")] | None = None
    #: The failure came from torch.distributed (the rank lost its peers).
    collective: bool = False


class RankReportAnswer(Answer):
    """``ok``; or ``ok: false`` and why the report was ``ignored`` (the job is no longer active)."""
    ok: bool
    ignored: str | None = Field(default=None, exclude_if=lambda value: value is None)


class CheckpointCommit(Message):
    """``POST /api/v1/jobs/<id>/checkpoints/<n>/commit`` (rank 0, job key)."""
    files: Annotated[list[FileName], Field(min_length=1, max_length=4096)]
    epoch: Count | None = None
    step: Count | None = None
    format: Annotated[CheckpointFormat, ByValue] | None = None
    epoch_complete: bool = True


class CheckpointList(Answer):
    job_id: str
    checkpoints: list[CheckpointEntry]


# -- the dashboard --------------------------------------------------------------------------------
class HistoryQuery(Query):
    """``GET /api/v1/dashboard/history?status=completed,failed`` (default: every finished status)."""
    status: str | None = None

    @field_validator("status")
    @classmethod
    def _statuses(cls, value):
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
class ErrorDetail(Answer):
    model_config = ConfigDict(extra="allow")
    code: str
    message: str
    #: The path of the field that was wrong (``slots.0.index``), for a bad request.
    field: str | None = None


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
