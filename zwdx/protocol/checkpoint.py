"""What a checkpoint is made of: the files each format holds, and which rank writes each one.
The ranks that write a checkpoint and the server that commits it read the same rules here.

The server decides a checkpoint's format from the job's parallelism (``format_for``), never
from what a rank says, and commits a checkpoint only when it holds exactly the files that
format requires of the attempt's world size (``required``, plus ``optional`` ones), each
uploaded by the attempt's ranks (by the rank that ``owner`` names, where the server knows who
sent a file).

    torch   (DDP)   state.pt      rank 0: model and optimizer state
                    rng-<r>.pt    each rank r: its random number generators
                    extra.pt      rank 0, when train_func tracks objects (optional)
                    each read with torch.load(weights_only=True), after checking that it names
                    no global beyond what that loader allows
    shards  (FSDP, and TP, FSDP+TP)
                    shard-<r>.safetensors   each rank r: its local shards of the model and the
                                            optimizer state, its generators' tensors
                    shard-<r>.json          each rank r: the index (the state's tree, each
                                            tensor's global shape and this shard's offsets)
                    no pickle anywhere (``gpu_client/rank/shards.py`` writes and reads them)
    stages  (PIPELINE)  stage-<r>.pt  each rank r: its stage's model and optimizer state
                    rng-<r>.pt    each rank r: its random number generators
                    extra.pt      rank 0, when train_func tracks objects (optional)
                    read as ``torch``'s files are

``dcp`` (torch.distributed.checkpoint, written by FSDP jobs of earlier versions) is neither
committed nor read: its ``.metadata`` is a pickle.
"""
from __future__ import annotations

import re
from typing import Any

from .vocab import CheckpointFormat, Parallelism

#: DDP: the model and optimizer state (rank 0).
STATE = "state.pt"
#: DDP: the state of the objects train_func gave to ``reporter.track`` (rank 0).
EXTRA = "extra.pt"

_PER_RANK = {
    CheckpointFormat.TORCH: (re.compile(r"^rng-(0|[1-9][0-9]{0,6})\.pt$"),),
    CheckpointFormat.SHARDS: (re.compile(r"^shard-(0|[1-9][0-9]{0,6})\.safetensors$"),
                              re.compile(r"^shard-(0|[1-9][0-9]{0,6})\.json$")),
    CheckpointFormat.STAGES: (re.compile(r"^stage-(0|[1-9][0-9]{0,6})\.pt$"),
                              re.compile(r"^rng-(0|[1-9][0-9]{0,6})\.pt$")),
}
_RANK_0 = {CheckpointFormat.TORCH: (STATE, EXTRA), CheckpointFormat.SHARDS: (), CheckpointFormat.STAGES: (EXTRA,)}


def format_for(parallelism: Parallelism | str) -> CheckpointFormat:
    """The format a job of this parallelism writes: ``shards`` for FSDP, TP and FSDP+TP (their
    DTensors' local shards), ``stages`` for PIPELINE, ``torch`` for the others."""
    return {Parallelism.FSDP: CheckpointFormat.SHARDS, Parallelism.TP: CheckpointFormat.SHARDS,
            Parallelism.FSDP_TP: CheckpointFormat.SHARDS,
            Parallelism.PIPELINE: CheckpointFormat.STAGES}.get(Parallelism(parallelism), CheckpointFormat.TORCH)


def writers(parallelism: Parallelism | str, world_size: int) -> int:
    """How many ranks write a checkpoint of a job of ``parallelism`` over ``world_size`` ranks:
    all of them, but a DILOCO job's checkpoint is its rank 0's alone (the global weights, the
    outer optimizer, its own state): its workers do not meet to checkpoint."""
    return 1 if Parallelism(parallelism) == Parallelism.DILOCO else world_size


def resumable(entry: Any, parallelism: Parallelism | str) -> bool:
    """Whether a job of ``parallelism`` may go on from the committed checkpoint ``entry``: only
    from one of the format it writes (never ``dcp``, nor another parallelism's)."""
    return entry is not None and CheckpointFormat(entry.format) == format_for(parallelism)


def rng_file(rank: int) -> str:
    """DDP: rank ``rank``'s generators."""
    return f"rng-{rank}.pt"


def shard_files(rank: int) -> tuple[str, str]:
    """FSDP: rank ``rank``'s tensors and its index."""
    return f"shard-{rank}.safetensors", f"shard-{rank}.json"


def stage_file(rank: int) -> str:
    """PIPELINE: rank ``rank``'s stage (its model and optimizer state)."""
    return f"stage-{rank}.pt"


def required(fmt: CheckpointFormat, world_size: int) -> set[str]:
    """Every file a checkpoint of ``fmt`` written by ``world_size`` ranks must hold."""
    fmt = CheckpointFormat(fmt)
    if fmt == CheckpointFormat.TORCH:
        return {STATE, *(rng_file(r) for r in range(world_size))}
    if fmt == CheckpointFormat.SHARDS:
        return {name for r in range(world_size) for name in shard_files(r)}
    if fmt == CheckpointFormat.STAGES:
        return {name for r in range(world_size) for name in (stage_file(r), rng_file(r))}
    return set()  # dcp: nothing is ever complete


def optional(fmt: CheckpointFormat) -> set[str]:
    """Files a checkpoint of ``fmt`` may hold beside the required ones."""
    return {EXTRA} if CheckpointFormat(fmt) in (CheckpointFormat.TORCH, CheckpointFormat.STAGES) else set()


def owner(fmt: CheckpointFormat, name: str, world_size: int) -> int | None:
    """The rank that writes file ``name`` of a checkpoint of ``fmt`` by ``world_size`` ranks;
    None when such a checkpoint has no file of that name."""
    fmt = CheckpointFormat(fmt)
    if name in _RANK_0.get(fmt, ()):
        return 0
    for pattern in _PER_RANK.get(fmt, ()):
        match = pattern.match(name)
        if match and int(match.group(1)) < world_size:
            return int(match.group(1))
    return None


def describe(fmt: CheckpointFormat, world_size: int) -> str:
    """The files of a checkpoint of ``fmt``, in words (for error messages)."""
    fmt = CheckpointFormat(fmt)
    last = world_size - 1
    if fmt == CheckpointFormat.TORCH:
        return f"state.pt, rng-0.pt .. rng-{last}.pt and optionally extra.pt"
    if fmt == CheckpointFormat.SHARDS:
        return f"shard-<rank>.safetensors and shard-<rank>.json for ranks 0 .. {last}"
    if fmt == CheckpointFormat.STAGES:
        return f"stage-<rank>.pt and rng-<rank>.pt for ranks 0 .. {last}, and optionally extra.pt"
    return "nothing: this format is not accepted"


__all__ = ["STATE", "EXTRA", "format_for", "writers", "resumable", "rng_file", "shard_files", "stage_file", "required", "optional", "owner", "describe"]
