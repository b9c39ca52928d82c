"""A job's spec, declared once as one tree: what the submitter asks for (``SubmitJob.spec``),
what the server stores (``Job.spec``), what a GPU client is handed (``JobAssign.spec``).

    JobSpec
      code        the bundle (or a script's working dir) and what it needs to load
      strategy    how the ranks train: one of DDP | FSDP | TP | Pipeline | Diloco | Mixed | Script
                  | Auto (resolved into one of the others as the job is placed),
                  told apart by ``type``; each holds only its own options (FSDP+TP is FSDP with
                  a ``tp`` dimension, as torchtitan's ParallelDims composes them)
      resources   how many ranks, where, with how much memory
      recovery    restarts and checkpoints
      training    epochs, timeouts, the seed
      datasets    what the GPU clients fetch first (refs at submit, pinned versions once stored)

A new option goes into one part here, where it is used, and in the docs. ``nest`` reads the flat
shape of earlier zwdx versions (a flat ``POST /jobs`` body, a stored record), so both still load.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union, cast

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, ValidationError,
                      ValidatorFunctionWrapHandler, computed_field, field_validator, model_validator)

from .. import defaults
from .base import ByValue, Bytes, Id
from .dataset import DatasetPin, DatasetRef
from .flat import fail, nest
from .diloco import DilocoSettings
from .pipeline import PipelineSettings
from .script import ScriptSpec
from .tensor_parallel import check_plan
from .vocab import JobKind, Parallelism, PipelineSchedule, TpStyle


#: A top-level module name a GPU client can import.
ModuleName = Annotated[str, StringConstraints(max_length=defaults.MAX_MODULE_NAME, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]


class Part(BaseModel):
    """A part of the spec: strict, unknown fields refused, frozen (a settings object)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


def _versions(value: dict[str, str]) -> dict[str, str]:
    import re
    python = value.get("python")
    if not isinstance(python, str) or not re.match(r"^[0-9]+\.[0-9]+", python) or len(python) > 32:
        raise ValueError("must name the submitter's python version (\"3.11\")")
    if len(value) > 64:
        raise ValueError("at most 64 versions")
    return value


#: The submitter's runtime: its Python minor version decides where the bundle can load.
Versions = Annotated[dict[Annotated[str, StringConstraints(max_length=64)],
                          Annotated[str, StringConstraints(max_length=64)]], AfterValidator(_versions)]


def _peft(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value.get("peft_type"), str) or not value["peft_type"]:
        raise ValueError("must be a peft config as JSON, with its peft_type (\"LORA\")")
    if len(json.dumps(value)) > defaults.MAX_LORA_CONFIG_BYTES:
        raise ValueError(f"must take at most {defaults.MAX_LORA_CONFIG_BYTES} bytes as JSON")
    return value


#: A LoRA job's adapter config, as peft writes ``adapter_config.json`` (the server reads only its
#: ``peft_type``; ``get_trained_model`` rebuilds the peft model from it).
Lora = Annotated[dict[str, Any] | None, AfterValidator(_peft)]


