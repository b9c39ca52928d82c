"""The REST API's bodies, answers and queries (under ``/api/v1``), one model each.

Bodies a caller sends are ``Message`` (strict, unknown fields refused); answers are ``Answer``
(a client of an older version ignores fields it does not know); queries are ``Query`` (strings
from the URL, converted; unknown parameters ignored, as browsers and proxies add their own).
The OpenAPI spec (``GET /api/v1/openapi.json``) is generated from these models. The job's own
record and view are in ``zwdx.protocol.job``; what a job's rank processes report (events, their
status, checkpoints) in ``zwdx.protocol.report``.
"""
from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import (BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator,
                      model_validator)

from .. import defaults
from .base import Answer, Bytes, ByValue, Count, Id, Message
from .dataset import DatasetRef
from .diloco import DilocoSettings
from .gpu import ModuleName
from .pipeline import PipelineSettings
from .tensor_parallel import MODES as TP_MODES
from .tensor_parallel import check_plan as check_tp_plan
from .job import CheckpointEntry, JobView
from .report import Measured, Reported, clipped
from .script import ScriptSpec
from .vocab import (ArtifactKind, ClientStatus, Devices, EventKind, Isolation, JobKind, JobStatus, Parallelism,
                    PipelineSchedule, SlotKind, TpStyle)

