"""What a job's rank processes report over REST, with the job's key: metric and log events,
their start, result or failure, and the checkpoints they commit (``zwdx.protocol.rest`` has the
rest of the API). The numbers a rank measured may be NaN or infinite (a loss that diverged):
they are kept as they are, and travel as the strings "NaN", "Infinity" and "-Infinity" (JSON
has no such numbers; ``Reported``), in both directions, to the store and back.

    EventsBatch of EventIn -> Stored            POST /api/v1/jobs/<id>/events
    RankReport -> RankReportAnswer              POST /api/v1/jobs/<id>/ranks/<rank>
    CheckpointCommit -> CheckpointEntry         POST /api/v1/jobs/<id>/checkpoints/<n>/commit
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import AfterValidator, BeforeValidator, Field, PlainSerializer, StringConstraints, WithJsonSchema, \
    model_validator
from typing_extensions import TypeAliasType

from .base import Answer, ByValue, Count, Id, Tolerant
from .vocab import CheckpointFormat, EventKind, RankStatus

#: A metric's or a result's name.
Key = Annotated[str, StringConstraints(min_length=1, max_length=200)]


def _not_dots(name: str) -> str:
    if name in (".", ".."):
        raise ValueError("a file name cannot be . or ..")
    return name


#: The numbers JSON cannot carry, as the strings that carry them: JavaScript's spelling
#: (``String(NaN)``), which ``float()`` in Python and ``Number()`` in a browser read back.
NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def from_wire(value: Any) -> Any:
    """``value`` with the strings of ``NON_FINITE`` read back as floats, in lists and dicts too
    (what the SDK does with the numbers a job reported)."""
    if isinstance(value, str):
        return NON_FINITE.get(value, value)
    if isinstance(value, list):
        return [from_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: from_wire(v) for k, v in value.items()}
    return value


def to_wire(value: Any) -> Any:
    """``value`` with every NaN or infinite float written as its string of ``NON_FINITE``, in
    lists and dicts too (what a rank sends: ``requests`` refuses NaN in JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, (list, tuple)):
        return [to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    return value


def _read_non_finite(value: object) -> object:
    return NON_FINITE[value] if isinstance(value, str) and value in NON_FINITE else value


#: A number the ranks reported: NaN and infinities are numbers here (a loss that diverged). In
#: JSON a finite one is a number and the others are "NaN", "Infinity", "-Infinity" (a literal
#: NaN in a request body is refused, as it is no JSON).
Reported = Annotated[float, Field(allow_inf_nan=True), BeforeValidator(_read_non_finite),
                     PlainSerializer(to_wire, when_used="json"),
                     WithJsonSchema({"anyOf": [{"type": "number"}, {"enum": list(NON_FINITE)}]})]


def clipped(limit: int, keep: str = "head") -> AfterValidator:
    """Text cut to ``limit`` characters (the head, or the tail of a traceback) instead of refused:
    a rank's failure is recorded however long its message."""
    def clip(text: str) -> str:
        if len(text) <= limit:
            return text
        return text[:limit] if keep == "head" else "..." + text[-(limit - 3):]
    return AfterValidator(clip)


#: A JSON value that a rank measured or returned: its numbers may be NaN or infinite.
if TYPE_CHECKING:  # the same recursive type, as mypy reads one
    Measured = Union[int, float, str, bool, None, list["Measured"], dict[str, "Measured"]]
else:
    Measured = TypeAliasType("Measured", Union[int, Reported, str, bool, None, list["Measured"],
                                               dict[str, "Measured"]])

#: A checkpoint file's name: letters, digits and ``._-``, not ``.`` or ``..``.
FileName = Annotated[str, StringConstraints(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._-]+$"),
                     AfterValidator(_not_dots)]


class EventIn(Tolerant):
    """One metric or log event a rank reports; a metric's values are numbers (NaN and
    infinities too, as "NaN", "Infinity", "-Infinity": a loss that diverged) or null."""
    kind: Annotated[EventKind, ByValue]
    rank: Annotated[int, Field(ge=0, le=100_000)] | None = None
    #: Unique per job and rank: a batch sent twice is stored once.
    key: Annotated[str, StringConstraints(min_length=1, max_length=100)] | None = None
    step: Count | None = None
    data: dict[Key, Measured]
    ts: Annotated[float, Field(ge=0, le=1e11)] | None = None

    @model_validator(mode="after")
    def _shape(self) -> EventIn:
        if self.kind is EventKind.METRIC:
            if len(self.data) > 200:
                raise ValueError("a metric event holds at most 200 values")
            for name, value in self.data.items():
                if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                    raise ValueError(f"metric {name!r} must be a number, \"NaN\", \"Infinity\", \"-Infinity\" "
                                     f"or null, got {type(value).__name__}")
        elif self.kind is EventKind.LOG:
            text = self.data.get("text")
            if isinstance(text, float) and not math.isfinite(text):  # a line that reads "NaN": text, not a number
                self.data["text"] = to_wire(text)
            if set(self.data) != {"text"} or not isinstance(self.data["text"], str) or \
                    len(self.data["text"]) > 100_000:
                raise ValueError("a log event's data is {\"text\": a string of at most 100000 characters}")
        return self


class EventsBatch(Tolerant):
    """``POST /api/v1/jobs/<id>/events``: up to 1,000 events."""
    events: Annotated[list[EventIn], Field(max_length=1000)]


class Stored(Answer):
    """How many of the batch's events were new (a batch sent twice is stored once)."""
    stored: int


class StepCheck(Tolerant):
    """DDP or FSDP with ``verify``: a step check that disagreed, as the reporting rank saw it.
    Every rank of the job (workers and shadows) holds every rank's gradients of the step (FSDP:
    and weight shards), so each reports the same account; the server believes the one a strict
    majority of them gave."""
    #: The backward pass of this attempt (counted from 0) and the gradient bucket (FSDP: unit).
    step: Count
    bucket: Count
    #: What disagreed: a bucket of the step's ``gradients``; or (FSDP) the ``weights``, each rank's
    #: stored shard as the step's forward pass began, before FSDP all-gathered it (``bucket`` 0).
    what: Literal["gradients", "weights"] = "gradients"
    #: The workers whose shadows disagreed with them: worker rank -> {shadow rank: relative L2
    #: distance} (a shadow's rank is its own, from ``world_size`` on; -1: sizes differ).
    distances: Annotated[dict[Annotated[str, StringConstraints(pattern=r"^[0-9]{1,7}$")],
                              Annotated[dict[Annotated[str, StringConstraints(pattern=r"^[0-9]{1,7}$")],
                                             Annotated[float, Field(ge=-1)]], Field(max_length=64)]],
                         Field(min_length=1, max_length=4096)]
    #: Who ``zwdx.verify.decide`` names (rank -> why), workers and shadows alike.
    named: Annotated[dict[Annotated[str, StringConstraints(pattern=r"^[0-9]{1,7}$")],
                          Annotated[str, clipped(500)]], Field(max_length=8192)]

    @property
    def where(self) -> str:
        """What disagreed, said in a line: ``the weights``, or ``bucket <bucket>``."""
        return "the weights" if self.what == "weights" else f"bucket {self.bucket}"


class RankReport(Tolerant):
    """``POST /api/v1/jobs/<id>/ranks/<rank>``: a rank started, completed or failed."""
    status: Annotated[RankStatus, ByValue]
    #: What train_func and eval_func returned (rank 0's are the job's).
    results: Annotated[dict[Key, Measured], Field(max_length=200)] | None = None
    final_loss: Reported | None = None
    #: sha256 of the rank's trained weights.
    fingerprint: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")] | None = None
    #: DILOCO: sha256 of its parameters alone (the global weights every worker holds after the
    #: last round; buffers such as BatchNorm's are each worker's own), as ``fingerprint`` over them.
    global_fingerprint: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")] | None = None
    #: Rank 0: the id of the weights it uploaded (``PUT /jobs/<id>/weights``), an artifact of
    #: this job; anything else is refused.
    weights_artifact: Id | None = None
    error: Annotated[str, clipped(1000)] | None = None
    traceback: Annotated[str, clipped(200_000, keep="tail")] | None = None
    #: The failure came from torch.distributed (the rank lost its peers).
    collective: bool = False
    #: A script job's rank: its script exited with this code (negative: killed by that signal).
    #: zwdx cannot tell the script's own error from a lost peer, so the job waits, as for a lost
    #: peer, to see whether a GPU client was lost (it resumes then) before failing.
    exit_code: Annotated[int, Field(ge=-255, le=255)] | None = None
    #: DDP with ``verify``: the step check whose disagreement stopped this rank (``failed`` only).
    check: StepCheck | None = None

    @model_validator(mode="after")
    def _reported(self) -> RankReport:
        if self.status is RankStatus.DROPPED:
            raise ValueError("a rank reports running, completed or failed; the server drops a lost DILOCO worker")
        if self.check is not None and self.status is not RankStatus.FAILED:
            raise ValueError("check: only a failed rank reports the step check that stopped it")
        return self


class RankReportAnswer(Answer):
    """``ok``; or ``ok: false`` and why the report was ``ignored`` (the job is no longer active)."""
    ok: bool
    ignored: str | None = Field(default=None, exclude_if=lambda value: value is None)


class CheckpointCommit(Tolerant):
    """``POST /api/v1/jobs/<id>/checkpoints/<n>/commit`` (rank 0, its rank key)."""
    files: Annotated[list[FileName], Field(min_length=1, max_length=4096)]
    epoch: Count | None = None
    step: Count | None = None
    format: Annotated[CheckpointFormat, ByValue] | None = None
    epoch_complete: bool = True


__all__ = ["NON_FINITE", "from_wire", "to_wire", "Key", "Reported", "clipped", "Measured", "FileName", "EventIn", "EventsBatch", "Stored", "StepCheck", "RankReport",
           "RankReportAnswer", "CheckpointCommit"]