class Code(Part):
    """The job's code: the uploaded bundle (a script job's working dir) and what loading it needs."""
    #: The uploaded bundle (``POST /api/v1/artifacts``); a script job's: its working dir's.
    bundle_artifact: Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")]
    versions: Versions
    #: Top-level modules the bundle imports that every GPU client of the job must have.
    required_modules: Annotated[list[ModuleName], Field(max_length=defaults.MAX_REQUIRED_MODULES)] = []
    #: Set by the server from the stored artifact (a submitter's are replaced).
    bundle_sha256: str | None = None
    bundle_size: Bytes = 0

    @field_validator("required_modules", mode="wrap")
    @classmethod
    def _modules(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> list[str]:
        try:
            modules: list[str] = handler(value)
            return modules
        except ValidationError as exc:
            if exc.errors()[0]["type"] == "list_type":
                raise
            raise ValueError(f"must be a list of at most {defaults.MAX_REQUIRED_MODULES} top-level module names "
                             f"(Python identifiers)") from None


# -- strategies ---------------------------------------------------------------------------------
class DDP(Part):
    """DDP: every rank a replica of the model, gradients averaged each step."""
    type: Literal["ddp"] = "ddp"
    lora: Lora = None
    #: Step checks (``zwdx.verify``, ``gpu_client/rank/strategies/step_check.py``): shadow ranks,
    #: as many as this fraction of the ranks (ceil(verify * ranks); above 1, some get two). A
    #: shadow is one more GPU client slot that runs a rank again (its shard, its seeds) in step
    #: with the job; every step's gradients are exchanged whole (all-gathered, not all-reduced),
    #: so each shadow's are compared with its rank's before they are applied, and a
    #: disagreement stops the attempt, names the suspects and places the job again without
    #: them. Which ranks are shadowed the server draws and tells no rank. 0: off.
    verify: Annotated[float, Field(ge=0, le=4)] = 0.0
    #: The relative L2 distance under which a rank's and its shadow's gradients agree
    #: (identical bytes always do). 0: bitwise, which CPUs with the same torch and thread count
    #: give; GPUs need a tolerance, and a liar may hide that much.
    verify_tolerance: Annotated[float, Field(ge=0, le=1)] = 0.0

    @property
    def parallelism(self) -> Parallelism:
        return Parallelism.DDP


class TensorParallel(Part):
    """A TP dimension: the plan (module names, ``*`` one part, -> colwise/rowwise; None: derived
    from the model by the ranks) and the ranks of one group, all on one GPU client (None: the
    ranks the placement puts on each GPU client)."""
    plan: Annotated[dict[str, Annotated[TpStyle, ByValue]] | None, AfterValidator(
        lambda v: None if v is None else check_plan(v))] = None
    size: Annotated[int, Field(ge=1, le=1024)] | None = None


class FSDP(Part):
    """FSDP2 across the ranks; with ``tp``, FSDP+TP: TP within each GPU client's group, FSDP across."""
    type: Literal["fsdp"] = "fsdp"
    lora: Lora = None
    tp: TensorParallel | None = None
    #: Step checks by shadow ranks, as DDP's ``verify`` (``gpu_client/rank/strategies/fsdp_check.py``):
    #: each unit's gradients are all-gathered whole instead of reduce-scattered, and each
    #: shadow's (the whole model under FSDP in a world of one) compared with its rank's before
    #: they are applied. Not with ``tp``. 0: off.
    verify: Annotated[float, Field(ge=0, le=4)] = 0.0
    #: As DDP's ``verify_tolerance``.
    verify_tolerance: Annotated[float, Field(ge=0, le=1)] = 0.0

    @model_validator(mode="after")
    def _lora_without_tp(self) -> FSDP:
        if self.lora is not None and self.tp is not None:
            raise ValueError("lora: LoRA jobs run with DDP or FSDP, not FSDP+TP")
        return self

    @property
    def parallelism(self) -> Parallelism:
        return Parallelism.FSDP if self.tp is None else Parallelism.FSDP_TP


class TP(TensorParallel):
    """Tensor parallel: the job's ranks one group on one GPU client."""
    type: Literal["tp"] = "tp"

    @property
    def parallelism(self) -> Parallelism:
        return Parallelism.TP


class Pipeline(PipelineSettings):
    """PIPELINE: the model cut into stages over the ranks (``zwdx.protocol.pipeline``)."""
    model_config = ConfigDict(frozen=True)
    type: Literal["pipeline"] = "pipeline"

    @property
    def parallelism(self) -> Parallelism:
        return Parallelism.PIPELINE


class Diloco(DilocoSettings):
    """DILOCO: every GPU client a worker training alone, outer steps through the server."""
    type: Literal["diloco"] = "diloco"

    @property
    def parallelism(self) -> Parallelism:
        return Parallelism.DILOCO


class Mixed(Part):
    """DDP over GPU and CPU slots together (gloo), each rank's batch its share of ``global_batch``
    weighted by its measured speed; None: the world size times ``data_loader_func``'s default."""
    type: Literal["mixed"] = "mixed"
    global_batch: Annotated[int, Field(ge=1, le=100_000_000)] | None = None
    lora: Lora = None

    @property
    def parallelism(self) -> Parallelism:
        return Parallelism.DDP


class Script(ScriptSpec):
    """A script of the uploaded working dir, run under torchrun's environment (``zwdx run``)."""
    type: Literal["script"] = "script"

    @property
    def parallelism(self) -> Parallelism:
        return Parallelism.DDP


class Auto(Part):
    """AUTO: the server picks DDP, FSDP, FSDP+TP, PIPELINE or DILOCO as it places the job
    (``zwdx.server.auto``), from what one replica needs, each slot's free memory and the links;
    the job's record then holds the strategy chosen, and ``Job.auto`` what and why."""
    type: Literal["auto"] = "auto"
    #: Bytes of one replica's parameters (the SDK counts them from the model).
    parameter_bytes: Bytes = 0
    #: Bytes of one replica's parameters, gradients and optimizer state (the SDK counts them).
    state_bytes: Bytes = 0
    #: Bytes of one rank's activations at its batch, as measured or stated; None: the server's
    #: ``AUTO_ACTIVATION_FACTOR`` times ``parameter_bytes``.
    activation_bytes: Bytes | None = None
    #: The submitter's start weights, as DILOCO's (``DilocoSettings.start_weights``): should AUTO
    #: choose DILOCO, the server steps the global weights from them and returns its own; any
    #: other choice deletes them.
    start_weights: Id | None = Field(default=None, exclude_if=lambda v: v is None)

    @property
    def parallelism(self) -> Parallelism:
        return Parallelism.AUTO


Strategy = Annotated[Union[DDP, FSDP, TP, Pipeline, Diloco, Mixed, Script, Auto], Field(discriminator="type")]


# -- the other parts ----------------------------------------------------------------------------
class Resources(Part):
    """How many ranks, and what each needs of its GPU client."""
    #: None: every eligible idle slot of the room (a script job must say).
    world_size: Annotated[int, Field(ge=1, le=100_000)] | None = None
    #: Bytes of free memory every rank needs.
    memory_required: Bytes = 0
    #: Ranks on every GPU client of the job (torchrun's ``--nproc-per-node``), a divisor of
    #: ``world_size``; None: as the slots come. TP, FSDP+TP and DILOCO's workers set it.
    gpus_per_client: Annotated[int, Field(ge=1, le=1024)] | None = None
    #: The image its ranks run in (GPU clients that allow it only); None: any client's default.
    image: Annotated[str, StringConstraints(min_length=1, max_length=255,
                                            pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$")] | None = None


class Recovery(Part):
    """Restarts from checkpoints after a lost GPU client, and which checkpoints are kept."""
    #: A resumed job may go on with this many ranks; a new one waits for ``world_size``.
    min_world_size: Annotated[int, Field(ge=1, le=100_000)] | None = None
    max_restarts: Annotated[int, Field(ge=0, le=1000)] = defaults.MAX_RESTARTS
    keep_checkpoints: Annotated[int, Field(ge=1, le=1000)] = defaults.KEEP_CHECKPOINTS
    checkpoint_every_epoch: bool = True


class Training(Part):
    """What every rank's training is told."""
    #: None: the train function's own default (1 if it declares none).
    epochs: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    #: Seconds a collective waits for its peers; None: the server's ``COLLECTIVE_TIMEOUT``.
    collective_timeout: Annotated[float, Field(gt=0, le=7 * 24 * 3600)] | None = None
    #: Every rank seeds torch, random and numpy with it before building the model and the data
    #: loaders; None: nothing seeded.
    seed: Annotated[int, Field(ge=0, le=2**32 - 1)] | None = None


class SpecTree(BaseModel):
    """The parts every spec has; ``JobSpec`` (stored) and ``SubmitSpec`` (submitted) add datasets."""
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    code: Code
    strategy: Strategy = DDP()
    resources: Resources = Resources()
    recovery: Recovery = Recovery()
    training: Training = Training()

    @model_validator(mode="before")
    @classmethod
    def _flat(cls, data: Any) -> Any:
        return nest(data) if isinstance(data, dict) else data

    # Readers of the strategy by what it is (None where the job's strategy is another).
    @property
    def diloco(self) -> Diloco | None:
        return self.strategy if isinstance(self.strategy, Diloco) else None

    @property
    def pipeline(self) -> Pipeline | None:
        return self.strategy if isinstance(self.strategy, Pipeline) else None

    @property
    def script(self) -> Script | None:
        return self.strategy if isinstance(self.strategy, Script) else None

    @property
    def tp(self) -> TensorParallel | None:
        """TP's group, or FSDP+TP's TP dimension."""
        strategy = self.strategy
        return strategy if isinstance(strategy, TP) else strategy.tp if isinstance(strategy, FSDP) else None

    @property
    def lora(self) -> dict[str, Any] | None:
        return getattr(self.strategy, "lora", None)

    @property
    def mixed(self) -> Mixed | None:
        return self.strategy if isinstance(self.strategy, Mixed) else None


class SubmitSpec(SpecTree):
    """The spec as submitted: the rules that tie its parts together are checked here, once, and
    the values they decide resolved (the stored ``JobSpec`` is not checked again)."""
    #: A room dataset's name (its newest version, pinned at submit), a URL, or ``{"url", "sha256", "name"}``.
    datasets: Annotated[list[DatasetRef], Field(max_length=defaults.MAX_JOB_DATASETS)] = []

    @property
    def parallelism(self) -> Parallelism:
        return self.strategy.parallelism

    @property
    def kind(self) -> JobKind:
        return JobKind.SCRIPT if isinstance(self.strategy, Script) else JobKind.FUNCTION

    @model_validator(mode="after")
    def _fits(self) -> SubmitSpec:
        if isinstance(self.strategy, Pipeline):  # resolved for the ranks asked for, before it says how many
            self.strategy = _pipeline(self.strategy, self.resources.world_size)
        self.resources = _resolved(self.strategy, self.resources)
        _check_recovery(self.strategy, self.resources, self.recovery)
        return self


def _resolved(strategy: Any, resources: Resources) -> Resources:
    """``resources`` with what the strategy decides of them: the ranks of a TP group or a DILOCO
    worker on one GPU client, a TP job's or a staged pipeline's world size."""
    world, gpus = resources.world_size, resources.gpus_per_client
    if isinstance(strategy, Script) and world is None:
        fail(("resources", "world_size"), "a script job needs its number of ranks (zwdx run --nproc N)")
    if gpus is not None and (world is None or world % gpus):
        fail(("resources", "gpus_per_client"), f"must divide world_size ({world}): every GPU client runs this many "
                                               f"ranks", gpus)
    if isinstance(strategy, Pipeline) and world is None and strategy.stages is not None:
        world = strategy.stages // (strategy.stages_per_rank or 1)
    if isinstance(strategy, Diloco) and strategy.ranks_per_worker > 1:
        gpus = _worker(strategy.ranks_per_worker, world, gpus)
    if isinstance(strategy, Diloco) and strategy.verify and world is None:
        fail(("strategy", "diloco", "verify"), "needs resources.world_size: the shadows are a share of the workers",
             strategy.verify)
    if isinstance(strategy, FSDP) and strategy.verify and strategy.tp is not None:
        fail(("strategy", "fsdp", "verify"), "step checks run with FSDP alone, not FSDP+TP (leave tp out, or "
                                             "verify at 0)", strategy.verify)
    if isinstance(strategy, (DDP, FSDP)) and strategy.verify and world is None:
        fail(("strategy", strategy.type, "verify"), "needs resources.world_size: the shadows are a share of the ranks",
             strategy.verify)
    if isinstance(strategy, Mixed) and strategy.global_batch is not None and world is not None \
            and strategy.global_batch < world:
        fail(("strategy", "mixed", "global_batch"), f"must be at least world_size ({world}): every rank takes a "
                                                    f"sample at least", strategy.global_batch)
    if isinstance(strategy, TP):
        world, gpus = _tp_resolved(("strategy", "tp"), True, strategy, world, gpus)
    elif isinstance(strategy, FSDP) and strategy.tp is not None:
        world, gpus = _tp_resolved(("strategy", "fsdp", "tp"), False, strategy.tp, world, gpus)
    return resources.model_copy(update={"world_size": world, "gpus_per_client": gpus})


def _worker(per: int, world: int | None, gpus: int | None) -> int:
    """A DILOCO worker of several ranks is one GPU client's: they go on one GPU client together."""
    if world is None or world % per:
        fail(("strategy", "diloco"), f"ranks_per_worker ({per}) must divide world_size ({world}): every worker is "
                                     f"{per} ranks of one GPU client")
    if gpus is not None and gpus != per:
        fail(("strategy", "diloco"), f"ranks_per_worker ({per}) and gpus_per_client ({gpus}) differ: a DILOCO "
                                     f"worker is one GPU client's ranks (leave gpus_per_client out)")
    return per


def _tp_resolved(where: tuple[str, ...], one_group: bool, tp: TensorParallel, world: int | None,
                 gpus: int | None) -> tuple[int | None, int | None]:
    """A TP group is one GPU client's ranks: TP's job is one group, FSDP+TP's several."""
    size, at = tp.size, (*where, "size")
    if one_group and gpus is not None and gpus != world:
        fail(("resources", "gpus_per_client"), f"must equal world_size ({world}) with TP: its ranks are one GPU "
                                               f"client's", gpus)
    if size is not None and one_group and world is not None and size != world:
        fail(at, f"must equal world_size ({world}) with TP: the job is one TP group (FSDP+TP has several)", size)
    if size is not None and world is not None and world % size:
        fail(at, f"must divide world_size ({world}): each TP group is {size} ranks of one GPU client", size)
    if size is not None and gpus is not None and gpus != size:
        fail(at, f"and gpus_per_client ({gpus}) differ: a TP group is one GPU client's ranks (leave "
                 f"gpus_per_client out)", size)
    if one_group:
        world = world if world is not None else size
        return world, world
    return world, size if size is not None else gpus


def _check_recovery(strategy: Any, resources: Resources, recovery: Recovery) -> None:
    least, world, at = recovery.min_world_size, resources.world_size, ("recovery", "min_world_size")
    if least is None:
        return
    if world is not None and least > world:
        fail(at, f"must be at most world_size ({world})", least)
    if isinstance(strategy, Pipeline) and least != world:
        fail(at, f"must equal world_size ({world}) with PIPELINE: every stage needs its rank", least)
    if isinstance(strategy, TP) and least != world:
        fail(at, f"must equal world_size ({world}) with TP: the job is one TP group, on one GPU client", least)


def _pipeline(strategy: Pipeline, world: int | None) -> Pipeline:
    try:
        resolved = cast(Pipeline, strategy.resolved(world))
    except ValueError as exc:  # the plan and the ranks do not fit
        fail(("strategy", "pipeline"), str(exc))
    n = world or (resolved.stages // (resolved.stages_per_rank or 1) if resolved.stages else None)
    if resolved.schedule == PipelineSchedule.ONE_F_ONE_B and n and resolved.microbatches is not None \
            and resolved.microbatches < n:
        fail(("strategy", "pipeline"), f"microbatches must be at least the number of stages ({n}) with 1F1B")
    return resolved


class JobSpec(SpecTree):
    """The spec as the server stores it: every default resolved at submit, the datasets pinned.
    Read leniently: a field a newer server added is ignored; a record of the flat shape is nested."""
    model_config = ConfigDict(extra="ignore", strict=False, ser_json_inf_nan="strings")

    #: The datasets its GPU clients fetch, pinned at submit (``zwdx.protocol.dataset``).
    datasets: list[DatasetPin] = []

    @computed_field  # type: ignore[prop-decorator]
    @property
    def parallelism(self) -> Parallelism:
        """The mode, as the store's queries and the dashboard name it."""
        return self.strategy.parallelism

    @computed_field  # type: ignore[prop-decorator]
    @property
    def kind(self) -> JobKind:
        return JobKind.SCRIPT if isinstance(self.strategy, Script) else JobKind.FUNCTION


__all__ = ["Part", "Code", "DDP", "FSDP", "TensorParallel", "TP", "Pipeline", "Diloco", "Mixed", "Script", "Auto",
           "Strategy", "Resources", "Recovery", "Training", "SpecTree", "SubmitSpec", "JobSpec", "nest",
           "Versions", "Lora", "ModuleName"]
