"""Parallelism applied after the user's single-device model is built (torchtitan's habit):
``wrap`` for DDP or FSDP, ``rebuild_optimizer`` over the wrapped parameters, ``sync_buffers``
after training, and ``full_state_dict`` to bring the trained weights back as one plain state dict.

FSDP shards the model in units, each with its own ``fully_shard`` (one all-gather before its
forward, freed after): ``fsdp_plan`` picks them. By default, as torchtitan does per transformer
block: every module of a ModuleList or Sequential whose modules (two or more) are all of one
class, wherever that list sits (the outermost such lists; a unit is not searched further), and
the root last, holding whatever no unit holds. The submitter may name the units instead
(``fsdp_units``: classes, or a predicate ``fn(module) -> bool``). Either way a module is never a
unit of its own when it has no ``forward`` (ModuleDict, ModuleList), no parameters, or shares a
parameter with a module outside it (tied embeddings): its parameters stay in the enclosing unit.
"""
from __future__ import annotations

import hashlib
import logging

import torch
import torch.distributed as dist
from torch import nn

from zwdx.model_rules import has_forward as _has_forward
from zwdx.model_rules import repeated_blocks as _repeated_blocks

from gpu_client.rank.failures import watch_gradients
from gpu_client.rank.tuning import Tuning

log = logging.getLogger(__name__)

#: Below this many parameters every rank gathers the full weights to fingerprint them.
FINGERPRINT_MAX_NUMEL = 200_000_000


class Collective:
    """The strategy of DDP and FSDP: every rank of the job in one process group (rank 0's port),
    the model wrapped as the job says. ``diloco.Diloco``, ``pipeline.Pipeline`` and ``mixed.Mixed``
    are the others (subclasses); the runner asks the strategy ``registry.strategy(spec, reporter)`` picks
    where they differ: how to meet (``rendezvous``), what the loader and train_func are told, how
    the model is wrapped, which model ``eval_func`` sees, and how the whole weights come back."""

    def __init__(self, spec):
        self.spec = spec
        #: How ``wrap``, the checkpoints and ``full_state_dict`` treat the model.
        self.wrap_as = spec.parallelism.value

    #: Whether this rank's model is a part of the submitted one (a pipeline's stage).
    part = False
    #: The GPU client's switches (``registry.strategy`` sets them).
    tuning = Tuning()

    def rendezvous(self) -> dict:
        """``init_process_group``'s arguments: where and as which rank to meet the others."""
        spec = self.spec
        return {"init_method": f"tcp://{spec.master_addr}:{spec.master_port}", "rank": spec.rank,
                "world_size": spec.world_size}

    def attach(self, model: nn.Module, checkpointer) -> None:
        """Once the model, its optimizer and the checkpoint are ready: nothing more."""

    def trained(self) -> None:
        """After ``train_func``: nothing more."""

    def uploads_weights(self) -> bool:
        """Whether this rank uploads the job's weights: rank 0."""
        return self.spec.rank == 0

    def global_fingerprint(self, model: nn.Module, state: dict | None) -> str | None:
        """DILOCO's fingerprint of the global weights alone; None in the other modes."""
        return None

    def loader_arguments(self) -> dict:
        """What ``data_loader_func`` is told of the ranks: this one's place among the replicas."""
        return {"rank": self.spec.rank, "world_size": self.spec.world_size}

    def train_loader(self, loader):
        """The training loader as ``train_func`` sees it: the user's (a pipeline's stages follow its first's)."""
        return loader

    def loaders(self, make, bundle: dict, device: torch.device) -> tuple:
        """The job's (train, eval) loaders: ``make(arguments)`` calls ``data_loader_func`` with
        ``loader_arguments`` (a mixed-devices rank measures its speed first, ``mixed.py``)."""
        return make(self.loader_arguments())

    def replicas(self) -> float:
        """Rank 0's samples times this make the job's (for ``throughput``): the replicas."""
        return self.loader_arguments()["world_size"]

    def train_arguments(self) -> dict:
        """Arguments of the strategy's own that ``train_func`` may declare (``pipeline``)."""
        return {"pipeline": None}

    def wrap(self, model: nn.Module, device: torch.device, bundle: dict, report, example=None) -> nn.Module:
        """The user's model on ``device``, wrapped as the job says (``example``: a first batch,
        which only a pipeline needs)."""
        # Every rank unpickled the same bundle, its sha256 checked: the weights are equal already,
        # and DDP's check and broadcast of them at init (collectives over the whole model) would
        # only cost the start time (tuning.ddp_init_sync keeps them). FSDP2 assumes as much.
        return wrap(model.to(device), self.wrap_as, device, units=bundle.get("fsdp_units"), report=report,
                    init_sync=self.tuning.ddp_init_sync)

    def layout(self, model: nn.Module) -> dict:
        """What this rank holds of the wrapped ``model``, for the job's page (``zwdx.protocol.layout``):
        DDP the whole model (a replica); FSDP a 1/world share of each unit's weights."""
        from zwdx.protocol.layout import MAX_MODULES

        from .layout import device_of, fold, held_modules, line, local_params
        from torch.nn.parallel import DistributedDataParallel
        inner = model.module if isinstance(model, DistributedDataParallel) else model
        world, params = dist.get_world_size(), local_params(inner)
        out = {"params": params, "device": device_of(inner)}
        if self.wrap_as == "FSDP":
            from torch.distributed.fsdp import FSDPModule
            units = [name for name, m in inner.named_modules() if name and isinstance(m, FSDPModule)]
            shown = fold(units, MAX_MODULES - 1)
            return {**out, "role": "shard", "modules": [*shown, "(root)"],
                    "text": line(f"1/{world} of each of {len(units) + 1} FSDP units' weights "
                                 f"({', '.join(shown[:4])}{', ...' if len(shown) > 4 else ''}, then the root)")}
        return {**out, "role": "replica", "modules": held_modules(inner),
                "text": line(f"the whole model (replica {dist.get_rank()} of {world})")}

    def sync_buffers(self, model: nn.Module) -> None:
        sync_buffers(model)

    def evaluated(self, model: nn.Module, device: torch.device) -> tuple[nn.Module, torch.device] | None:
        """The model ``eval_func`` gets on this rank, and its device (None: not called here)."""
        return model, device

    def failed_check(self):
        """The step check that stopped this rank (``step_check.Checked``); None in the other modes."""
        return None

    def full_state(self, model: nn.Module) -> dict | None:
        """The whole model's weights on CPU (``full_state_dict``)."""
        return full_state_dict(model, self.wrap_as, self.spec.rank)

    def report_end(self, report) -> None:
        """Report the rank's end (``report()``); the step checks order it with their shadows'."""
        report()


