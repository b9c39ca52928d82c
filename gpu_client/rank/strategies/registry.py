"""The strategy a rank trains with, looked up by its job's strategy type: each class is imported
when a rank of its type starts (a DDP rank never imports the pipeline's tracer). The strategy
modules import ``parallel.Collective``, their base; none imports this one or another strategy."""
from __future__ import annotations

from importlib import import_module

from gpu_client.rank.tuning import Tuning

#: Strategy type -> (module under gpu_client.rank.strategies, class, whether it takes the reporter).
STRATEGIES: dict[str, tuple[str, str, bool]] = {
    "DDP": ("parallel", "Collective", False),
    "FSDP": ("parallel", "Collective", False),
    "TP": ("tensor_parallel", "TensorParallel", False),
    "FSDP+TP": ("tensor_parallel", "TensorParallel", False),
    "PIPELINE": ("pipeline", "Pipeline", False),
    "DILOCO": ("diloco", "Diloco", True),
    "mixed": ("mixed", "Mixed", True),
}


def strategy_type(spec) -> str:
    """The key of ``STRATEGIES`` for a rank's spec: its parallelism, or ``mixed`` for a DDP or
    FSDP job over mixed devices."""
    kind = spec.parallelism.value
    if kind in ("DDP", "FSDP") and spec.devices.value == "mixed":
        return "mixed"
    return kind


def strategy(spec, reporter, tuning: Tuning | None = None):
    """The rank's strategy: ``Diloco`` for a DILOCO job, ``Pipeline`` for PIPELINE,
    ``TensorParallel`` for TP and FSDP+TP, ``Mixed`` for a job over mixed devices,
    ``Collective`` for DDP and FSDP; with the GPU client's ``tuning``."""
    module, name, takes_reporter = STRATEGIES[strategy_type(spec)]
    cls = getattr(import_module(f"{__package__}.{module}"), name)
    chosen = cls(spec, reporter) if takes_reporter else cls(spec)
    if tuning is not None:
        chosen.tuning = tuning
    return chosen
