"""FSDP with ``verify``: ``step_check.py``'s step checks (its docstring is the design) carried by
FSDP2's reduce-scatter, one check per FSDP unit's gradients instead of per DDP bucket.

- Every party wraps the model as plain FSDP does (``parallel.wrap``); a shadow's world is one, so
  its FSDP holds the whole model and its user code's collectives are no-ops.
- Each unit's gradients reach the check in a *canonical* form: every parameter's whole local
  gradient, unpadded, concatenated in the unit's parameter order. A worker of W ranks un-chunks
  its reduce-scatter input (rank-major: per rank, each parameter's dim-0 chunk padded to its
  padded sharded size, torch's ``foreach_reduce_scatter_copy_in``); a party whose world is one
  (a shadow, or a one-rank job's worker) gets that form from FSDP as it is.
- ``StepChecker.checked_sum`` checks it (all-gather over the check group, verdicts, ``decide``)
  and gives the workers' sum in rank order, which goes back in the layout FSDP expects: a
  worker's own padded shard, divided as FSDP's op asked (AVG: by W, as gloo's reduce-scatter does);
  the whole for a world of one, divided by W.

Weights too (``fsdp_weights.py``): before every training forward, every shadow checks every
worker's stored weight shards, which reach every rank through FSDP's all-gather.

Why two hooks: FSDP2 (torch 2.13, ``_fsdp_collectives.foreach_reduce``) calls the custom
reduce-scatter only when the group has more than one rank; with one it copies the input to the
output and then calls the all-reduce hook (``set_all_reduce_hook``), which a world of one uses.
Unused parameters reduce zeros (``set_reduce_scatter_unused_params``): every step's layout is the
unit's trainable parameters, whichever the step used.
"""
from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from gpu_client.rank.failures import collectives

from . import fsdp_weights
from .parallel import wrap
from .step_check import Checked, StepChecker, StepCheckFailed

log = logging.getLogger(__name__)


class Steps:
    """One party's FSDP units, counted into steps for its ``StepChecker``: the units reduced
    since the root's last forward are the buckets of one step (``no_sync`` steps reduce none)."""

    def __init__(self, checker: StepChecker):
        self.checker = checker
        #: Units checked in the current step (the next one's bucket index).
        self.bucket = 0

    def forward(self, *_) -> None:
        """The root's forward pre-hook: a step that checked units is over."""
        if self.bucket:
            self.checker.step, self.bucket = self.checker.step + 1, 0

    @property
    def steps(self) -> int:
        """Steps whose gradients were checked (the current one too, once a unit was)."""
        return self.checker.step + (1 if self.bucket else 0)

    def check(self, canonical: torch.Tensor) -> torch.Tensor:
        """The workers' checked sum of one unit's canonical gradients (``StepChecker.checked_sum``)."""
        index, self.bucket = self.bucket, self.bucket + 1
        try:
            return self.checker.checked_sum(index, canonical.detach().cpu())
        except StepCheckFailed:
            raise
        except Exception as exc:  # a lost party: as a lost peer of FSDP's own reduce-scatter
            collectives.record(exc)
            raise


def _numels(sizes: list[torch.Size], world: int) -> tuple[list[int], list[int]]:
    """Each parameter's numel, and its padded shard's (dim 0 padded to a multiple of ``world``)."""
    whole = [math.prod(s) for s in sizes]
    shard = [math.ceil(s[0] / world) * math.prod(s[1:]) if len(s) else 1 for s in sizes]
    return whole, shard


def canonical(flat: torch.Tensor, sizes: list[torch.Size], world: int) -> torch.Tensor:
    """A reduce-scatter input of ``world`` ranks (rank-major padded chunks) as the whole gradients,
    unpadded, concatenated."""
    whole, shard = _numels(sizes, world)
    rows = flat.view(world, -1).split(shard, dim=1)  # per parameter: (world, its padded shard)
    return torch.cat([part.reshape(-1)[:n] for part, n in zip(rows, whole)])


