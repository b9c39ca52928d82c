"""DILOCO on a GPU client: this rank is one worker, or with ``ranks_per_worker`` N one of the N
ranks of one GPU client that make a worker. A worker trains on its own with the submitter's
optimizer, the inner one (its ranks as DDP among themselves, over their own process group on
127.0.0.1), and every ``inner_steps`` of it takes an outer step with the other workers, through
the server (DiLoCo, arXiv 2311.08105):

    pseudo-gradient = global weights - this worker's weights   (float32, on the CPU)
    -> encoded (``zwdx.codec``: int8 with a scale per block, fp16 or none) and uploaded as round k
    -> the server averages the round's uploads once every worker is in; fetched (polled)
    -> global weights: one step of the outer optimizer (SGD, Nesterov momentum) with that average
    -> this worker's weights := the global weights

Every worker decodes the same averaged bytes and steps the same outer optimizer from the same
state, so the global weights are the same on each, to the bit. The inner optimizer keeps its
state across rounds. Nothing but HTTPS to the server: the worker's process group is its own
(a world of one, or its ranks on the GPU client's loopback), so workers never need to reach each
other. A worker of several ranks holds the same weights on each (DDP), so its first rank alone
computes what travels, uploads it and fetches the average, and broadcasts that average (and
whether the worker was in it) to the worker's other ranks at the sync point, in the training
thread: every rank of the worker then steps the same outer optimizer with the same values.
Where the workers all reach each other (``all_reduce``, tried once at the start by their first
ranks: ``peers.py``), a round averages by a gloo all-reduce among them instead, until one fails
or leaves. A worker that joins a running job starts from the global weights another sends
(``joining.py``; not a worker of several ranks: the server places none).

Overlapped (``overlap``, a one-step delay): at round k's sync point the worker's pseudo-gradient
is its progress since round k-1's (``anchor - local``); it applies round k-1's average (waiting
only if it has not come yet), goes on from ``new global - its progress`` (its round of work kept,
on top of the new global weights) and uploads round k on a thread while it trains round k+1. The
global weights are the same on every worker as before, one round later; a round's progress is
measured from the worker's own start, not from the global weights it would have waited for. The
last round is waited for, so the weights that come back are the global ones.

The outer step runs after every ``inner_steps``-th step of any optimizer of the rank's process
(a post-hook on every optimizer: the user's loop needs no change, whether it steps the optimizer
zwdx rebuilt or one of its own), at ``reporter.sync()``, and once more after ``train_func`` returns
(the worker's last round, which later rounds do not wait for). The server averages a round once
every worker still in has uploaded, or ``round_timeout`` after its first upload: a worker that
comes later takes that average and goes on (two rounds late in a row, it is dropped). A worker
whose average does not come within twice that fails as one that lost its peers.

The strategy's surface, as ``parallel.Collective``'s (a subclass): ``rendezvous()``, ``wrap_as``,
``attach(model, checkpointer)``, ``trained()``, ``uploads_weights()``.
"""
from __future__ import annotations

import hashlib
import logging
import time

import requests
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from zwdx import codec, defaults
from zwdx.protocol import Aggregate
from zwdx.protocol.rank import RankSpec

from . import joining
from .rounds import POLL_FIRST, POLL_MAX, RoundTimeout, Transfer
from gpu_client.rank.failures import collectives
from .peers import Peers, form
from .parallel import Collective
from gpu_client.rank.reporter import Reporter

log = logging.getLogger(__name__)

