"""FSDP with ``verify``: every worker's stored weight shards checked by every shadow before each
training forward (``fsdp_check.py`` checks the gradients; issue 33).

Why: a rank's weight shard reaches every rank's forward and backward through FSDP's all-gather. A
rank that alters its stored shard makes every rank's gradients wrong: every shadowed rank would
then disagree with its shadows and honest ranks would be named. A shadow runs FSDP in a world of
one, so it holds the whole model: it can tell what *every* worker's shard should be, not only its
own worker's. So every shadow checks every worker, and a liar nobody shadows is caught as well.

Over the check group of ``StepChecker`` (W workers, then S shadows), per training forward:
(1) all-gather each party's vector: a worker's own shards (each FSDP parameter's, zero-padded to
FSDP's padded shard, in the units' order); a shadow's zeros (it hides whom it shadows, as for the
gradients). (2) Each shadow compares every worker's vector with the one it cuts from its whole
weights (``zwdx.verify.agree``: identical bytes, or within ``verify_tolerance``); one flag per
worker and party is all-gathered. (3) None set: the step goes on. (4) Else every shadow's
expected vectors are all-gathered (the attempt ends: nothing left to hide), and every party applies
``zwdx.verify.decide`` to each flagged worker, with every shadow's expectation of it: two shadows
that agree with each other and not with the worker name it alone; one shadow, or shadows that all
differ, name it with them. A party's flag the vectors do not bear out names that party. Every
party holds the same account (``StepCheck``, ``what="weights"``) and raises ``StepCheckFailed``
before the forward.
"""
from __future__ import annotations

import logging
import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from zwdx import verify
from zwdx.protocol.report import StepCheck

from gpu_client.rank.failures import collectives

from .step_check import StepChecker, StepCheckFailed, _opinion

log = logging.getLogger(__name__)


def padded_shard(tensor: torch.Tensor, size: torch.Size, workers: int, rank: int | None = None) -> torch.Tensor:
    """One parameter's shard as FSDP's all-gather sends it: ``tensor``, flat, zero-padded to the
    padded shard of ``workers`` ranks (the first ``torch.chunk`` of dim 0 of ``size``: every
    rank's). ``rank``: ``tensor`` is the whole parameter, and rank ``rank``'s chunk of it is cut
    first (none past the last chunk, as ``_chunk_with_empty``)."""
    if rank is not None:
        chunks = torch.chunk(tensor, workers, dim=0)
        tensor = chunks[rank] if rank < len(chunks) else tensor[:0]
    padded = tensor.new_zeros(math.ceil(size[0] / workers) * math.prod(size[1:]))
    padded[:tensor.numel()] = tensor.reshape(-1)
    return padded


def _agree(a: torch.Tensor, b: torch.Tensor, who: tuple[int, int], tolerance: float) -> tuple[bool, float]:
    if torch.equal(a, b):  # identical bytes always agree: no hashing on the common path
        return True, 0.0
    return verify.agree(_opinion(who[0], a), _opinion(who[1], b), tolerance)


class Weights:
    """The root's forward pre-hook, before FSDP's (registered after ``fully_shard``'s, with
    ``prepend``): the module docstring's check, in training forwards only (``training`` and grad
    enabled): every party runs the same user code, so all meet here as often, and an ``eval()`` or
    ``no_grad`` pass meets no one. ``begin``: what starts a step (``fsdp_check.Steps.forward``)."""

    def __init__(self, checker: StepChecker, begin: Callable[[], None], model: FSDPModule, workers: int):
        self.checker, self.begin, self.workers = checker, begin, workers
        self.shadow = self.checker.worker_of is not None
        self.alone = dist.get_world_size() == 1  # the whole model here: a shadow, or a one-rank job
        self.state = model._get_fsdp_state()
        self.params = [p for module in model.modules() if isinstance(module, FSDPModule)
                       if (group := module._get_fsdp_state()._fsdp_param_group) is not None
                       for p in group.fsdp_params]

    def shards(self, rank: int) -> torch.Tensor:
        """Worker ``rank``'s vector: its own shards (a worker of several ranks holds only those,
        ``sharded_param``, a view of the padded data the all-gather sends), or cut from the whole."""
        return torch.cat([padded_shard(p.sharded_param.to_local().detach(), p._orig_size, self.workers,
                                       rank if self.alone else None) for p in self.params]).cpu()

    def __call__(self, module: nn.Module, args) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        self.state._lazy_init()  # FSDP's next hook would: a parameter replaced since fully_shard counts from here
        self.begin()  # the step begins here (FSDP's pre-forward comes after)
        try:
            self.check()
        except StepCheckFailed:
            raise
        except Exception as exc:  # a lost party: as a lost peer of FSDP's own all-gather
            collectives.record(exc)
            raise

    def check(self) -> None:
        checker, workers = self.checker, self.workers
        if checker.check is not None:  # every party stopped at the same check: no more collectives
            raise StepCheckFailed(checker.check)
        expected = torch.stack([self.shards(w) for w in range(workers)]) if self.shadow else None
        own = self.shards(checker.rank) if expected is None else torch.zeros_like(expected[0])
        held = checker._gather(own)
        flags = torch.zeros(workers, dtype=torch.uint8)
        if expected is not None:
            for w in range(workers):
                flags[w] = not _agree(held[w], expected[w], (w, checker.rank), checker.tolerance)[0]
        raised = checker._gather(flags)
        if not any(bool(f.any()) for f in raised):
            return
        shown = checker._gather(expected if expected is not None else held[0].new_zeros(workers, own.numel()))
        checker.check = self._account(held[:workers], shown, raised)
        log.warning("party %d: %s", checker.rank, StepCheckFailed(checker.check))
        raise StepCheckFailed(checker.check)

    def _account(self, held: list[torch.Tensor], shown: list[torch.Tensor], raised: list[torch.Tensor]) -> StepCheck:
        """The module docstring's (4), from what every party holds: the same on every party."""
        checker, workers = self.checker, self.workers
        tolerance, shadows = checker.tolerance, range(workers, checker.parties)
        distances: dict[str, dict[str, float]] = {}
        named: dict[str, str] = {}
        for w in sorted({w for p in shadows for w in range(workers) if raised[p][w]}):
            opinions = [_opinion(p, shown[p][w]) for p in shadows]
            measured, who = verify.decide(_opinion(w, held[w]), opinions, tolerance=tolerance)
            distances[str(w)] = {str(s): (-1.0 if math.isinf(d) else d) for s, d in measured.items()}
            # decide speaks of a shadow's own worker; here every shadow checked every worker
            named.update({str(k): why.replace("the worker it shadows", "the worker") for k, why in who.items()})
        for p in range(checker.parties):  # a flag the vectors every party holds do not bear out
            for w in range(workers):
                if raised[p][w] and (p < workers or _agree(held[w], shown[p][w], (w, p), tolerance)[0]):
                    distances.setdefault(str(w), {})
                    named.setdefault(str(p), f"claimed rank {w}'s weight shard was not what it should be; "
                                             f"the step's weights do not show it")
        return StepCheck(step=checker.step, bucket=0, what="weights", distances=distances, named=named)


def attach(model: FSDPModule, checker: StepChecker, begin: Callable[[], None], workers: int) -> None:
    """The weights check on ``model`` (wrapped), ahead of FSDP's own pre-forward."""
    model.register_forward_pre_hook(Weights(checker, begin, model, workers), prepend=True)

