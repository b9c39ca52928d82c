"""DILOCO: what a submitter sets (``submit_job(..., diloco={...})``), and what the server says
of a round of outer steps (``zwdx.server.diloco``; the bytes' format is ``zwdx.codec``).

    DilocoSettings   SubmitJob.diloco -> JobSpec.diloco -> JobAssign.diloco -> RankSpec.diloco
    RoundUpload      the query of PUT /api/v1/jobs/<id>/diloco/rounds/<round> (a worker's upload)
    RoundState       its answer, and GET .../rounds/<round>'s while the round still waits (202)

A round is one outer step: every worker of the job's current attempt uploads its pseudo-gradient
(global weights - its local weights), the server averages them once all are in, and every
worker fetches the average and applies it with its outer optimizer.
"""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from .base import Answer, ByValue, Id, Message
from .vocab import Aggregate, Compression


class DilocoSettings(Message):
    """DiLoCo's knobs (arXiv 2311.08105); every one has the paper's default."""
    #: H: the inner optimizer's steps between two outer steps.
    inner_steps: Annotated[int, Field(ge=1, le=10_000_000)] = 500
    #: The outer optimizer's (SGD) learning rate.
    outer_lr: Annotated[float, Field(gt=0, le=100)] = 0.7
    #: Its momentum (0: none).
    outer_momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    #: Nesterov momentum (needs ``outer_momentum`` above 0; left out with a momentum of 0: off).
    nesterov: bool = True
    #: How pseudo-gradients travel: int8 with a scale per block, fp16, or none (float32).
    compression: Annotated[Compression, ByValue] = Compression.INT8
    #: Seconds a round waits for its last workers after its first upload, then is averaged over
    #: those in (the others missed it, and fetch that average); None: the job's collective_timeout.
    round_timeout: Annotated[float, Field(gt=0, le=7 * 24 * 3600)] | None = None
    #: A round's transfer overlaps the next round's compute: a worker uploads round k and trains
    #: on, and applies round k's average at round k+1 (a one-step delay). Off, as in the DiLoCo,
    #: OpenDiLoCo and INTELLECT-1 runs: a worker waits for each round's average.
    overlap: bool = False
    #: Where the workers reach each other (tried at the job's start: a gloo group over the
    #: rendezvous address of rank 0's GPU client), a round averages by all-reduce among them
    #: instead of through the server; False: always through the server.
    all_reduce: bool = True
    #: The ranks of one worker: one GPU client's, training as DDP among themselves over their
    #: local link and taking the outer steps together (the job's ``gpus_per_client``; a divisor
    #: of its ``world_size``). 1: every rank a worker of its own.
    ranks_per_worker: Annotated[int, Field(ge=1, le=1024)] = 1
    #: How a round combines the pseudo-gradients (``zwdx.robust``): "robust" clips each to the
    #: round's median norm and takes a coordinate-wise trimmed mean, so that a dishonest worker
    #: cannot steer the global weights; "mean" trusts every worker. The workers' own all-reduce
    #: (``all_reduce``) all-gathers instead under "robust".
    aggregate: Annotated[Aggregate, ByValue] = Aggregate.ROBUST
    #: "robust": values dropped per side and coordinate; None: (workers - 1) // 3.
    trim: Annotated[int, Field(ge=0, le=512)] | None = None
    #: A worker whose pseudo-gradient is an outlier (``zwdx.robust.flags``) this many rounds in a
    #: row is a suspect: named in the job's record and dropped from the job. 0: never.
    suspect_after: Annotated[int, Field(ge=0, le=10_000)] = 5
    #: Spot checks (``zwdx.verify``): shadow workers, as many as this fraction of the workers
    #: (ceil(verify * workers); above 1, some workers get two). A shadow is one more GPU client
    #: slot that runs a worker's rank again (its shard, its seeds); its uploads are compared with
    #: the worker's every round and never averaged; which workers are shadowed the server draws and
    #: tells no one. A disagreement names a suspect. Rounds then go through the server. 0: off.
    verify: Annotated[float, Field(ge=0, le=4)] = 0.0
    #: The relative L2 distance under which a worker's and its shadow's uploads agree (identical
    #: bytes always do). 0: bitwise, which CPUs with the same torch and thread count give; GPUs
    #: need a tolerance (cuDNN and atomics differ run to run), and a liar may hide that much.
    verify_tolerance: Annotated[float, Field(ge=0, le=1)] = 0.0
    #: The submitter's start weights (``POST /api/v1/diloco/start``, a safetensors of the model's
    #: state_dict, sent by the SDK at submit): the server steps its own copy of the global weights
    #: from them with every round's aggregate and returns those (``zwdx.server.global_weights``),
    #: never a worker's upload. None (an older SDK): the weights that come back are a worker's.
    start_weights: Id | None = Field(default=None, exclude_if=lambda v: v is None)

    @field_validator("nesterov")
    @classmethod
    def _needs_momentum(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("outer_momentum") == 0:
            raise ValueError("must be false when outer_momentum is 0 (Nesterov momentum needs a momentum)")
        return value

    @model_validator(mode="after")
    def _plain_sgd(self) -> DilocoSettings:
        if self.outer_momentum == 0 and "nesterov" not in self.model_fields_set:
            self.nesterov = False
        return self

    @field_validator("verify")
    @classmethod
    def _one_rank_workers(cls, value: float, info: ValidationInfo) -> float:
        if value and info.data.get("ranks_per_worker", 1) > 1:
            raise ValueError("must be 0 with ranks_per_worker above 1 (a shadow runs a worker of one rank)")
        return value


class RoundUpload(BaseModel):
    """The query of a worker's upload (as ``rest.Query``: strings read as their types, unknown
    parameters ignored)."""
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    #: The worker's last round: it trains no more, and the rounds after this one do not wait for it.
    last: bool = False


class RoundState(Answer):
    """Where one round of a DILOCO job stands."""
    job_id: str
    attempt: int
    round: int
    #: The average is made: ``GET .../rounds/<round>`` answers its bytes.
    ready: bool
    #: The ranks whose pseudo-gradients the round waits for, or waited for.
    expected: list[int]
    #: Those that uploaded theirs.
    uploaded: list[int]
    #: Those the round still waits for.
    waiting_for: list[int]
    #: The ranks whose pseudo-gradients the average holds (an upload of no values adds nothing).
    members: list[int] = []
    #: The ranks that said this or an earlier round was their last.
    left: list[int] = []
    #: Those the round waited for that did not upload in time (``round_timeout``) or were
    #: dropped meanwhile (their GPU client lost): the average went on without them.
    missed: list[int] = []
    #: The job's workers dropped so far (their GPU client or process lost).
    dropped: list[int] = []
    compression: Compression
    #: Bytes of the average, once made.
    size: int | None = None
    #: A worker joins: this rank sends the global weights and outer optimizer state after it
    #: applies this round's average (``PUT .../diloco/state/<round + 1>``).
    state_from: int | None = None


__all__ = ["DilocoSettings", "RoundUpload", "RoundState"]
