"""DILOCO workers that reach each other: a gloo group among them, tried once at the job's start,
so that a round averages by all-reduce instead of through the server.

Rank 0 listens on the rendezvous address its GPU client offered (``master_addr:master_port``,
which a DILOCO job's own process group does not use); every other worker connects to it within
``TIMEOUT`` and says so; rank 0 decides for all: "all-reduce" once every worker of the job said
so within ``TIMEOUT``, else "server"; every worker reads that decision. A worker that cannot
connect goes through the server, and so do the others (rank 0 did not hear from it). Only then
is the gloo group made, over that store.

A round's all-reduce carries the pseudo-gradient as the codec would deliver it (int8 or fp16
values decoded back to float32, so the error is the server's), then how many workers added one
(1 or 0: a worker with nothing to add) and how many leave after this round. The sum is the
same on every worker (gloo's ring), so the global weights stay the same everywhere.
"""
from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from zwdx import codec, robust

from gpu_client.rank.rendezvous import tcp_store

log = logging.getLogger(__name__)

#: Rank 0's store when no group formed: kept open while the process lives (the other workers
#: may still be reading its decision).
_KEPT: list = []

#: Seconds to reach rank 0's store, and for rank 0 to hear from every worker (start skew included).
TIMEOUT = 15.0


class Peers:
    """The job's workers' own gloo group (``form``); ``average`` is one round."""

    def __init__(self, store, group, rank: int, world: int):
        self.store, self.group, self.rank, self.world = store, group, rank, world

    def average(self, values: torch.Tensor, numel: int, leaving: bool) -> tuple[torch.Tensor, int, int]:
        """All-reduce of this worker's (decoded) pseudo-gradient, ``values`` (empty: nothing to
        add): the mean over the workers that added one, how many did, and how many leave."""
        buffer = torch.zeros(numel + 2, dtype=torch.float32)
        if values.numel():
            buffer[:numel] = values
            buffer[numel] = 1.0
        buffer[numel + 1] = 1.0 if leaving else 0.0
        self.group.allreduce([buffer]).wait()
        members, leavers = int(round(buffer[numel].item())), int(round(buffer[numel + 1].item()))
        mean = buffer[:numel] / members if members else torch.empty(0)
        return mean, members, leavers

    def combine(self, values: torch.Tensor, numel: int, leaving: bool, trim: int | None
                ) -> tuple[torch.Tensor, int, int, dict[int, str]]:
        """``average`` under the robust rule (``zwdx.robust``): every worker's pseudo-gradient is
        all-gathered, a frame at a time, and every worker combines them the same way (a ring's
        sum would take a liar's vector as it is). Also the workers flagged this round (worker
        index -> why): every worker computes the same, but only the server can name a suspect."""
        head = torch.tensor([1.0 if values.numel() else 0.0, 1.0 if leaving else 0.0,
                             float(values.double().norm()) if values.numel() else 0.0], dtype=torch.float64)
        heads = self._gather(head)
        members = [i for i, h in enumerate(heads) if h[0] > 0]
        leavers = sum(int(h[1] > 0) for h in heads)
        if not members:
            return torch.empty(0), 0, leavers, {}
        combiner = robust.Combiner([float(heads[i][2]) for i in members], trim=trim)
        out = torch.empty(numel, dtype=torch.float32)
        for start in range(0, numel, codec.FRAME):
            stop = min(numel, start + codec.FRAME)
            mine = values[start:stop] if values.numel() else torch.zeros(stop - start)
            frames = self._gather(mine.contiguous())
            out[start:stop] = torch.from_numpy(combiner.frame([frames[i].numpy() for i in members]))
        flagged = {members[i]: s.flag for i, s in enumerate(combiner.scores()) if s.flag}
        return out, len(members), leavers, flagged

    def _gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.world)]
        self.group.allgather([out], [tensor]).wait()
        return out

    def wire_bytes(self, numel: int) -> int:
        """About the bytes a ring all-reduce of ``numel`` float32 values sends from each worker."""
        return int(2 * (self.world - 1) / self.world * (numel + 2) * 4)


def form(master_addr: str, master_port: int, rank: int, world: int, collective_timeout: float,
         timeout: float = TIMEOUT) -> tuple[Peers | None, str]:
    """The workers' group, or None and why not (they go through the server)."""
    if world < 2:
        return None, "a single worker"
    wait = datetime.timedelta(seconds=timeout)
    store = None
    try:
        store = tcp_store(master_addr, master_port, world, rank == 0, timeout=wait, wait_for_workers=False)
        store.set(f"in/{rank}", "1")
        if rank == 0:
            try:
                store.wait([f"in/{r}" for r in range(world)], wait)
                store.set("decision", "all-reduce")
            except Exception:
                heard = [r for r in range(world) if store.check([f"in/{r}"])]
                store.set("decision", "server")
                _KEPT.append(store)
                return None, f"rank 0 heard from rank(s) {', '.join(map(str, heard))} only within {timeout:g} s"
        else:
            store.wait(["decision"], 3 * wait)
        decision = store.get("decision").decode()
        if decision != "all-reduce":
            _KEPT.append(store)
            return None, "not every worker reached rank 0's address"
        group = dist.ProcessGroupGloo(dist.PrefixStore("diloco", store), rank, world,
                                      datetime.timedelta(seconds=collective_timeout))
        return Peers(store, group, rank, world), ""
    except Exception as exc:  # unreachable, refused, timed out: through the server
        log.info("rank %d: no direct group among the DILOCO workers: %s", rank, exc)
        if store is not None:
            _KEPT.append(store)
        return None, f"{master_addr}:{master_port} not reached ({type(exc).__name__})"
