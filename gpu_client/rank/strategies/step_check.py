"""DDP with ``verify``: step checks by shadow ranks (``zwdx.verify``'s rule, every step, before a
gradient is applied; FSDP's through its reduce-scatter: ``fsdp_check.py``, on ``StepChecker.checked_sum``).
The design: docs of issue 33, in short:

- Workers 0..W-1 are the job's DDP ranks (the default group, unchanged for user code); shadows
  W..W+S-1 (S = ``zwdx.verify.count(verify, W)``) each run one worker's rank again (its shard, its
  seeds) over a default group of their own (a world of one), so their user code's collectives are
  no-ops. Who shadows whom only the shadow knows (``RankSpec.rank``; its own is ``RankSpec.shadow``).
- The *check group*: all W+S parties, a gloo group made directly on rank 0's rendezvous store
  (``zwdx-check/<attempt>``), group rank = own rank.
- Every party's DDP model has one comm hook (``StepChecker.hook``) instead of the all-reduce. Per
  bucket: (1) all-gather every worker's own local gradient (undivided; a shadow sends zeros, or its
  gradients would tell the workers whom it shadows); (2) each shadow compares its own with its
  worker's (``zwdx.verify.agree``), then one int per party is all-gathered: -1, or the worker a
  shadow disagrees with; (3) all -1: the bucket becomes the workers' contributions summed in rank
  order, divided by W: the same bytes on every party, so shadows stay in step; (4) else every
  shadow's worker and then its own gradient are all-gathered (the attempt ends, the secret no
  longer matters; the workers' are those of (1), sent before any verdict), every party applies
  ``zwdx.verify.decide`` to the contributions it holds (all get the same account), and the hook
  fails with ``StepCheckFailed``: the optimizer step never runs.

Buckets go over gloo on the CPU (a CUDA bucket is copied there and back). Hooks run one bucket at
a time in the autograd thread (no overlap of communication with the backward pass). A shadow's
DDP rebuilds its buckets in its own gradient-ready order, workers in rank 0's: the same model on
the same kind of device gives the same order; buckets of other sizes would make the all-gather fail.
"""
from __future__ import annotations

import datetime
import hashlib
import logging
import math
import time

import torch
import torch.distributed as dist
from torch import nn

from zwdx import verify
from zwdx.protocol.report import StepCheck

from gpu_client.rank.failures import collectives
from gpu_client.rank.rendezvous import listening

from .parallel import Collective, wrap

log = logging.getLogger(__name__)


class StepCheckFailed(RuntimeError):
    """A step check disagreed: ``check`` is the account every party of the attempt holds."""

    def __init__(self, check: StepCheck):
        named = ", ".join(f"rank {who}" for who in sorted(check.named, key=int)) or "nobody"
        super().__init__(f"step check: step {check.step}, {check.where} disagreed; named: {named}")
        self.check = check


def check_group(store, attempt: int, rank: int, parties: int, timeout: float):
    """The check group of all ``parties`` (workers, then shadows) over ``store`` (rank 0's)."""
    return dist.ProcessGroupGloo(dist.PrefixStore(f"zwdx-check/{attempt}", store), rank, parties,
                                 datetime.timedelta(seconds=timeout))


def rank0_store(host: str, port: int, timeout: float):
    """A client of rank 0's rendezvous store (a shadow may start before rank 0 listens)."""
    listening(host, port, time.monotonic() + timeout)
    return dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=timeout))


def _opinion(who: int, tensor: torch.Tensor) -> verify.Opinion:
    raw = tensor.detach().contiguous()
    digest = hashlib.sha256(raw.view(-1).view(torch.uint8).numpy()).hexdigest()
    return verify.Opinion(who, digest, raw.to(torch.float32).view(-1).numpy())


