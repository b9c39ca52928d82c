"""What a rank holds of the model, as names and words, for its layout (``zwdx.protocol.layout``,
made by the strategy's ``layout``: ``parallel.Collective`` and its subclasses).

A model's modules are named top-level-ish: a parameter belongs to the repeated block it sits in
(``transformer.h.3``, the blocks FSDP shards and a pipeline is cut between), else to its module's
first two levels (``transformer.wte``, ``lm_head``); runs of consecutive blocks are folded
(``transformer.h.0-5``), so a 96-layer model's stage is a handful of names.
"""
from __future__ import annotations

import re

from torch import nn

from zwdx.model_rules import repeated_blocks
from zwdx.protocol.layout import MAX_MODULES

#: The most characters of a layout's ``text``.
MAX_TEXT = 500

_NUMBERED = re.compile(r"^(.*)\.([0-9]+)$")


def held_modules(model: nn.Module, names=None, limit: int = MAX_MODULES) -> list[str]:
    """The modules of ``model`` that hold the tensors named ``names`` (its state dict's names;
    None: all of them), in the model's order, blocks folded into runs; at most ``limit``."""
    blocks = {name for name, _ in repeated_blocks(model)}
    wanted = None if names is None else set(names)
    owners: dict[str, None] = {}
    for key in model.state_dict():
        if wanted is None or key in wanted:
            owners.setdefault(owner(key, blocks), None)
    return fold(list(owners), limit)


def owner(key: str, blocks: set[str]) -> str:
    """The block ``key`` (a parameter's or buffer's name) sits in, else its module's first two levels."""
    parts = key.split(".")
    for i in range(1, len(parts)):
        prefix = ".".join(parts[:i])
        if prefix in blocks:
            return prefix
    return ".".join(parts[:min(2, len(parts) - 1)]) or "(root)"


def fold(names: list[str], limit: int = MAX_MODULES) -> list[str]:
    """Consecutive numbered names of one parent as one run (``h.0``, ``h.1``, ``h.2`` -> ``h.0-2``);
    past ``limit``, the last entry says how many more there are."""
    runs: list[list] = []  # [parent, first, last] or [name]
    for name in names:
        numbered = _NUMBERED.match(name)
        if numbered:
            parent, index = numbered.group(1), int(numbered.group(2))
            last = runs[-1] if runs else None
            if last and len(last) == 3 and last[0] == parent and last[2] == index - 1:
                last[2] = index
                continue
            runs.append([parent, index, index])
        else:
            runs.append([name])
    out = [run[0] if len(run) == 1 else f"{run[0]}.{run[1]}" if run[1] == run[2] else f"{run[0]}.{run[1]}-{run[2]}"
           for run in runs]
    if len(out) > limit:
        out = out[:limit - 1] + [f"... and {len(out) - limit + 1} more"]
    return out


def local_params(model: nn.Module) -> int:
    """Parameter elements held here: a sharded parameter (a DTensor) counts its local shard."""
    total = 0
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel()
    return total


def device_of(model: nn.Module) -> str | None:
    """Where the model's parameters are (``cuda:0``, ``cpu``), None without parameters."""
    param = next(model.parameters(), None)
    if param is None:
        return None
    device = param.device
    return f"{device.type}:{device.index}" if device.index is not None else device.type


def line(text: str) -> str:
    """``text`` as one line of at most ``MAX_TEXT`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT - 3] + "..."