def wrap(model: nn.Module, parallelism: str, device: torch.device, units=None, report=None,
         init_sync: bool = True, hook=None) -> nn.Module:
    """DDP or FSDP2 around ``model``, which is on ``device`` already. ``units``: the submitter's
    ``fsdp_units`` (None: the automatic rule). ``report(line)``: rank 0 says what was sharded.
    ``init_sync`` (DDP): check the ranks' parameter shapes and broadcast rank 0's weights first.
    ``hook(ddp)`` (DDP): registers its own comm hook (``step_check.py``) instead of zwdx's all-reduce."""
    if parallelism == "DDP":
        from torch.nn.parallel import DistributedDataParallel
        ids = [device.index] if device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=ids, init_sync=init_sync)
        if hook is not None:
            hook(model)
        elif device.type == "cpu":  # so that a lost peer in backward() is told from the user's own error
            watch_gradients(model)
        return model
    if parallelism == "FSDP":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        chosen, skipped = fsdp_plan(model, units)
        line = describe_plan(model, chosen, skipped)  # before fully_shard renames the classes
        for _, module in sorted(chosen, key=lambda unit: -_depth(unit[0])):  # inner units before outer
            fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if dist.get_rank() == 0:
            log.info("%s", line)
            if report is not None:
                report(line)
        return model
    raise ValueError(f"unknown parallelism {parallelism!r}: use DDP or FSDP")


def _depth(name: str) -> int:
    return name.count(".") + 1


def _selector(units):
    """``fsdp_units`` as a predicate over modules: classes, one class, or a callable."""
    if isinstance(units, type):
        units = (units,)
    if isinstance(units, (list, tuple)):
        classes = tuple(units)
        return lambda module: isinstance(module, classes)
    return units


