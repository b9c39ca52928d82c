"""A job's record, declared once: what the server stores and what everyone else is shown.

    JobSpec          what the submitter asked for; fixed at submit (``zwdx.protocol.spec``)
    PlacementEntry   one rank's slot, as the scheduler chose it
    Master           where the ranks rendezvous (an address rank 0's GPU client offered)
    RankState        what a rank last reported of itself
    RankFailure      a failing rank's traceback, when the server heard of it and how it failed
    TimelineEntry    one change of status
    RestartEntry     one restart from a checkpoint, after a lost GPU client
    AutoChoice       the mode an AUTO job was given as it was placed, and why
    CheckpointEntry  a committed checkpoint (also handed to a resumed attempt in ``JobAssign``)
    RankCredential   the hash of one rank's key and what it is bound to (server-only)
    Job              the record the store keeps, with the server-only ``rank_keys``
    JobView          what the REST API, the SDK and the dashboard get: the record without its
                     secret, tracebacks by rank, ``failure_order``; ``queue_position`` while queued
    Submitted        the answer to a submit: the view and ``unschedulable``

The server moves a record through its statuses with ``zwdx.server.jobs.Job``; the store keeps
it as JSON (``docs/store.md``). Records are read leniently (a field a newer server added is
ignored) and may hold NaN and infinities (a diverged loss), which JSON carries as the strings
"NaN", "Infinity" and "-Infinity" (``zwdx.protocol.report.Reported``), in the store too.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .base import Answer
from .layout import RankLayout
from .report import Measured, Reported, StepCheck
from .spec import JobSpec
from .vocab import CheckpointFormat, FailureKind, JobStatus, Parallelism, RankStatus, SlotKind


def _absent(value: object) -> bool:
    return value is None


class Record(BaseModel):
    """A stored record: unknown fields ignored, NaN and infinities kept (as strings in JSON)."""

    model_config = ConfigDict(extra="ignore", ser_json_inf_nan="strings")


class CheckpointEntry(Answer):
    n: int
    epoch: int | None = None
    step: int | None = None
    format: CheckpointFormat
    epoch_complete: bool = True
    world_size: int | None = None
    attempt: int = 0
    #: file name -> artifact id
    files: dict[str, str] = Field(default_factory=dict)
    at: float | None = None


class PlacementEntry(Record):
    rank: int
    client_id: str
    hostname: str | None = None
    gpu_index: int
    gpu_name: str | None = None
    kind: SlotKind = SlotKind.CUDA


class Master(Record):
    addr: str
    port: int


class RankState(Record):
    """What a rank last reported; the optional parts appear once known."""
    status: RankStatus
    started_at: float | None = Field(default=None, exclude_if=_absent)
    ended_at: float | None = Field(default=None, exclude_if=_absent)
    #: sha256 of the rank's trained weights: equal on every rank after a correct run.
    fingerprint: str | None = Field(default=None, exclude_if=_absent)
    #: DILOCO: sha256 of its parameters alone (the global weights), compared with the server's.
    global_fingerprint: str | None = Field(default=None, exclude_if=_absent)
    #: How its slot kept it (``Isolation``'s value), and a container's image and limits
    #: (``protocol.gpu.Terms``' fields), as its GPU client registered them when it started.
    isolation: str | None = Field(default=None, exclude_if=_absent)
    terms: dict[str, Any] | None = Field(default=None, exclude_if=_absent)
    #: What it holds of the model (``protocol.layout``), as it reported once the model was wrapped.
    layout: RankLayout | None = Field(default=None, exclude_if=_absent)


class DilocoJoin(Record):
    """DILOCO: a worker that joined a running job in a dropped worker's place."""
    client_id: str
    placed_at: float
    #: The first round it uploads to; None while it waits for the global weights.
    round: int | None = None
    #: The worker whose global weights and outer optimizer state it started from.
    state_from: int | None = Field(default=None, exclude_if=_absent)


class Suspect(Record):
    """A rank named dishonest: a DILOCO worker whose pseudo-gradients were outliers round after
    round (``zwdx.robust.flags``, then dropped), one a spot or step check named, or one whose
    final weights were not its peers'. Kept across attempts: its key in ``Job.suspects`` is its
    rank, or ``<rank>@<attempt>`` where that rank was named in an earlier attempt already."""
    #: The rank it held when named (None in records written before: the key says it) and the
    #: attempt it was named in.
    rank: int | None = Field(default=None, exclude_if=_absent)
    attempt: int = 0
    client_id: str | None = None
    #: The donor token its GPU client registered with (its id): revoke it to keep the donor out.
    token_id: str | None = None
    #: The rounds it was flagged in, in a row, up to when it was named.
    rounds: list[int]
    reason: str
    at: float


