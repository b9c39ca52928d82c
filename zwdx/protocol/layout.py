"""What a rank holds of the model: its layout, as the strategy describes it once the model is
wrapped (``gpu_client.rank.strategies.parallel.Collective.layout``), for the job's page to draw.

    RankLayout -> RankReportAnswer            POST /api/v1/jobs/<id>/ranks/<rank>/layout

The server keeps it on the rank's state (``RankState.layout``), set only with that rank's own
key while the job is active, and the dashboard draws it live (``job_update``). It is written by
code that runs beside the job's own, so it is data like any a rank sends: every field bounded
(a layout over ``MAX_LAYOUT_CHARS`` of JSON is refused), names without control characters,
and shown as text, never markup.
"""
from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import Field, StringConstraints, model_validator

from .base import ByValue, Count, Message
from .vocab import LayoutRole

#: The most modules a layout names (folded: ``transformer.h.0-5`` is one).
MAX_MODULES = 64
#: The most characters of JSON a whole layout takes.
MAX_LAYOUT_CHARS = 16_384
#: The most virtual stages one rank runs (interleaved schedules).
MAX_VIRTUAL = 64

#: One line of text: no control characters (a newline, an escape).
Line = Annotated[str, StringConstraints(min_length=1, max_length=500, pattern=r"^[^\x00-\x1f\x7f-\x9f]+$")]
#: A module's name as ``named_modules`` says it, or a folded run (``transformer.h.0-5``).
ModuleName = Annotated[str, StringConstraints(min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f-\x9f]+$")]


def _unset() -> Any:
    """An optional field, left out of the JSON when it is not set."""
    return Field(default=None, exclude_if=lambda value: value is None)


#: A place in a group of ranks: whole numbers a rank can be.
Place = Annotated[int, Field(ge=0, le=100_000)]


class Mesh(Message):
    """TP and FSDP+TP: the rank's place on the 2-D mesh (its data-parallel and tensor-parallel index)."""
    dp: Place
    tp: Place
    dp_size: Annotated[int, Field(ge=1, le=100_000)]
    tp_size: Annotated[int, Field(ge=1, le=100_000)]

    @model_validator(mode="after")
    def _inside(self) -> Mesh:
        if self.dp >= self.dp_size or self.tp >= self.tp_size:
            raise ValueError("dp and tp must be below dp_size and tp_size")
        return self


class StagePlace(Message):
    """PIPELINE: which stage the rank runs (``index`` of ``of``), and with an interleaved schedule
    every virtual stage it runs (``virtual``, in order)."""
    index: Place
    of: Annotated[int, Field(ge=1, le=100_000)]
    virtual: Annotated[list[Place], Field(max_length=MAX_VIRTUAL)] | None = _unset()

    @model_validator(mode="after")
    def _inside(self) -> StagePlace:
        if self.index >= self.of or any(v >= self.of for v in self.virtual or []):
            raise ValueError("a stage index must be below 'of'")
        return self


class RankLayout(Message):
    """What this rank holds: its ``role`` and one ``text`` line a person reads; the rest where it applies."""
    role: Annotated[LayoutRole, ByValue]
    text: Line
    #: The modules it holds whole or in part (top-level-ish names, runs of blocks folded).
    modules: Annotated[list[ModuleName], Field(max_length=MAX_MODULES)] | None = _unset()
    #: Parameter elements held on this rank (a shard counted locally).
    params: Count | None = _unset()
    mesh: Mesh | None = _unset()
    stage: StagePlace | None = _unset()
    #: Mixed devices: this rank's per-step batch size, and its share of the gradient.
    batch: Annotated[int, Field(ge=1, le=2**31)] | None = _unset()
    weight: Annotated[float, Field(ge=0, le=1)] | None = _unset()
    device: Annotated[str, StringConstraints(pattern=r"^(cuda|cpu|mps|xpu)(:[0-9]{1,3})?$")] | None = _unset()

    @model_validator(mode="after")
    def _small(self) -> RankLayout:
        size = len(json.dumps(self.model_dump(mode="json", exclude_none=True)))
        if size > MAX_LAYOUT_CHARS:
            raise ValueError(f"a layout takes at most {MAX_LAYOUT_CHARS} characters of JSON, this one {size}")
        return self


__all__ = ["MAX_MODULES", "MAX_LAYOUT_CHARS", "MAX_VIRTUAL", "Mesh", "StagePlace", "RankLayout"]