def fsdp_plan(model: nn.Module, units=None) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, str]]]:
    """Which modules get their own ``fully_shard`` before the root's, in the model's order, and
    which were picked but left to the enclosing unit, with why: ``([(name, module)], [(name, why)])``."""
    if units is None:
        picked = _repeated_blocks(model)
    else:
        select = _selector(units)
        picked = [(name, m) for name, m in model.named_modules() if name and select(m)]
    names: dict[int, list[str]] = {}  # every name of each parameter, a tied one has several
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    chosen, skipped = [], []
    for name, module in picked:
        params = list(module.parameters())
        if not _has_forward(module):
            skipped.append((name, f"{type(module).__name__} has no forward"))
        elif not params:
            continue
        else:
            outside = next((other for p in params for other in names[id(p)]
                            if not other.startswith(name + ".")), None)
            if outside is not None:
                skipped.append((name, f"shares a parameter with {outside}"))
            else:
                chosen.append((name, module))
    return chosen, skipped


def describe_plan(model: nn.Module, chosen: list, skipped: list) -> str:
    """One line for the job's log: the units, grouped by class, then the root."""
    groups: dict[str, list[str]] = {}
    for name, module in chosen:
        groups.setdefault(type(module).__name__, []).append(name)
    parts = [f"{len(names)} x {cls} ({names[0]}{', ' + names[1] if len(names) == 2 else ''}"
             f"{' ... ' + names[-1] if len(names) > 2 else ''})" for cls, names in groups.items()]
    line = f"FSDP units: {', '.join(parts) or 'none'}, then the root {type(model).__name__}"
    if skipped:
        line += "; left to the enclosing unit: " + ", ".join(f"{name} ({why})" for name, why in skipped)
    return line


def sync_buffers(model: nn.Module) -> None:
    """Every rank takes rank 0's buffers (BatchNorm's running statistics), as DDP's
    ``broadcast_buffers`` does: the ranks evaluate, and return, the same model. FSDP keeps buffers
    unsharded and per rank; DDP updates them locally in each forward after its broadcast."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    persistent = set(model.state_dict())  # only what the returned weights carry
    for name, buf in model.named_buffers():
        if name in persistent:
            data = buf if buf.is_contiguous() else buf.contiguous()
            dist.broadcast(data, src=0)
            if data is not buf:
                buf.copy_(data)


def _plain_names(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    named = {}
    for name, param in model.named_parameters():
        named[name[len("module."):] if name.startswith("module.") else name] = param
    return named


def rebuild_optimizer(spec: dict | None, model: torch.nn.Module, part: bool = False):
    """The submitter's optimizer class and settings, over this rank's (wrapped) parameters.
    ``part``: the model is a part of the submitted one (a pipeline stage), each param group
    keeps the parameters the part has."""
    if spec is None:
        return None
    import inspect
    cls, groups = spec["cls"], spec["groups"]
    named = _plain_names(model)
    named_groups = all(g["params"] is not None for g in groups)
    if part and named_groups:
        groups = [{**g, "params": [n for n in g["params"] if n in named]} for g in groups]
        groups = [g for g in groups if g["params"]] or groups[:1]
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    defaults = {k: v for k, v in groups[0]["hyper"].items() if k in accepted}
    if named_groups:
        by_name = _groups_by_name(groups, named)
        if by_name is not None:
            return cls(by_name, **defaults)
    if len(groups) > 1:
        log.warning("optimizer: %d param groups over parameters of another model instance; "
                    "rebuilding one group with the first group's settings", len(groups))
    trainable = [p for p in named.values() if p.requires_grad]  # a LoRA model's: the adapter's
    return cls(trainable or list(named.values()), **defaults)


def _groups_by_name(groups: list[dict], named: dict) -> list[dict] | None:
    """The param groups over the model's parameters by name; None (said) if it lacks some."""
    missing = [n for g in groups for n in g["params"] if n not in named]
    if missing:
        log.warning("optimizer: %d parameter name(s) not in the model; using one group", len(missing))
        return None
    return [{"params": [named[n] for n in g["params"]], **g["hyper"]} for g in groups]


def full_state_dict(model: torch.nn.Module, parallelism: str, rank: int) -> dict | None:
    """The whole model's weights on CPU. Every rank gets them when the model is small enough to
    fingerprint; otherwise only rank 0 (others get None). Collective for FSDP."""
    if parallelism == "DDP":
        return {k: v.detach().cpu() for k, v in model.module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    small = sum(p.numel() for p in model.parameters()) * dist.get_world_size() < FINGERPRINT_MAX_NUMEL
    if small:
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
        return {k: v.detach().cpu() for k, v in sd.items()}
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if rank == 0 else None


def fingerprint(state: dict | None) -> str | None:
    """sha256 over the weights in name order: equal on every rank after a correct run."""
    if state is None:
        return None
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name]
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                      if tensor.numel() else b"")
    return digest.hexdigest()