class StepChecker:
    """One party's side of the step checks (``hook`` is DDP's comm hook, ``self`` its state).
    ``rank``: its group rank (a shadow's own); ``worker_of``: the worker it shadows (None: a worker)."""

    def __init__(self, group, workers: int, rank: int, worker_of: int | None = None, tolerance: float = 0.0):
        self.group, self.workers, self.rank, self.worker_of = group, workers, rank, worker_of
        self.parties, self.tolerance = group.size(), tolerance
        #: Backward passes of this attempt with a synchronised gradient (DDP's ``no_sync`` ones not counted).
        self.step = 0
        #: The disagreement that stopped this party (None while every check agreed).
        self.check: StepCheck | None = None

    def attach(self, model: nn.Module) -> nn.Module:
        """``model`` (DDP) with this party's hook instead of the all-reduce."""
        model.register_comm_hook(self, StepChecker.hook)
        return model

    def hook(self, bucket):  # no annotations: DDP checks them, and this module's are strings
        """DDP's comm hook: a Future of the bucket's checked mean (see the module's docstring). It
        raises rather than failing its future: the exception then reaches ``backward()`` as it is."""
        try:
            buffer = bucket.buffer()
            buffer.copy_(self._bucket(bucket.index(), buffer.detach().cpu()))
        except StepCheckFailed:
            raise
        except Exception as exc:  # a lost party: as a lost peer of DDP's own all-reduce
            collectives.record(exc)
            raise
        finally:
            if bucket.is_last():
                self.step += 1
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(buffer)
        return fut

    def _gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.parties)]
        self.group.allgather([out], [tensor]).wait()
        return out

    def _ints(self, value: int) -> list[int]:
        return [int(t.item()) for t in self._gather(torch.tensor([value], dtype=torch.int64))]

    def _bucket(self, index: int, own: torch.Tensor) -> torch.Tensor:
        return self.checked_sum(index, own).div_(self.workers)

    def checked_sum(self, index: int, own: torch.Tensor) -> torch.Tensor:
        """Steps (1)-(4) of the module's docstring for one bucket of this party's gradient ``own``
        (a CPU tensor): the workers' contributions summed in rank order, undivided, once checked
        (FSDP's reduce-scatter divides as FSDP asked, ``fsdp_check.py``); else ``StepCheckFailed``."""
        if self.check is not None:  # every party stopped at the same bucket: no more collectives
            raise StepCheckFailed(self.check)
        # A shadow sends zeros: its gradients would tell every worker whom it shadows, and a liar
        # would then lie only where no shadow looks. It shows them once a check disagreed (the
        # attempt ends), beside the workers' gradients every party holds from this first gather.
        own = own.contiguous()
        held = self._gather(own if self.worker_of is None else torch.zeros_like(own))
        verdict = -1
        if self.worker_of is not None and not torch.equal(own, held[self.worker_of]) and not verify.agree(
                _opinion(self.worker_of, held[self.worker_of]), _opinion(self.rank, own), self.tolerance)[0]:
            verdict = self.worker_of  # (equal tensors are identical bytes, which always agree: no hashing)
        verdicts = self._ints(verdict)
        if any(v != -1 for v in verdicts):
            worker_of = self._ints(-1 if self.worker_of is None else self.worker_of)
            shown = self._gather(own if self.worker_of is not None else torch.zeros_like(own))
            self.check = self._account(index, held[:self.workers] + shown[self.workers:], verdicts, worker_of)
            log.warning("party %d: %s", self.rank, StepCheckFailed(self.check))
            raise StepCheckFailed(self.check)
        total = held[0].clone()
        for contribution in held[1:self.workers]:  # rank order: the same bytes on every party
            total.add_(contribution)
        return total

    def _account(self, index: int, held: list[torch.Tensor], verdicts: list[int], worker_of: list[int]) -> StepCheck:
        """``zwdx.verify.decide`` for each worker a shadow disagreed with, from the contributions
        every party holds; a party whose claim those contributions do not bear out is named too."""
        opinions = [_opinion(who, tensor) for who, tensor in enumerate(held)]
        distances: dict[str, dict[str, float]] = {}
        named: dict[str, str] = {}
        claims = {p: v for p, v in enumerate(verdicts)
                  if v != -1 and p >= self.workers and v == worker_of[p] and 0 <= v < self.workers}  # a shadow's, of its worker
        for w in sorted(set(claims.values())):
            shadows = [opinions[p] for p in range(self.workers, self.parties) if worker_of[p] == w]
            measured, who = verify.decide(opinions[w], shadows, tolerance=self.tolerance)
            distances[str(w)] = {str(s): (-1.0 if math.isinf(d) else d) for s, d in measured.items()}
            named.update({str(k): why for k, why in who.items()})
        for p, v in enumerate(verdicts):  # a claim the gradients every party holds do not bear out
            if v == -1:
                continue
            if p in claims:
                agreed, d = verify.agree(opinions[v], opinions[p], self.tolerance)
                if not agreed:
                    continue  # decided above
                distances.setdefault(str(v), {})[str(p)] = d
            else:
                distances.setdefault(str(p), {})
            named.setdefault(str(p), f"claimed a disagreement with rank {v} that the step's gradients do not show")
        return StepCheck(step=self.step, bucket=index, distances=distances, named=named)