class Diloco(Collective):
    """One worker of a DILOCO job: its outer steps (see the module's docstring)."""

    #: How the model is wrapped and checkpointed: DDP, over this worker's own process group.
    wrap_as = "DDP"

    def __init__(self, spec: RankSpec, reporter: Reporter):
        self.spec, self.reporter, self.settings = spec, reporter, spec.diloco
        #: This worker's ranks (one GPU client's); its first rank speaks for it.
        self.per = self.settings.ranks_per_worker
        self.lead = spec.rank % self.per == 0
        self.worker, self.workers = spec.rank // self.per, spec.world_size // self.per
        #: A shadow (``zwdx.verify``): its own rank, while ``spec.rank`` is the worker's it runs again.
        self.shadow: int | None = getattr(spec, "shadow", None)
        self.base = f"{reporter.base}/diloco"
        self.url = f"{self.base}/rounds"
        self.round = 0   # the next round
        self.steps = 0   # inner steps since the last outer step
        self.left = False
        self.params: list[torch.Tensor] = []
        self.global_: torch.nn.Parameter | None = None
        self.outer: torch.optim.SGD | None = None
        self._hook = None
        self._busy = False
        #: The workers dropped from the job, as the last round this worker uploaded to said.
        self.dropped: list[int] = []
        #: Overlapped: the worker's weights when its last round left (its progress is measured
        #: from there), and that round, still travelling.
        self.anchor: torch.Tensor | None = None
        self.pending: Transfer | None = None
        #: The rounds after whose average this worker sends the global weights to a joining one.
        self.state_for: set[int] = set()
        #: The workers' own gloo group, where they reach each other (``peers.form``); None: the server.
        self.peers: Peers | None = None
        self.reduced = -1  # the last round averaged by all-reduce

    # -- the strategy's surface ----------------------------------------------------------------
    def rendezvous(self) -> dict:
        """``init_process_group``'s arguments: a group of this worker alone (no peer, no port),
        or of its ranks, on the port the agent picked on 127.0.0.1."""
        if self.per == 1:
            return {"store": dist.HashStore(), "rank": 0, "world_size": 1}
        if self.spec.worker_port is None:
            raise RuntimeError("a DILOCO worker of several ranks needs its worker_port (an older GPU client?)")
        return {"init_method": f"tcp://127.0.0.1:{self.spec.worker_port}", "rank": self.spec.rank % self.per,
                "world_size": self.per}

    def attach(self, model: torch.nn.Module, checkpointer) -> None:
        """Keep the global weights and the outer optimizer (in every checkpoint, restored from
        one), and take outer steps from now on."""
        self.params = list(model.parameters())
        self.global_ = torch.nn.Parameter(self._local())
        self.anchor = self.global_.detach().clone()
        s = self.settings
        self.outer = torch.optim.SGD([self.global_], lr=s.outer_lr, momentum=s.outer_momentum, nesterov=s.nesterov)
        checkpointer.track(self, "diloco")  # a resumed worker's global weights, outer state and round
        self._hook = register_optimizer_step_post_hook(self._stepped)
        self.reporter.outer_step = self.sync
        if self.spec.joining:
            self._join()
        elif s.all_reduce and not s.verify and self.workers > 1 and self.lead:  # the workers' first ranks
            self.peers, why = form(self.spec.master_addr, self.spec.master_port, self.worker, self.workers,
                                   self.spec.collective_timeout)
            if self.spec.rank == 0:
                self.reporter.log("DILOCO: the workers reach each other: rounds average by all-reduce among them (gloo)"
                                  if self.peers else f"DILOCO: the workers do not all reach each other ({why}): rounds "
                                                     f"go through the server")
        if self.shadow is not None:  # its log is not the job's: the GPU client's own log says it
            log.info("rank %d: DILOCO shadow of worker %d: its uploads are compared with the worker's, never averaged",
                     self.shadow, self.worker)
        elif self.spec.rank == 0:
            each = f" ({self.per} ranks each, DDP among them)" if self.per > 1 else ""
            self.reporter.log(f"DILOCO: worker {self.worker} of {self.workers}{each}, an outer step every "
                              f"{s.inner_steps} inner steps {'by all-reduce' if self.peers else 'through the server'}"
                              f"{', overlapped with the next round (one-step delay)' if s.overlap else ''} "
                              f"({s.compression.value}, outer SGD "
                              f"lr {s.outer_lr} momentum {s.outer_momentum}{' Nesterov' if s.nesterov else ''})")

    def layout(self, model: torch.nn.Module) -> dict:
        """A worker holds the whole model (its ranks, DDP replicas of it)."""
        from .layout import line
        out = super().layout(model)
        each = f", rank {self.spec.rank % self.per} of its {self.per} (DDP)" if self.per > 1 else ""
        return {**out, "text": line(f"DiLoCo worker {self.worker} of {self.workers}{each}: the whole model, "
                                    f"an outer step every "
                                    f"{self.settings.inner_steps} inner steps")}

    def uploads_weights(self) -> bool:
        """Whether this worker uploads the job's weights: the first rank not dropped (rank 0,
        unless it was; a worker's first rank), as the server takes them; never a shadow."""
        return self.shadow is None and self.spec.rank == next(r for r in range(0, self.spec.world_size, self.per) if r not in self.dropped)

    def global_fingerprint(self, model: torch.nn.Module, state: dict | None) -> str | None:
        """sha256 of this worker's parameters alone (``parallel.fingerprint`` over them): the global
        weights after its last round, which the server compares with its own or, where it saw no
        round, with the other workers' (``zwdx.server.suspects.compare_weights``). Buffers
        (BatchNorm's statistics) are each worker's own and stay out."""
        from .parallel import fingerprint
        module = getattr(model, "module", model)
        names = {k for k, v in module.state_dict(keep_vars=True).items() if isinstance(v, torch.nn.Parameter)}
        return fingerprint({k: v for k, v in state.items() if k in names}) if state is not None else None

    def trained(self) -> None:
        """After ``train_func``: the worker's last round, then no more outer steps."""
        try:
            self.sync(last=True)
        finally:
            if self._hook is not None:
                self._hook.remove()
            self.reporter.outer_step = None

    # -- the tracked state (``reporter.track``'s protocol) ---------------------------------------
    def state_dict(self) -> dict:
        return {"global": self.global_.detach().clone(), "outer": self.outer.state_dict(), "round": self.round}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            self.global_.copy_(state["global"])
        self.outer.load_state_dict(state["outer"])
        self.round = int(state["round"])
        self.anchor, self.pending = self.global_.detach().clone(), None
        self._to_local()  # a resumed worker starts its round from the global weights

    # -- an outer step -------------------------------------------------------------------------
    def _stepped(self, optimizer, args, kwargs) -> None:
        if optimizer is self.outer or self._busy or self.left:
            return
        self.steps += 1
        if self.steps >= self.settings.inner_steps:
            self.sync()

    def sync(self, last: bool = False) -> None:
        """Round ``self.round``: upload this worker's pseudo-gradient, take the global weights
        (waiting for the round's average, or, overlapped, for the previous round's)."""
        if self.left or self.global_ is None:
            return
        self._busy = True
        try:
            if self.settings.overlap:
                self._overlapped(last)
            else:
                self._blocking(last)
        finally:
            self._busy = False

    def _blocking(self, last: bool) -> None:
        started, n = time.time(), self.round
        values = self.global_.detach() - self._local() if self.steps else torch.empty(0)
        self._finite(n, values)
        average, counted, sent, received = self._shared(self._exchange(n, values, last))
        self._apply(n, average)
        self._send_state(n)
        self._to_local()
        self.round, self.steps, self.left = n + 1, 0, last and counted
        self.reporter.log_system(outer_round=n, sync_seconds=time.time() - started, sent_bytes=sent,
                                 received_bytes=received, all_reduce=float(self.reduced == n))
        if last and not counted:
            self._blocking(last=True)  # its leaving came too late for round n: it says so in the next one

    def _overlapped(self, last: bool) -> None:
        """One-step delay: round n's pseudo-gradient is this worker's progress since round n-1
        (``anchor - local``); round n-1's average is applied now, and the worker goes on from the
        new global weights plus that progress while round n travels. See docs/modes/diloco.md."""
        started, n = time.time(), self.round
        progress = self.anchor - self._local() if self.steps else torch.zeros_like(self.anchor)
        values = progress if self.steps else torch.empty(0)
        if self.pending is not None:
            self._settle()
        with torch.no_grad():
            self.anchor = self.global_.detach() - progress
        self._to_local(self.anchor)
        self._finite(n, values)
        self.pending = Transfer(n, lambda: self._exchange(n, values, last))
        self.round, self.steps = n + 1, 0
        if last:  # nothing left to overlap with: wait for the worker's last round
            counted = self._settle()
            self._to_local()
            self.left = counted
            if not counted:
                self._blocking(last=True)
        self.reporter.log_system(sync_seconds=time.time() - started)  # what training waited

    def _settle(self) -> bool:
        """The round in flight: wait for its average and step the global weights with it."""
        transfer, self.pending = self.pending, None
        average, counted, sent, received = self._shared(transfer.result())
        self._apply(transfer.round, average)
        self._send_state(transfer.round)
        self.reporter.log_system(outer_round=transfer.round, sent_bytes=sent, received_bytes=received,
                                 transfer_seconds=transfer.seconds, all_reduce=float(self.reduced == transfer.round))
        return counted

    def _finite(self, n: int, values: torch.Tensor) -> None:
        if not torch.isfinite(values).all():
            raise FloatingPointError(f"DILOCO round {n}: this worker's weights hold NaN or infinite values "
                                     f"(its training diverged)")

    def _exchange(self, n: int, values: torch.Tensor, last: bool) -> tuple[torch.Tensor, bool, int, int]:
        """Round ``n``: this worker's pseudo-gradient out, the round's average in, by all-reduce
        among the workers where they reach each other (``peers``), else through the server. The
        average, whether this worker is in it, and the bytes sent and received; None on a
        worker's other ranks (its first rank's answer reaches them by ``_shared``)."""
        if not self.lead:
            return None
        compression = self.settings.compression.value
        if self.peers is not None:
            try:
                return self._all_reduce(n, values, last)
            except Exception as exc:  # a worker gone: the server drops it, the others go on through it
                self.peers = None
                log.warning("rank %d: DILOCO round %d: all-reduce failed: %s", self.spec.rank, n, exc)
                self.reporter.log(f"DILOCO round {n}: rank {self.spec.rank}'s all-reduce failed ({type(exc).__name__}); "
                                  f"its rounds go through the server from now on")
        data = codec.encode(values.numpy(), compression)
        counted = self._upload(n, data, last)
        received = self._fetch(n)
        return torch.from_numpy(codec.decode(received)), counted, len(data), len(received)

    def _all_reduce(self, n: int, values: torch.Tensor, last: bool) -> tuple[torch.Tensor, bool, int, int]:
        compression, started = self.settings.compression.value, time.time()
        delivered = torch.from_numpy(codec.decode(codec.encode(values.numpy(), compression))) if values.numel() \
            else values  # as the codec delivers it: the server's error
        flagged: dict[int, str] = {}
        if self.settings.aggregate == Aggregate.ROBUST:
            mean, members, leavers, flagged = self.peers.combine(delivered, self.global_.numel(), last,
                                                                 self.settings.trim)
            wire = self.peers.world * 4 * self.global_.numel()  # all-gathered: every worker's vector to each
        else:
            mean, members, leavers = self.peers.average(delivered, self.global_.numel(), last)
            wire = self.peers.wire_bytes(self.global_.numel())
        self.reduced = n
        if self.spec.rank == 0:
            how = "all-gather" if self.settings.aggregate == Aggregate.ROBUST else "all-reduce"
            self.reporter.log(f"diloco round {n}: combined the pseudo-gradients of {members} worker(s) "
                              f"({self.settings.aggregate.value}) by {how} among the workers (gloo, float32 of the "
                              f"{compression} values, about {wire} bytes out of each, {time.time() - started:.2f} s)"
                              + "".join(f"; worker {w} (rank {w * self.per}) flagged: {why}"
                                        for w, why in sorted(flagged.items())))
        if leavers:  # a worker leaves: the ring cannot wait for it, so the rest go through the server
            if last and leavers < self.peers.world:
                self._upload(n + 1, codec.encode(values.numpy()[:0], compression), True)  # the server: it left
            self.peers = None
        return mean, True, wire, wire

    def _shared(self, out: tuple | None) -> tuple[torch.Tensor, bool, int, int]:
        """A worker of several ranks: its first rank's ``_exchange`` answer on every rank of it (a
        broadcast over the worker's group, in the training thread: it orders with DDP's
        collectives). The other ranks sent and received nothing over the network."""
        if self.per == 1:
            return out
        device = self.params[0].device
        head = torch.zeros(4, dtype=torch.float64, device=device)
        if out is not None:
            head = torch.tensor([out[0].numel(), out[1], out[2], out[3]], dtype=torch.float64, device=device)
        dist.broadcast(head, src=0)
        numel, counted, sent, received = (int(v) for v in head.tolist())
        average = out[0] if out is not None else torch.empty(numel, dtype=torch.float32)
        if numel:
            moved = average.to(device)
            dist.broadcast(moved, src=0)
            average = moved.cpu()
        return average, bool(counted), sent if self.lead else 0, received if self.lead else 0

    def _apply(self, n: int, average: torch.Tensor) -> None:
        """One outer step of the global weights with round ``n``'s average."""
        if not average.numel():
            return
        if average.numel() != self.global_.numel():
            raise RuntimeError(f"DILOCO round {n}: the average holds {average.numel()} values, the model "
                               f"{self.global_.numel()}")
        self.global_.grad = average
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)

    def _local(self) -> torch.Tensor:
        """This worker's weights, one flat float32 vector on the CPU."""
        with torch.no_grad():
            return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in self.params])

    def _to_local(self, flat: torch.Tensor | None = None) -> None:
        """This worker's weights := ``flat`` (by default the global weights)."""
        flat = self.global_ if flat is None else flat
        with torch.no_grad():
            offset = 0
            for p in self.params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    # -- through the server ----------------------------------------------------------------------
    def _upload(self, n: int, data: bytes, last: bool) -> bool:
        """Round ``n``'s upload; False when the server averaged the round without it (it came
        after the round's ``round_timeout``): it is not sent again, the worker takes that average
        as the others do."""
        headers = {defaults.SHA256_HEADER: hashlib.sha256(data).hexdigest()}
        resp = self._ask("put", f"{self.url}/{n}", data=data, headers=headers, params={"last": str(last).lower()})
        if resp.status_code == 409 and "without it" in resp.text:
            log.warning("rank %d: DILOCO round %d was averaged without this worker (too late); taking its average",
                        self.spec.rank, n)
            self.reporter.log(f"DILOCO round {n}: rank {self.spec.rank} came too late; it takes the round's average")
            return False
        resp.raise_for_status()
        answer = resp.json()
        self.dropped = answer.get("dropped") or []
        if answer.get("state_from") == self.spec.rank:
            self.state_for.add(n)
        return True

    def _fetch(self, n: int) -> bytes:
        """Round ``n``'s average, asked for until it is made (or the job's collective timeout)."""
        patience = 2 * (self.settings.round_timeout or self.spec.collective_timeout) + 30  # the server's deadline first
        deadline, delay = time.time() + patience, POLL_FIRST
        while True:
            asked = time.time()
            resp = self._ask("get", f"{self.url}/{n}")
            deadline += time.time() - asked  # a server away (a restart) held the peers' uploads up too
            if resp.status_code == 200:
                if hashlib.sha256(resp.content).hexdigest() != resp.headers.get(defaults.SHA256_HEADER):
                    raise RuntimeError(f"DILOCO round {n}: the average arrived damaged (sha256 differs)")
                return resp.content
            if resp.status_code == 404:
                raise RuntimeError(f"DILOCO round {n}: its average is gone; this worker fell more than a round "
                                   f"behind the others, and the job goes on without it")
            if resp.status_code != 202:
                resp.raise_for_status()
            if time.time() > deadline:
                waiting = resp.json().get("waiting_for")
                exc = RoundTimeout(f"DILOCO round {n}: rank(s) {waiting} did not upload their pseudo-gradients "
                                   f"within {patience:g} s")
                collectives.record(exc)  # this worker lost its peers
                raise exc
            time.sleep(delay)
            delay = min(delay * 1.5, POLL_MAX)

    # -- a worker joining (joining.py) ---------------------------------------------------------------
    def _send_state(self, n: int) -> None:
        joining.send_state(self, n)

    def _join(self) -> None:
        joining.join(self)

    def _ask(self, method: str, url: str, **kwargs) -> requests.Response:
        """A call to the server, tried again while it is away or busy (a server restart)."""
        deadline = time.time() + self.reporter.patience
        while True:
            try:
                resp = getattr(self.reporter.session, method)(url, timeout=600, **kwargs)
                if resp.status_code not in (429, 502, 503, 504) or time.time() > deadline:
                    return resp
            except requests.ConnectionError:
                if time.time() > deadline:
                    raise
            time.sleep(1.0)
