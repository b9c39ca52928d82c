"""The strategy a rank trains with, looked up by its job's strategy type: each class is imported
when a rank of its type starts (a DDP rank never imports the pipeline's tracer). The strategy
modules import ``parallel.Collective``, their base; none imports this one or another strategy."""
from __future__ import annotations

from importlib import import_module

from gpu_client.rank.tuning import Tuning

#: The spec's strategy type (``zwdx.protocol.spec``'s ``type``; FSDP with a ``tp`` dimension is
#: ``fsdp+tp``) -> (module under gpu_client.rank.strategies, class, whether it takes the reporter).
STRATEGIES: dict[str, tuple[str, str, bool]] = {
    "ddp": ("parallel", "Collective", False),
    "ddp+verify": ("step_check", "Checked", False),
    "fsdp": ("parallel", "Collective", False),
    "fsdp+verify": ("fsdp_check", "FsdpChecked", False),
    "tp": ("tensor_parallel", "TensorParallel", False),
    "fsdp+tp": ("tensor_parallel", "TensorParallel", False),
    "pipeline": ("pipeline", "Pipeline", False),
    "diloco": ("diloco", "Diloco", True),
    "mixed": ("mixed", "Mixed", True),
}


def strategy_type(job) -> str:
    """The key of ``STRATEGIES`` for a job's spec (``JobSpec``): its strategy's type (DDP with
    ``verify`` is ``ddp+verify``, FSDP's ``fsdp+verify``: step checks by shadow ranks)."""
    kind = job.strategy.type
    if kind in ("ddp", "fsdp") and job.strategy.verify > 0:
        return f"{kind}+verify"  # (FSDP+TP with verify is refused at submit)
    return "fsdp+tp" if kind == "fsdp" and job.strategy.tp is not None else kind


def strategy(spec, reporter, tuning: Tuning | None = None):
    """The rank's strategy: ``Diloco`` for a DILOCO job, ``Pipeline`` for PIPELINE,
    ``TensorParallel`` for TP and FSDP+TP, ``Mixed`` for a job over mixed devices,
    ``Checked`` for DDP with ``verify``, ``FsdpChecked`` for FSDP with it, ``Collective`` for DDP and FSDP; with the GPU client's ``tuning``."""
    module, name, takes_reporter = STRATEGIES[strategy_type(spec.job)]
    cls = getattr(import_module(f"{__package__}.{module}"), name)
    chosen = cls(spec, reporter) if takes_reporter else cls(spec)
    if tuning is not None:
        chosen.tuning = tuning
    return chosen
