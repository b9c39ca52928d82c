"""The settings a job is submitted with, as small frozen objects (Ray Train's ScalingConfig,
RunConfig and FailureConfig are the model)::

    zwdx.submit_job(model, loaders, train,
                    strategy=zwdx.FSDP(units=[Block]),     # or DDP(), TP(), Pipeline(), Diloco(), Mixed(), Auto()
                    resources=zwdx.Resources(world_size=4, memory_required=8 * 2**30),
                    training=zwdx.Training(epochs=3, seed=0),
                    run=zwdx.Run(name="gpt", trackers=["tensorboard"],
                                 recovery=zwdx.Recovery(max_restarts=3, min_world_size=2)))

The strategies, ``Resources``, ``Recovery`` and ``Training`` are the parts of the job's spec
(``zwdx.protocol.spec``) as the server takes them: an option added there is an option here.
``FSDP`` adds ``units`` (which modules to shard, kept in the bundle) and ``DDP``/``FSDP``/``Mixed``
take a ``peft.LoraConfig`` as ``lora``. ``Run`` is how this call submits and follows the job.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import ConfigDict, Field

from ..protocol import spec as _spec


class Resources(_spec.Resources):
    """How many ranks, and what each needs: ``world_size`` (None: every eligible idle slot),
    ``memory_required`` (bytes free on every slot), ``gpus_per_client``, ``image``."""


class Recovery(_spec.Recovery):
    """After a lost GPU client: ``min_world_size``, ``max_restarts``; and ``keep_checkpoints``,
    ``checkpoint_every_epoch``."""


class Training(_spec.Training):
    """``epochs`` (None: ``train_func``'s default), ``collective_timeout`` (seconds), ``seed``
    (torch, random and numpy on every rank; None: not seeded)."""


class TensorParallel(_spec.TensorParallel):
    """A TP dimension of FSDP: ``plan`` (None: derived from the model) and ``size`` (the ranks of a group)."""


class TP(_spec.TP):
    """Tensor parallel: the job's ranks one group on one GPU client (``plan``, ``size``)."""


class Pipeline(_spec.Pipeline):
    """PIPELINE: ``schedule``, ``microbatches``, ``stage_plan``, ``stages_per_rank``."""


class Diloco(_spec.Diloco):
    """DILOCO: ``inner_steps``, ``outer_lr``, ``compression``, ``verify`` (spot checks by shadow workers), ...
    (``zwdx.protocol.diloco``)."""


class DDP(_spec.DDP):
    model_config = ConfigDict(arbitrary_types_allowed=True)
    #: A ``peft.LoraConfig`` (or its JSON): a copy of the model gets the adapter, only it trains.
    lora: Any = Field(default=None, exclude=True)


class FSDP(_spec.FSDP):
    model_config = ConfigDict(arbitrary_types_allowed=True)
    lora: Any = Field(default=None, exclude=True)
    #: The modules to shard as units: classes, or a function ``module -> bool``; None: each block
    #: of a repeated ModuleList/Sequential.
    units: Any = Field(default=None, exclude=True)


class Mixed(_spec.Mixed):
    model_config = ConfigDict(arbitrary_types_allowed=True)
    lora: Any = Field(default=None, exclude=True)


class Auto(_spec.Auto):
    """AUTO: the server picks DDP, FSDP, FSDP+TP, PIPELINE or DILOCO as it places the job
    (docs/modes/auto.md). ``submit_job`` counts ``parameter_bytes`` and ``state_bytes`` from the
    model and the optimizer; ``activation_bytes``: one rank's activations at its batch, if you
    measured them (None: the server's ``AUTO_ACTIVATION_FACTOR`` times the parameters' bytes)."""


@dataclasses.dataclass(frozen=True)
class Run:
    """How ``submit_job`` submits the job and follows it."""
    #: The job's name; "": ``train_func``'s.
    name: str = ""
    #: A submitter token of the room (``zs_...``); None: the client's, or the one on record.
    room_token: str | None = None
    #: Room datasets by name, URLs, or ``{"url", "sha256", "name"}`` (``zwdx.datasets``).
    datasets: tuple = ()
    #: Where its metrics also go: "tensorboard", "wandb" or ``zwdx.trackers.Tracker`` objects.
    trackers: Any = None
    #: Restarts from checkpoints after a lost GPU client, and which checkpoints are kept.
    recovery: Recovery | None = None
    progress: bool = True
    #: Seconds to wait for the end (None: as long as it takes).
    timeout: float | None = None
    raise_on_failure: bool = True
    #: Ctrl-C cancels the job (False: leaves it running, and says how to re-attach).
    cancel_on_interrupt: bool = True
    #: A job the room as it is could never run is refused instead of waiting.
    fail_if_unschedulable: bool = False


__all__ = ["DDP", "FSDP", "TP", "TensorParallel", "Pipeline", "Diloco", "Mixed", "Auto", "Resources", "Recovery",
           "Training", "Run"]