class Shadow(Record):
    """DILOCO spot checks (``verify``): one more slot of the job that runs worker ``of``'s rank
    again; its uploads are compared with the worker's, never averaged (``zwdx.verify``)."""
    #: The worker's rank it runs again (drawn by the server; the worker is not told).
    of: int
    client_id: str
    #: The last round it uploaded (-1: none yet): the server keeps what it still needs (its
    #: worker's uploads, the averages) from there on, up to ``shadows.MAX_LAG`` rounds back.
    round: int = -1
    #: The rounds in which its upload and the worker's agreed.
    agreed: list[int] = Field(default_factory=list)
    #: The rounds in which they did not, and why (the suspects say who was named).
    disagreed: dict[str, str] = Field(default_factory=dict)
    #: Why it stopped (its process failed, its GPU client was lost): the job went on without it.
    gone: str | None = Field(default=None, exclude_if=_absent)
    #: DDP/FSDP step checks: the sha256 of its final weights, as it reported at its end (before the
    #: ranks report theirs); held with the ranks' against the weights that came back
    #: (``zwdx.server.suspects.compare_upload``).
    fingerprint: str | None = Field(default=None, exclude_if=_absent)


class RankFailure(Record):
    traceback: str
    #: When the server heard of it (None: recorded by a zwdx that did not say).
    at: float | None = None
    kind: FailureKind | None = None
    #: DDP with ``verify``: the step check that stopped the rank, as it reported it; kept until
    #: the attempt settles, when the one a strict majority of the ranks gave is believed.
    check: StepCheck | None = Field(default=None, exclude_if=_absent)


class TimelineEntry(Record):
    """A change of status; the optional parts appear only where they apply."""
    status: JobStatus
    at: float
    reason: str | None = Field(default=None, exclude_if=_absent)
    attempt: int | None = Field(default=None, exclude_if=_absent)
    world_size: int | None = Field(default=None, exclude_if=_absent)
    #: The checkpoint a resuming job goes on from.
    checkpoint: int | None = Field(default=None, exclude_if=_absent)


class RankCredential(Record):
    """One rank's key of the current attempt: only its sha256, and the GPU client it was sent to.
    A request that carries the key speaks for this rank, of this attempt, while the job runs."""
    hash: str
    client_id: str
    attempt: int


class RestartEntry(Record):
    at: float
    reason: str
    #: The tracebacks of the attempt that was interrupted, by rank.
    failures: dict[str, str] = Field(default_factory=dict)
    from_checkpoint: CheckpointEntry | None = None


class AutoChoice(Record):
    """What ``parallelism="AUTO"`` became as the job was placed (``zwdx.server.auto``), and why."""
    parallelism: Parallelism
    reason: str
    at: float


class JobFields(Record):
    """The fields a job's record and its view share."""
    id: str
    room_id: str
    #: Its place in the submission order (the store assigns it).
    seq: int | None = None
    status: JobStatus
    name: str = ""
    created_at: float
    spec: JobSpec
    #: Ranks of the current (or last) attempt; None until placed.
    world_size: int | None = None
    timeline: list[TimelineEntry] = Field(default_factory=list)
    #: Why a queued or resuming job waits, in words.
    waiting_reason: str | None = None
    #: An AUTO job: the mode chosen as it was placed and why (its ``spec.strategy`` is that mode's).
    auto: AutoChoice | None = None
    # -- the current attempt (set when placed) ---------------------------------------------
    attempt: int = 0
    placement: list[PlacementEntry] | None = None
    backend: Literal["nccl", "gloo"] | None = None
    master: Master | None = None
    started_at: float | None = None
    running_at: float | None = None
    #: rank -> what it last reported
    ranks: dict[str, RankState] = Field(default_factory=dict)
    #: rank -> exit code of its process, as its GPU client reported
    exits: dict[str, int] = Field(default_factory=dict)
    #: DILOCO: rank -> the worker that joined in its place while the job ran (this attempt)
    joins: dict[str, DilocoJoin] = Field(default_factory=dict)
    #: rank (``<rank>@<attempt>`` when that rank was named in an earlier attempt) -> why it was
    #: named a suspect; kept across attempts (``suspect_key``, ``suspected``).
    suspects: dict[str, Suspect] = Field(default_factory=dict)
    #: DILOCO with ``verify``: shadow's rank (its slot, numbered from ``world_size`` on, whose key
    #: it holds) -> the worker it runs again and what the comparisons found; this attempt.
    shadows: dict[str, Shadow] = Field(default_factory=dict)
    #: A rank lost its peers: failed unless a GPU client turns out lost (then resuming).
    suspect_since: float | None = None
    suspect_reason: str | None = None
    #: A rank's own code raised: the job fails once every rank reported, or after a grace.
    failing_since: float | None = None
    failing_reason: str | None = None
    # -- the end ---------------------------------------------------------------------------
    ended_at: float | None = None
    #: Why it failed or was cancelled.
    reason: str | None = None
    results: dict[str, Measured] | None = None
    final_loss: Reported | None = None
    weights_artifact: str | None = None
    #: What the submitter should know about the result (the ranks' final weights differ, ...).
    warnings: list[str] = Field(default_factory=list)
    #: A script job: the files its rank 0 wrote under ``$ZWDX_OUTPUT_DIR`` (a tar), last attempt's.
    outputs_artifact: str | None = None
    # -- restarts and checkpoints ----------------------------------------------------------
    restarts: int = 0
    restart_history: list[RestartEntry] = Field(default_factory=list)
    #: Placements that did not start (no rendezvous address, or no rank running in time), and
    #: the GPU clients that held them: the job is not placed on those again.
    start_failures: int = 0
    avoid: list[str] = Field(default_factory=list)
    latest_checkpoint: CheckpointEntry | None = None
    #: The last ``spec.keep_checkpoints`` committed, oldest first.
    checkpoints: list[CheckpointEntry] = Field(default_factory=list)


