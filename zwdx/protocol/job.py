"""The parts of a job's record that cross process boundaries.

``CheckpointEntry``: a committed checkpoint, as the job's record keeps it and as a resumed
attempt's ``JobAssign`` hands it to the GPU clients.
"""
from __future__ import annotations

from pydantic import Field

from .base import Answer
from .vocab import CheckpointFormat


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


__all__ = ["CheckpointEntry"]
