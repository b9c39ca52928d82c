"""What ``submit_job``'s arguments ask for: the settings objects (``zwdx.sdk.settings``), or the
earlier keywords, which still work through ``earlier`` (each warns once, saying what replaces
it). Either way the job is one spec tree (``zwdx.protocol.spec``) by the time it is sent."""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from ..errors import BadRequest
from ..protocol.flat import nest
from .settings import Run

_RUN = "run=zwdx.Run({}=...)"
_RECOVERY = "run=zwdx.Run(recovery=zwdx.Recovery({}=...))"
#: ``submit_job``'s earlier keywords -> what replaces each.
EARLIER = {
    **{name: _RUN.format(name) for name in ("room_token", "name", "progress", "raise_on_failure", "timeout",
                                            "cancel_on_interrupt", "fail_if_unschedulable", "trackers", "datasets")},
    **{name: _RECOVERY.format(name) for name in ("min_world_size", "max_restarts", "keep_checkpoints",
                                                 "checkpoint_every_epoch")},
    "epochs": "training=zwdx.Training(epochs=...)",
    "collective_timeout": "training=zwdx.Training(collective_timeout=...)",
    "world_size": "resources=zwdx.Resources(world_size=...)",
    "image": "resources=zwdx.Resources(image=...)",
    "fsdp_units": "strategy=zwdx.FSDP(units=...)",
    "diloco": "strategy=zwdx.Diloco(...)",
    "pipeline": "strategy=zwdx.Pipeline(...)",
    "lora": "strategy=zwdx.DDP(lora=...) or zwdx.FSDP(lora=...)",
    "devices": "strategy=zwdx.Mixed(...)",
    "global_batch": "strategy=zwdx.Mixed(global_batch=...)",
    "tp_plan": "strategy=zwdx.TP(plan=...) or zwdx.FSDP(tp=zwdx.TensorParallel(plan=...))",
    "tp_size": "strategy=zwdx.TP(size=...) or zwdx.FSDP(tp=zwdx.TensorParallel(size=...))",
}
#: The earlier keywords that were the mode's options.
_MODE_OPTIONS = ("diloco", "pipeline", "devices", "global_batch", "tp_plan", "tp_size")
_warned: set[str] = set()


def earlier(options: dict) -> dict:
    """``options`` (earlier keywords), each warned of once in this process; a keyword
    ``submit_job`` never took is a TypeError, as Python's own."""
    unknown = sorted(set(options) - set(EARLIER))
    if unknown:
        raise TypeError(f"submit_job() got an unexpected keyword argument {unknown[0]!r}")
    for name in options:
        if name not in _warned:
            _warned.add(name)
            warnings.warn(f"submit_job({name}=...) is the earlier form; it still works: use {EARLIER[name]}",
                          FutureWarning, stacklevel=5)
    return options


@dataclasses.dataclass
class Submission:
    """One call's job: the body the server checks before anything is uploaded (flat for a call
    of earlier keywords only, so its errors name them; the tree otherwise), how to follow it
    (``run``), and what stays on this side (the LoRA config, FSDP's units)."""
    body: dict
    run: Run
    lora: Any = None
    units: Any = None

    @classmethod
    def of(cls, parallelism: str, memory_required: int, strategy, resources, training, run: Run | None,
           options: dict) -> Submission:
        options = dict(earlier(options))
        run = dataclasses.replace(run or Run(), **{k: options.pop(k) for k in list(options)
                                                  if k in {f.name for f in dataclasses.fields(Run)}})
        lora, units = options.pop("lora", None), options.pop("fsdp_units", None)
        flat = {**options, "parallelism": str(parallelism).upper(), "memory_required": memory_required}
        own = {"name": run.name, "fail_if_unschedulable": run.fail_if_unschedulable}
        if strategy is None and resources is None and training is None and run.recovery is None:
            return cls({**flat, **own}, run, lora, units)
        tree = {k: v for k, v in nest(flat).items() if k != "code"}
        if strategy is not None:
            tree["strategy"], lora, units = _strategy(strategy, flat, lora, units)
        for name, part in (("resources", resources), ("training", training), ("recovery", run.recovery)):
            if part is not None:
                tree[name] = {**tree.get(name, {}), **part.model_dump(mode="json", exclude_unset=True)}
        return cls({"spec": tree, **own}, run, lora, units)

    def checked_body(self, versions: dict, datasets: list | None = None, code: dict | None = None) -> dict:
        """The body with the job's code (a placeholder before the upload) and datasets."""
        code = {"bundle_artifact": "unsent", "versions": versions, **(code or {})}
        datasets = list(self.run.datasets) if datasets is None else datasets
        if "spec" not in self.body:
            return {**self.body, **code, "datasets": datasets}
        return {**self.body, "spec": {**self.body["spec"], "code": code, "datasets": datasets}}


def _strategy(strategy, flat: dict, lora, units) -> tuple[dict, Any, Any]:
    given = [k for k in _MODE_OPTIONS if flat.get(k) is not None and (k != "devices" or flat[k] != "same")]
    if given:
        raise BadRequest(f"{given[0]} and strategy= both say how the job trains: give {EARLIER[given[0]]} alone",
                         field=given[0])
    if flat["parallelism"] not in ("DDP", strategy.parallelism.value):
        raise BadRequest(f"parallelism {flat['parallelism']!r} and strategy {type(strategy).__name__} differ: "
                         f"leave parallelism out", field="parallelism")
    return (strategy.model_dump(mode="json"), getattr(strategy, "lora", None) if lora is None else lora,
            getattr(strategy, "units", None) if units is None else units)
