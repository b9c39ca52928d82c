"""Where a PIPELINE job's model is cut (``gpu_client.rank.strategies.pipeline`` traces and runs the stages): the
plan's module names as given, or ranges of the model's units (``zwdx.model_rules.pipeline_units``:
its repeated blocks, else its nn.Sequential's children); left out, the units cut in proportion
to each stage's share, blocks by their number, children by their parameters (mixed layers
differ in size). A GPU's share: its measured speed, as far as its free memory holds its blocks.
"""
from __future__ import annotations

import torch
from torch import nn

from zwdx.model_rules import pipeline_units


def split_points(model: nn.Module, plan, stages: int, weights: list[float] | None = None) -> tuple[list[str], str]:
    """The module names where stages 1.. begin, and a line for the job's log. ``plan``: ranges of
    the model's units (its repeated blocks, else its nn.Sequential's children:
    ``zwdx.model_rules.pipeline_units``), module names, or None: the units cut in proportion to each
    stage's ``weights`` (None: evenly), blocks by their number, children by their parameters."""
    units, kind = pipeline_units(model)
    if plan is not None and isinstance(plan[0], str):
        known = dict(model.named_modules())
        missing = [name for name in plan if name not in known]
        if missing:
            raise ValueError(f"pipeline.stage_plan: the model has no module {missing[0]!r}")
        return list(plan), f"PIPELINE: {stages} stages, beginning at the root, {', '.join(plan)}"
    if not units and stages > 1:
        raise ValueError(f"PIPELINE: {type(model).__name__} has no repeated blocks (a ModuleList or Sequential of "
                         f"modules of one class) and no nn.Sequential to cut into stages; name the split points in "
                         f"pipeline.stage_plan")
    names, weights = [name for name, _ in units], weights or [1] * stages
    if plan is not None:
        ranges = plan
    elif kind == "children":
        ranges = sized_ranges([sum(p.numel() for p in unit.parameters()) for _, unit in units], weights)
    else:
        ranges = weighted_ranges(len(units), weights)
    if ranges[-1][1] != len(units) or len(ranges) != stages:
        raise ValueError(f"pipeline.stage_plan {ranges} must cover the model's {len(units)} {kind} in {stages} "
                         f"stage(s)")
    points = [names[start] for start, _ in ranges[1:]]
    shown = ", ".join(f"{names[a]}..{names[b - 1]}" for a, b in ranges)
    how = ", by parameters" if kind == "children" and plan is None else ""
    return points, f"PIPELINE: {stages} stages over {len(units)} {kind}{how}: {shown}"


#: What a block takes on its GPU, as a multiple of its parameters' bytes: the parameters, their
#: gradients and two optimizer moments (AdamW's), and half again for activations.
BLOCK_FOOTPRINT = 6.0


def speed_shares(blocks: int, free: list[float], speed: list[float], block_bytes: float) -> list[float]:
    """Each rank's share of ``blocks`` for the automatic cut: in proportion to its measured
    ``speed``, as long as its blocks fit its ``free`` memory (``BLOCK_FOOTPRINT`` times
    ``block_bytes`` a block); a rank whose share would not fit holds what fits and the others
    share the rest by speed. When the blocks fit nowhere that way: in proportion to free memory."""
    caps = [f / max(block_bytes * BLOCK_FOOTPRINT, 1.0) for f in free]
    if sum(caps) < blocks:
        return list(free)
    shares = [0.0] * len(free)
    open_, left = set(range(len(free))), float(blocks)
    while open_:
        total = sum(speed[i] for i in open_)
        want = {i: left * speed[i] / total for i in open_}
        full = {i for i in open_ if want[i] > caps[i]}
        if not full:
            for i in open_:
                shares[i] = want[i]
            break
        for i in full:
            shares[i] = caps[i]
            left -= caps[i]
        open_ -= full
    return shares


def matmul_speed(device, size: int = 2048, rounds: int = 10) -> float:
    """How fast ``device`` (a GPU) multiplies matrices, in floating-point operations a second:
    ``rounds`` half-precision products of two ``size`` x ``size`` matrices, timed on the device
    after one untimed (a few milliseconds on a current GPU)."""
    a = torch.randn(size, size, device=device, dtype=torch.float16)
    b = torch.randn(size, size, device=device, dtype=torch.float16)
    a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(rounds):
        a @ b
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1000
    return 2 * size ** 3 * rounds / max(seconds, 1e-9)


def weighted_ranges(blocks: int, weights: list[float]) -> list[list[int]]:
    """``blocks`` cut into one run a weight, each run's length in proportion to its weight: each
    cut at the block boundary nearest to the running share (halves up), at least one block a run."""
    stages = len(weights)
    if blocks < stages:
        raise ValueError(f"PIPELINE: {blocks} repeated block(s) cannot make {stages} stages; use fewer ranks")
    total, cuts, share = sum(weights), [0], 0
    for i, weight in enumerate(weights[:-1], start=1):
        share += weight
        cut = int((2 * blocks * share + total) // (2 * total))  # the nearest block boundary, halves up
        cuts.append(min(max(cut, cuts[-1] + 1), blocks - (stages - i)))
    cuts.append(blocks)
    return [[a, b] for a, b in zip(cuts, cuts[1:])]


def sized_ranges(sizes: list[int], weights: list[float]) -> list[list[int]]:
    """Units of ``sizes`` parameters (an nn.Sequential's children) cut into one run a weight, each
    run's parameters in proportion to its weight: each cut at the boundary nearest to the running
    share, the later one on a tie (a layer without parameters stays with the one before it), at
    least one unit a run."""
    units, stages = len(sizes), len(weights)
    if units < stages:
        raise ValueError(f"PIPELINE: {units} children cannot make {stages} stages; use fewer ranks")
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    total, cuts, share = sum(weights), [0], 0.0
    for i, weight in enumerate(weights[:-1], start=1):
        share += weight
        want = prefix[-1] * share / total
        cuts.append(min(range(cuts[-1] + 1, units - (stages - i) + 1), key=lambda k: (abs(prefix[k] - want), -k)))
    cuts.append(units)
    return [[a, b] for a, b in zip(cuts, cuts[1:])]
