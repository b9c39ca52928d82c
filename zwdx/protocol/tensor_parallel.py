"""TP and FSDP+TP: what a submitter sets (``submit_job(..., tp_plan={...}, tp_size=n)``).

    tp_plan   SubmitJob.tp_plan -> JobSpec.tp_plan -> JobAssign.tp_plan -> RankSpec.tp_plan
    tp_size   SubmitJob.tp_size -> JobSpec.tp_size (None: the placement's) -> JobAssign.tp_size
              (resolved by the scheduler: the ranks of one GPU client) -> RankSpec.tp_size

A plan maps module names of the model, where ``*`` stands for one part of a name
(``"blocks.*.mlp.up"``, as ``torch.distributed.tensor.parallel.parallelize_module`` matches them), to
a style (``TpStyle``: ``colwise`` or ``rowwise``). Left out, the ranks derive one from the model
(``gpu_client/rank/strategies/tensor_parallel.py``). Which modules a plan names is checked where the model is,
by the SDK before upload; the server checks the plan's form here.
"""
from __future__ import annotations

import re
from typing import Any

from .vocab import Parallelism

#: A module name of a plan: dotted parts of letters, digits, ``_``, ``*`` and ``?``.
_PATTERN = re.compile(r"^[A-Za-z0-9_*?]+(\.[A-Za-z0-9_*?]+)*$")
#: The most entries a plan may have.
MAX_PLAN = 4096
#: The modes that split modules over a TP group.
MODES = (Parallelism.TP, Parallelism.FSDP_TP)


def check_plan(plan: dict[str, Any]) -> dict[str, Any]:
    """``plan`` with its form checked: a non-empty dict of module names (or patterns) to styles.
    ``ValueError`` naming the first entry that is not."""
    if not plan:
        raise ValueError("must name at least one module (or be left out: the plan is derived from the model)")
    if len(plan) > MAX_PLAN:
        raise ValueError(f"must have at most {MAX_PLAN} entries")
    bad = next((name for name in plan if len(name) > 300 or not _PATTERN.match(name)), None)
    if bad is not None:
        raise ValueError(f"must map module names (like 'blocks.*.mlp.up') to styles, got the name {bad!r}")
    return plan


__all__ = ["check_plan", "MAX_PLAN", "MODES"]