class Job(JobFields):
    """The record the store keeps."""

    def suspected(self) -> set[int]:
        """The ranks named suspects in this attempt (a rank named in an earlier one may be
        another GPU client now)."""
        return {suspect_rank(k, s) for k, s in self.suspects.items() if s.attempt == self.attempt}

    def suspect_key(self, rank: int) -> str:
        """Where a suspect named now at ``rank`` goes in ``suspects``, keeping earlier ones."""
        return str(rank) if str(rank) not in self.suspects else f"{rank}@{self.attempt}"

    #: rank -> its failure, this attempt
    failures: dict[str, RankFailure] = Field(default_factory=dict)
    #: rank -> the key its rank process holds, this attempt (never shown; replaced at each start).
    rank_keys: dict[str, RankCredential] = Field(default_factory=dict)


def suspect_rank(key: str, suspect: Suspect | dict[str, Any]) -> int:
    """The rank a ``suspects`` entry was named at: its ``rank``, or its key's (older records)."""
    rank = suspect.rank if isinstance(suspect, Suspect) else suspect.get("rank")
    return int(rank) if rank is not None else int(key.split("@")[0])


class FailureInfo(Answer):
    at: float | None = None
    kind: FailureKind | None = None


def failure_order(failures: dict[str, RankFailure]) -> list[str]:
    """The failing ranks, first failure first: ranks whose own code raised before ranks that
    only lost their peers (a collective broke, a process died without a word), then by when
    the server heard of each, then by rank."""
    def key(rank: str) -> tuple[bool, float, int]:
        failure = failures[rank]
        lost_peers = failure.kind != FailureKind.RAISED
        at = failure.at if failure.at is not None else float("inf")
        return lost_peers, at, int(rank) if rank.isdigit() else 0
    return sorted(failures, key=key)


class JobView(JobFields):
    """A job as the REST API, the SDK and the dashboard see it."""

    #: rank -> traceback
    failures: dict[str, str] = Field(default_factory=dict)
    #: rank -> when the server heard of its failure, and how it failed
    failure_info: dict[str, FailureInfo] = Field(default_factory=dict)
    #: The failing ranks, first failure first (see ``failure_order``).
    failure_order: list[str] = Field(default_factory=list)
    #: 1 for the head of the room's queue; only in ``GET /jobs/<id>`` of a queued job.
    queue_position: int | None = Field(default=None, exclude_if=_absent)

    @classmethod
    def of(cls, job: Job, **extra: Any) -> JobView:
        fields = job.model_dump(exclude={"failures", "rank_keys"})
        return cls.model_validate({
            **fields, **extra,
            "failures": {rank: f.traceback for rank, f in job.failures.items()},
            "failure_info": {rank: {"at": f.at, "kind": f.kind} for rank, f in job.failures.items()},
            "failure_order": failure_order(job.failures)})


class Submitted(JobView):
    """The answer to ``POST /jobs``."""
    #: Why the room as it is now could never run the job (it waits anyway); None when it could.
    unschedulable: str | None = None


__all__ = ["CheckpointEntry", "AutoChoice", "Suspect", "Shadow", "JobSpec", "PlacementEntry", "Master", "RankState", "RankFailure", "TimelineEntry",
           "RankCredential", "RestartEntry", "JobFields", "Job", "FailureInfo", "failure_order", "JobView", "Submitted"]
