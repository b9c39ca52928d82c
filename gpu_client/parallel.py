"""Parallelism applied after the user's single-device model is built (torchtitan's habit):
``wrap`` for DDP or FSDP, ``rebuild_optimizer`` over the wrapped parameters, and
``full_state_dict`` to bring the trained weights back as one plain state dict."""
from __future__ import annotations

import hashlib
import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

#: Below this many parameters every rank gathers the full weights to fingerprint them.
FINGERPRINT_MAX_NUMEL = 200_000_000


def wrap(model: torch.nn.Module, parallelism: str, device: torch.device) -> torch.nn.Module:
    """DDP or FSDP2 around ``model``, which is on ``device`` already."""
    if parallelism == "DDP":
        from torch.nn.parallel import DistributedDataParallel
        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    if parallelism == "FSDP":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for child in model.children():
            if any(p.requires_grad for p in child.parameters()):
                fully_shard(child, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    raise ValueError(f"unknown parallelism {parallelism!r}: use DDP or FSDP")


def _plain_names(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    named = {}
    for name, param in model.named_parameters():
        named[name[len("module."):] if name.startswith("module.") else name] = param
    return named


def rebuild_optimizer(spec: dict | None, model: torch.nn.Module):
    """The submitter's optimizer class and settings, over this rank's (wrapped) parameters."""
    if spec is None:
        return None
    import inspect
    cls, groups = spec["cls"], spec["groups"]
    named = _plain_names(model)
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    defaults = {k: v for k, v in groups[0]["hyper"].items() if k in accepted}
    if all(g["params"] is not None for g in groups):
        missing = [n for g in groups for n in g["params"] if n not in named]
        if not missing:
            return cls([{"params": [named[n] for n in g["params"]], **g["hyper"]} for g in groups], **defaults)
        log.warning("optimizer: %d parameter name(s) not in the model; using one group", len(missing))
    if len(groups) > 1:
        log.warning("optimizer: %d param groups over parameters of another model instance; "
                    "rebuilding one group with the first group's settings", len(groups))
    return cls(list(named.values()), **defaults)


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