class Checked(Collective):
    """A DDP job with ``verify``: a worker, or a shadow (``spec.shadow``) of ``spec.rank``."""

    def __init__(self, spec):
        super().__init__(spec)
        settings = spec.job.strategy
        self.shadow: int | None = spec.shadow
        self.parties = spec.world_size + verify.count(settings.verify, spec.world_size)
        self.tolerance = settings.verify_tolerance
        self.checker: StepChecker | None = None
        self._store = None  # rank 0's store, whose client the check group was made over

    def rendezvous(self) -> dict:
        """A worker meets the others at rank 0's port; a shadow's default group is itself alone."""
        if self.shadow is None:
            return super().rendezvous()
        return {"store": dist.HashStore(), "rank": 0, "world_size": 1}

    def wrap(self, model: nn.Module, device: torch.device, bundle: dict, report, example=None) -> nn.Module:
        checker = self._start(report)
        return wrap(model.to(device), "DDP", device, report=report, init_sync=self.tuning.ddp_init_sync,
                    hook=checker.attach)

    def _start(self, report) -> StepChecker:
        """This party's ``StepChecker`` over the check group (on rank 0's store); rank 0 tells the
        job's log what the checks cost, a shadow only its GPU client's own log."""
        spec, mode = self.spec, self.wrap_as
        store = rank0_store(spec.master_addr, spec.master_port, spec.collective_timeout)
        group = check_group(store, spec.attempt, spec.own_rank, self.parties, spec.collective_timeout)
        self.checker = StepChecker(group, spec.world_size, spec.own_rank,
                                   None if self.shadow is None else spec.rank, self.tolerance)
        self._store = store
        if self.shadow is not None:
            log.info("rank %d: %s shadow of rank %d: its gradients are compared with that rank's at every step",
                     self.shadow, mode, spec.rank)
        elif spec.rank == 0 and report is not None:
            report(f"{mode} step checks: {spec.world_size} ranks and {self.parties - spec.world_size} shadow rank(s); "
                   f"every step's gradients are all-gathered (gloo, on the CPU) and each shadow's compared with its "
                   f"rank's (tolerance {self.tolerance:g}) before they are applied")
        return self.checker

    def layout(self, model: nn.Module) -> dict:
        from .layout import line
        out = super().layout(model)
        if self.shadow is None:
            return out
        return {**out, "text": line(f"a shadow of rank {self.spec.rank}: the whole model, its gradients compared "
                                    f"with that rank's at every step")}

    def uploads_weights(self) -> bool:
        return self.shadow is None and super().uploads_weights()

    def failed_check(self) -> StepCheck | None:
        return None if self.checker is None else self.checker.check

    def report_end(self, report) -> None:
        """A shadow reports its end (its final weights' fingerprint) before any rank reports its
        own: shadows report, then meet the ranks at a barrier of the check group, which the ranks
        pass before they report. The server then holds the shadows' fingerprints with the ranks'
        against the weights that came back. A party that never comes delays the ranks' reports by
        the collective timeout at most; they report anyway."""
        if self.shadow is not None:
            report()
        if self.checker is not None:
            try:
                opts = dist.BarrierOptions()
                opts.timeout = datetime.timedelta(seconds=self.spec.collective_timeout)
                self.checker.group.barrier(opts).wait()
            except Exception as exc:  # a party gone at the end: the ranks' reports go on without its word
                log.warning("rank %d: the check group's last barrier failed (%s): reporting anyway",
                            self.spec.own_rank, exc)
        if self.shadow is None:
            report()