#: A name a person gives (a room, a job).
Name = Annotated[str, StringConstraints(max_length=100)]


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
    """``POST /api/v1/jobs``: a job over an uploaded bundle, or (``kind: "script"``) a script of
    an uploaded working dir (``zwdx.protocol.script``)."""
    versions: Versions
    #: The id of the bundle uploaded with ``POST /api/v1/artifacts``; a script job's: its working
    #: dir's (``PUT /api/v1/workdirs/<sha256>``).
    bundle_artifact: Id
    kind: Annotated[JobKind, ByValue] = JobKind.FUNCTION
    parallelism: Annotated[Parallelism, ByValue] = Parallelism.DDP
    #: None: the train function's own default (1 if it declares none).
    epochs: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    #: None: every eligible idle slot of the room (a script job must say: ``zwdx run --nproc``).
    world_size: Annotated[int, Field(ge=1, le=100_000)] | None = Field(default=None, validate_default=True)
    #: Bytes of free memory needed on every slot.
    memory_required: Bytes = 0
    #: The job's name (cut to 100 characters); "": the SDK names it after train_func.
    name: Annotated[str, clipped(100)] = ""
    collective_timeout: Annotated[float, Field(gt=0, le=7 * 24 * 3600)] | None = None
    min_world_size: Annotated[int, Field(ge=1, le=100_000)] | None = None
    max_restarts: Annotated[int, Field(ge=0, le=1000)] = defaults.MAX_RESTARTS
    keep_checkpoints: Annotated[int, Field(ge=1, le=1000)] = defaults.KEEP_CHECKPOINTS
    checkpoint_every_epoch: bool = True
    required_modules: Annotated[list[ModuleName], Field(max_length=defaults.MAX_REQUIRED_MODULES)] = []
    fail_if_unschedulable: bool = False
    #: What a script job runs (``kind: "script"`` only).
    script: ScriptSpec | None = Field(default=None, validate_default=True)
    #: Ranks on every GPU client of the job (torchrun's ``--nproc-per-node``), a divisor of
    #: ``world_size``; None: as the slots come.
    gpus_per_client: Annotated[int, Field(ge=1, le=1024)] | None = None
    #: DILOCO's settings (``zwdx.protocol.diloco``); only with parallelism DILOCO, which takes
    #: the defaults when this is left out.
    diloco: DilocoSettings | None = None
    #: PIPELINE's settings (``zwdx.protocol.pipeline``); only with parallelism PIPELINE, which
    #: takes the defaults when this is left out.
    pipeline: PipelineSettings | None = Field(default=None, validate_default=True)
    #: A LoRA job's adapter config, as peft writes ``adapter_config.json`` (the SDK sets it from
    #: ``lora=``; the server keeps it for ``get_trained_model``, and reads nothing in it but
    #: ``peft_type``). Only with DDP or FSDP.
    lora: dict[str, Any] | None = None
    #: Datasets the GPU clients fetch before the job's code runs (``zwdx.protocol.dataset``): a
    #: room dataset's name (its newest version, pinned now), a URL, or ``{"url", "sha256", "name"}``.
    datasets: Annotated[list[DatasetRef], Field(max_length=defaults.MAX_JOB_DATASETS)] = []
    #: The image its ranks run in (``--isolation docker``): only GPU clients whose donor allows it
    #: take the job (``zwdx gpu-client --allow-image``). None: any client, in its default image.
    image: Annotated[str, StringConstraints(min_length=1, max_length=255,
                                            pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$")] | None = None
    #: "mixed": GPU and CPU slots together over gloo, each rank's batch weighted by its measured
    #: speed (DDP only; ``gpu_client/rank/strategies/mixed.py``); "same": one kind of slot.
    devices: Annotated[Devices, ByValue] = Devices.SAME
    #: devices "mixed": the samples of one step over every rank, shared out by speed; None: the
    #: world size times the default of ``data_loader_func``'s ``batch_size``.
    global_batch: Annotated[int, Field(ge=1, le=100_000_000)] | None = Field(default=None, validate_default=True)
    #: TP and FSDP+TP (``zwdx.protocol.tensor_parallel``): module names (``*`` one part of a name)
    #: -> ``colwise`` or ``rowwise``; None: derived from the model by the ranks.
    tp_plan: dict[str, Annotated[TpStyle, ByValue]] | None = None
    #: The ranks of one TP group, all on one GPU client. TP: the job's world size (one group);
    #: FSDP+TP: a divisor of it; None: as many as the placement puts on each GPU client.
    tp_size: Annotated[int, Field(ge=1, le=1024)] | None = None

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

    @field_validator("world_size")
    @classmethod
    def _script_sized(cls, value, info):
        if value is None and info.data.get("kind") == JobKind.SCRIPT:
            raise ValueError("a script job needs its number of ranks (zwdx run --nproc N)")
        return value

    @field_validator("script")
    @classmethod
    def _script_of_kind(cls, value, info):
        kind = info.data.get("kind")
        if kind == JobKind.SCRIPT and value is None:
            raise ValueError("a script job needs its script: {\"path\", \"args\", \"env\"}")
        if kind == JobKind.FUNCTION and value is not None:
            raise ValueError("only a job of kind \"script\" runs a script")
        return value

    @field_validator("gpus_per_client")
    @classmethod
    def _divides_world(cls, value, info):
        world_size = info.data.get("world_size")
        if value is not None and (world_size is None or world_size % value):
            raise ValueError(f"must divide world_size ({world_size}): every GPU client runs this many ranks")
        if value is not None and info.data.get("parallelism") == Parallelism.TP and value != world_size:
            raise ValueError(f"must equal world_size ({world_size}) with TP: its ranks are one GPU client's")
        return value

    @field_validator("diloco")
    @classmethod
    def _diloco_only(cls, value, info):
        parallelism = info.data.get("parallelism")
        if value is not None and parallelism is not None and parallelism != Parallelism.DILOCO:
            raise ValueError(f"applies to parallelism DILOCO only, not {parallelism.value}")
        per = value.ranks_per_worker if value is not None else 1
        world_size, gpus = info.data.get("world_size"), info.data.get("gpus_per_client")
        if per > 1 and (world_size is None or world_size % per):
            raise ValueError(f"ranks_per_worker ({per}) must divide world_size ({world_size}): every worker is "
                             f"{per} ranks of one GPU client")
        if per > 1 and gpus is not None and gpus != per:
            raise ValueError(f"ranks_per_worker ({per}) and gpus_per_client ({gpus}) differ: a DILOCO worker is "
                             f"one GPU client's ranks (leave gpus_per_client out)")
        return value

    @field_validator("min_world_size")
    @classmethod
    def _min_at_most_world(cls, value, info):
        world_size = info.data.get("world_size")
        if value is not None and world_size is not None and value > world_size:
            raise ValueError(f"must be at most world_size ({world_size})")
        if value is not None and info.data.get("parallelism") == Parallelism.PIPELINE and value != world_size:
            raise ValueError(f"must equal world_size ({world_size}) with PIPELINE: every stage needs its rank")
        if value is not None and info.data.get("parallelism") == Parallelism.TP and value != world_size:
            raise ValueError(f"must equal world_size ({world_size}) with TP: the job is one TP group, on one GPU "
                             f"client")
        return value

    @field_validator("pipeline")
    @classmethod
    def _pipeline_only(cls, value, info):
        """Only with PIPELINE, which takes the defaults when it is left out; one stage a rank."""
        parallelism = info.data.get("parallelism")
        if parallelism != Parallelism.PIPELINE:
            if value is not None and parallelism is not None:
                raise ValueError(f"applies to parallelism PIPELINE only, not {parallelism.value}")
            return value
        if info.data.get("kind") == JobKind.SCRIPT:
            raise ValueError("a script job has no model to cut into stages: PIPELINE is for submit_job's functions")
        value = value or PipelineSettings()
        world_size = info.data.get("world_size")
        value = value.resolved(world_size)  # ValueError: the plan and the ranks do not fit
        n = world_size or (value.stages // (value.stages_per_rank or 1) if value.stages else None)
        if value.schedule == PipelineSchedule.ONE_F_ONE_B and n and value.microbatches is not None \
                and value.microbatches < n:
            raise ValueError(f"microbatches must be at least the number of stages ({n}) with 1F1B")
        return value

    @model_validator(mode="after")
    def _diloco_defaults(self):
        if self.parallelism == Parallelism.DILOCO and self.diloco is None:
            self.diloco = DilocoSettings()
        if self.diloco is not None and self.diloco.ranks_per_worker > 1:
            self.gpus_per_client = self.diloco.ranks_per_worker  # placement: a worker's ranks on one GPU client
        return self

    @field_validator("lora")
    @classmethod
    def _lora_config(cls, value, info):
        if value is None:
            return None
        parallelism = info.data.get("parallelism")
        if parallelism not in (Parallelism.DDP, Parallelism.FSDP) or info.data.get("kind") == JobKind.SCRIPT:
            raise ValueError(f"LoRA jobs run with DDP or FSDP, not {getattr(parallelism, 'value', parallelism)}")
        if not isinstance(value.get("peft_type"), str) or not value["peft_type"]:
            raise ValueError("must be a peft config as JSON, with its peft_type (\"LORA\")")
        if len(json.dumps(value)) > defaults.MAX_LORA_CONFIG_BYTES:
            raise ValueError(f"must take at most {defaults.MAX_LORA_CONFIG_BYTES} bytes as JSON")
        return value

    @field_validator("devices", mode="before")
    @classmethod
    def _lower_devices(cls, value):
        return value.lower() if isinstance(value, str) else value

    @field_validator("devices")
    @classmethod
    def _mixed_ddp(cls, value, info):
        """Mixed devices: DDP's replicas only (FSDP's shards would need every rank's gradient
        scaled before a reduce-scatter; a pipeline or DILOCO has no shared batch to weigh)."""
        parallelism = info.data.get("parallelism")
        if value == Devices.MIXED and info.data.get("kind") == JobKind.SCRIPT:
            raise ValueError("devices \"mixed\" weighs the batches of submit_job's functions; a script job "
                             "runs its own loop")
        if value == Devices.MIXED and parallelism is not None and parallelism != Parallelism.DDP:
            raise ValueError(f"devices \"mixed\" runs with DDP only, not {parallelism.value}")
        return value

    @field_validator("global_batch")
    @classmethod
    def _batch_of_mixed(cls, value, info):
        if value is None:
            return value
        if info.data.get("devices") != Devices.MIXED:
            raise ValueError("applies to devices \"mixed\" only (the batch is shared out by the ranks' speed)")
        world_size = info.data.get("world_size")
        if world_size is not None and value < world_size:
            raise ValueError(f"must be at least world_size ({world_size}): every rank takes a sample at least")
        return value

    @staticmethod
    def _tensor_parallel(info):
        """The job's parallelism, which a TP setting needs to be TP or FSDP+TP (of a submit_job job)."""
        parallelism = info.data.get("parallelism")
        if parallelism not in TP_MODES or info.data.get("kind") == JobKind.SCRIPT:
            raise ValueError(f"applies to parallelism TP and FSDP+TP only, not "
                             f"{getattr(parallelism, 'value', parallelism)}")
        return parallelism

    @field_validator("tp_plan")
    @classmethod
    def _tp_plan(cls, value, info):
        if value is None:
            return None
        cls._tensor_parallel(info)
        return check_tp_plan(value)

    @field_validator("tp_size")
    @classmethod
    def _tp_size(cls, value, info):
        if value is None:
            return None
        parallelism = cls._tensor_parallel(info)
        world_size, gpus = info.data.get("world_size"), info.data.get("gpus_per_client")
        if parallelism == Parallelism.TP and world_size is not None and value != world_size:
            raise ValueError(f"must equal world_size ({world_size}) with TP: the job is one TP group (FSDP+TP "
                             f"has several)")
        if world_size is not None and world_size % value:
            raise ValueError(f"must divide world_size ({world_size}): each TP group is {value} ranks of one GPU "
                             f"client")
        if gpus is not None and gpus != value:
            raise ValueError(f"and gpus_per_client ({gpus}) differ: a TP group is one GPU client's ranks (leave "
                             f"gpus_per_client out)")
        return value

    @model_validator(mode="after")
    def _tp_groups(self):
        """Placement keeps a TP group on one GPU client: as ``gpus_per_client`` places them."""
        if self.parallelism == Parallelism.TP:
            if self.world_size is None and self.tp_size is not None:
                self.world_size = self.tp_size
            self.gpus_per_client = self.world_size
        elif self.parallelism == Parallelism.FSDP_TP and self.tp_size is not None:
            self.gpus_per_client = self.tp_size
        return self

    @model_validator(mode="after")
    def _pipeline_world(self):
        """A PIPELINE job's plan, if it names its stages, says how many ranks it has."""
        if self.pipeline is not None and self.world_size is None and self.pipeline.stages is not None:
            self.world_size = self.pipeline.stages // (self.pipeline.stages_per_rank or 1)
        return self


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
    """``GET /api/v1/jobs/<id>?events_after=N``: with it, the job's events after ``seq`` N too.
    ``&wait=S`` (with ``events_after``) holds the answer up to S seconds until the job has new
    events, changes status, or ends: a long poll, one call where polls would be many."""
    events_after: Count | None = None
    wait: Annotated[float, Field(ge=0, le=defaults.LONG_POLL_MAX)] | None = None

    @model_validator(mode="after")
    def _wait_needs_events_after(self):
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
    def _object(cls, value):
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