def shard_of(total: torch.Tensor, sizes: list[torch.Size], world: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``total`` (canonical) in the reduce-scatter output's layout: each
    parameter's dim-0 chunk, zero-padded to its padded shard."""
    whole, shard = _numels(sizes, world)
    parts, at = [], 0
    for n, s in zip(whole, shard):
        padded = total.new_zeros(world * s)
        padded[:n] = total[at:at + n]
        parts.append(padded.view(world, s)[rank])
        at += n
    return torch.cat(parts)


class CheckedReduceScatter(ReduceScatter):
    """A worker's reduce-scatter for one FSDP unit (``FSDPModule.set_custom_reduce_scatter``):
    the step check instead of the collective."""

    def __init__(self, steps: Steps, sizes: list[torch.Size], workers: int):
        self.steps, self.sizes, self.workers = steps, sizes, workers

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False) -> None:
        world, rank = group.size(), group.rank()
        expected = world * sum(_numels(self.sizes, world)[1])
        if input_tensor.numel() != expected or world != self.workers:
            raise RuntimeError(f"FSDP step check: a reduce-scatter of {input_tensor.numel()} elements over "
                               f"{world} ranks, where the unit's parameters make {expected} over {self.workers}")
        if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):  # a shadow divides as AVG does (``_Whole``)
            raise ValueError(f"FSDP step check: reduce-scatter op {op} (a gradient_divide_factor, or a reduce "
                             f"dtype other than float32/bfloat16): step checks take FSDP's default average")
        total = self.steps.check(canonical(input_tensor, self.sizes, world))
        mine = shard_of(total, self.sizes, world, rank)
        if op == dist.ReduceOp.AVG:
            mine.div_(world)
        output_tensor.copy_(mine)
        return None


class _Whole:
    """A world of one's all-reduce hook for one FSDP unit (``FSDPModule.set_all_reduce_hook``):
    FSDP hands it the whole gradients, canonical already; it leaves the workers' mean there."""

    def __init__(self, steps: Steps, sizes: list[torch.Size], workers: int):
        self.steps, self.numel, self.workers = steps, sum(math.prod(s) for s in sizes), workers

    def __call__(self, output: torch.Tensor) -> None:
        if output.numel() != self.numel or output.dtype not in (torch.float32, torch.bfloat16):
            raise RuntimeError(f"FSDP step check: {output.numel()} gradient elements of {output.dtype}, where "
                               f"the unit's parameters make {self.numel} (float32 or bfloat16)")
        output.copy_(self.steps.check(output.view(-1)).div_(self.workers))


def units(model: nn.Module) -> list[tuple[FSDPModule, list[torch.Size]]]:
    """Every FSDP unit with parameters, and the sizes of its trainable ones in its reduce order."""
    found = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group  # FSDP2 keeps the layout only there
        if group is None:
            continue
        sizes = [p._orig_size for p in group.fsdp_params if p.sharded_param.requires_grad]
        if sizes:
            found.append((module, sizes))
    return found


class FsdpChecked(Checked):
    """An FSDP job with ``verify``: a worker, or a shadow (``spec.shadow``) of ``spec.rank``."""

    def wrap(self, model: nn.Module, device: torch.device, bundle: dict, report, example=None) -> nn.Module:
        self.steps = Steps(self._start(report))
        # A shadow's FSDP is rank 0 of its own world: it would say the job's units in the job's log.
        model = wrap(model.to(device), "FSDP", device, units=bundle.get("fsdp_units"),
                     report=report if self.shadow is None else None)
        attach(model, self.steps, self.spec.world_size)
        return model


def attach(model: nn.Module, steps: Steps, workers: int, weights: bool = True) -> None:
    """The step checks on every FSDP unit of ``model`` (wrapped): the checked reduce-scatter in a
    world of ``workers`` ranks, the all-reduce hook in a world of one; and the weights check
    (``weights``: off only to measure what it costs, ``bench/fsdp_check.py``)."""
    assert isinstance(model, FSDPModule)
    model.set_reduce_scatter_unused_params(True)
    model.register_forward_pre_hook(steps.forward)
    if weights:
        fsdp_weights.attach(model, steps.checker, steps.forward, workers)
    alone = dist.get_world_size() == 1
    for module, sizes in units(model):
        if alone:
            module.set_all_reduce_hook(_Whole(steps, sizes, workers))
        else:
            module.set_custom_reduce_scatter(CheckedReduceScatter(steps, sizes, workers))
