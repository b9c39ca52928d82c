"""PIPELINE: what a submitter sets (``submit_job(..., pipeline={...})``).

    PipelineSettings   SubmitJob.pipeline -> JobSpec.pipeline -> JobAssign.pipeline -> RankSpec.pipeline

The model is cut into as many stages as the job has ranks, one stage a rank, in rank order
(``gpu_client/rank/strategies/pipeline.py``); with the ``interleaved1f1b`` schedule, ``stages_per_rank`` stages a
rank (rank r runs stages r, r + ranks, ...). Where it is cut: ``stage_plan``, either ranges of the model's
repeated blocks (``[[0, 6], [6, 12]]``: blocks 0 to 5 on rank 0, 6 to 11 on rank 1; the modules
before the blocks go with the first stage, those after with the last; a model without repeated
blocks: the children of its outermost nn.Sequential) or the names of the
modules each stage after the first begins at (``["transformer.h.6"]``); left out, the blocks are
cut by each GPU's speed as far as its memory holds them (evenly on CPU slots). Which blocks a model has is checked where the model is, by the SDK before upload.
"""
from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import Field, field_validator, model_validator

from .base import ByValue, Message
from .vocab import PipelineSchedule

#: A module's name in the model (``transformer.h.6``), as ``named_modules`` says it.
_MODULE = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")
#: The most stages a plan may name.
MAX_STAGES = 1024
#: The most stages one rank may run (interleaved).
MAX_VIRTUAL = 64


class PipelineSettings(Message):
    #: GPipe (every forward, then every backward) or 1F1B (one forward, one backward).
    schedule: Annotated[PipelineSchedule, ByValue] = PipelineSchedule.GPIPE
    #: How many micro-batches each batch is split into; None: the number of stages.
    microbatches: Annotated[int, Field(ge=1, le=65_536)] | None = None
    #: Ranges ``[start, end)`` of the repeated blocks, one a stage; or the module names where the
    #: stages after the first begin; None: the blocks cut evenly.
    stage_plan: list[Any] | None = None
    #: How many stages each rank runs (rank r: stages r, r + ranks, r + 2 ranks, ...): more than one
    #: with ``interleaved1f1b`` only, which runs 2 by default (or as many as its plan names a rank).
    stages_per_rank: Annotated[int, Field(ge=1, le=MAX_VIRTUAL)] | None = Field(
        default=None, exclude_if=lambda value: value is None)

    @field_validator("schedule", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("stage_plan", mode="before")
    @classmethod
    def _plan(cls, value: Any) -> list[Any] | None:
        if value is None:
            return None
        if not isinstance(value, (list, tuple)) or not value:
            raise ValueError("must be a non-empty list of block ranges [start, end] or of module names")
        if len(value) > MAX_STAGES:
            raise ValueError(f"must have at most {MAX_STAGES} entries")
        if all(isinstance(v, str) for v in value):
            return _module_names(list(value))
        return _block_ranges(value)

    @model_validator(mode="after")
    def _per_rank(self) -> PipelineSettings:
        interleaved = self.schedule == PipelineSchedule.INTERLEAVED_ONE_F_ONE_B
        if not interleaved and (self.stages_per_rank or 1) > 1:
            raise ValueError(f"stages_per_rank: a rank runs several stages with the interleaved1f1b schedule "
                             f"only, not {self.schedule.value}")
        if interleaved and self.stages_per_rank == 1:
            raise ValueError("stages_per_rank: interleaved1f1b runs at least 2 stages a rank (1f1b runs one)")
        if interleaved and self.stages is not None and self.stages_per_rank is not None \
                and self.stages % self.stages_per_rank:
            raise ValueError(f"stage_plan names {self.stages} stages, which {self.stages_per_rank} stages a rank "
                             f"cannot share out evenly")
        return self

    @property
    def stages(self) -> int | None:
        """How many stages the plan names (None: as many as the job's ranks, times ``stages_per_rank``)."""
        if self.stage_plan is None:
            return None
        return len(self.stage_plan) + 1 if isinstance(self.stage_plan[0], str) else len(self.stage_plan)

    def resolved(self, world_size: int | None) -> "PipelineSettings":
        """The settings with ``stages_per_rank`` set (a job of ``world_size`` ranks; None: not
        known yet), or ``ValueError`` saying why the plan and the ranks do not fit."""
        per = self.stages_per_rank
        if self.schedule != PipelineSchedule.INTERLEAVED_ONE_F_ONE_B:
            per = 1
        elif per is None:
            per = self.stages // world_size if self.stages and world_size and self.stages >= 2 * world_size else 2
        stages = self.stages
        if stages is not None and world_size is not None and stages != world_size * per:
            raise ValueError(f"stage_plan names {stages} stage(s) but world_size is {world_size}"
                             f"{f' with {per} stages a rank' if per > 1 else ''}: "
                             f"{'one stage a rank' if per == 1 else 'the same number of stages a rank'}")
        if stages is not None and stages % per:
            raise ValueError(f"stage_plan names {stages} stages, which {per} stages a rank cannot share out evenly")
        if per > 1 and self.microbatches is not None and world_size:
            rounds = max(1, self.microbatches // world_size)
            if self.microbatches % rounds:
                raise ValueError(f"microbatches: interleaved1f1b runs them in rounds of the ranks' number "
                                 f"({world_size}): {self.microbatches} is not a multiple of {rounds} rounds")
        return self.model_copy(update={"stages_per_rank": per if per > 1 else None})



def _module_names(names: list[str]) -> list[Any]:
    """A plan of module names: each a module's dotted name, none twice."""
    bad = next((v for v in names if not _MODULE.match(v) or len(v) > 300), None)
    if bad is not None:
        raise ValueError(f"must name modules (like 'transformer.h.6'), got {bad!r}")
    if len(set(names)) != len(names):
        raise ValueError("names a module twice")
    return list(names)


def _block_ranges(value: list[Any] | tuple[Any, ...]) -> list[Any]:
    """A plan of block ranges [start, end]: from block 0, each after the one before, none empty."""
    ranges = []
    for v in value:
        if (not isinstance(v, (list, tuple)) or len(v) != 2
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in v)):
            raise ValueError(f"must be a list of block ranges [start, end] (whole numbers) or of module names, "
                             f"got {v!r}")
        ranges.append([v[0], v[1]])
    if ranges[0][0] != 0:
        raise ValueError(f"must start at block 0, got {ranges[0][0]}")
    for (start, end), nxt in zip(ranges, ranges[1:] + [None]):
        if end <= start:
            raise ValueError(f"range [{start}, {end}] must hold at least one block")
        if nxt is not None and nxt[0] != end:
            raise ValueError(f"ranges must follow each other: [{start}, {end}] then [{nxt[0]}, {nxt[1]}]")
    return ranges


__all__ = ["PipelineSettings", "MAX_STAGES"]
