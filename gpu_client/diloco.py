"""DILOCO on a GPU client: this rank is one worker (one rank per worker, for now). It trains on
its own with the submitter's optimizer, the inner one, and every ``inner_steps`` of it takes an
outer step with the other workers, through the server (DiLoCo, arXiv 2311.08105):

    pseudo-gradient = global weights - this worker's weights   (float32, on the CPU)
    -> encoded (``zwdx.codec``: int8 with a scale per block, fp16 or none) and uploaded as round k
    -> the server averages the round's uploads once every worker is in; fetched (polled)
    -> global weights: one step of the outer optimizer (SGD, Nesterov momentum) with that average
    -> this worker's weights := the global weights

Every worker decodes the same averaged bytes and steps the same outer optimizer from the same
state, so the global weights are the same on each, to the bit. The inner optimizer keeps its
state across rounds. Nothing but HTTPS to the server: the worker's process group is its own
(world of one; its ranks would share it once a worker has several), so workers never need to
reach each other.

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
from zwdx.protocol.rank import RankSpec

from .failures import collectives
from .parallel import Collective
from .reporter import Reporter

log = logging.getLogger(__name__)

#: Seconds between two asks for a round's average (growing to ``POLL_MAX``).
POLL_FIRST, POLL_MAX = 0.02, 0.5


class RoundTimeout(TimeoutError):
    """A round's peers did not upload in time: this worker lost them."""


class Diloco(Collective):
    """One worker of a DILOCO job: its outer steps (see the module's docstring)."""

    #: How the model is wrapped and checkpointed: DDP, over this worker's own process group.
    wrap_as = "DDP"

    def __init__(self, spec: RankSpec, reporter: Reporter):
        self.spec, self.reporter, self.settings = spec, reporter, spec.diloco
        self.url = f"{reporter.base}/diloco/rounds"
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

    # -- the strategy's surface ----------------------------------------------------------------
    def rendezvous(self) -> dict:
        """``init_process_group``'s arguments: a group of this worker alone (no peer, no port)."""
        return {"store": dist.HashStore(), "rank": 0, "world_size": 1}

    def attach(self, model: torch.nn.Module, checkpointer) -> None:
        """Keep the global weights and the outer optimizer (in every checkpoint, restored from
        one), and take outer steps from now on."""
        self.params = list(model.parameters())
        self.global_ = torch.nn.Parameter(self._local())
        s = self.settings
        self.outer = torch.optim.SGD([self.global_], lr=s.outer_lr, momentum=s.outer_momentum, nesterov=s.nesterov)
        checkpointer.track(self, "diloco")  # a resumed worker's global weights, outer state and round
        self._hook = register_optimizer_step_post_hook(self._stepped)
        self.reporter.outer_step = self.sync
        if self.spec.rank == 0:
            self.reporter.log(f"DILOCO: worker {self.spec.rank} of {self.spec.world_size}, an outer step every "
                              f"{s.inner_steps} inner steps through the server ({s.compression.value}, outer SGD "
                              f"lr {s.outer_lr} momentum {s.outer_momentum}{' Nesterov' if s.nesterov else ''})")

    def uploads_weights(self) -> bool:
        """Whether this worker uploads the job's weights: the first rank not dropped (rank 0,
        unless it was), as the server takes them."""
        return self.spec.rank == next(r for r in range(self.spec.world_size) if r not in self.dropped)

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
        self._to_local()  # a resumed worker starts its round from the global weights

    # -- an outer step -------------------------------------------------------------------------
    def _stepped(self, optimizer, args, kwargs) -> None:
        if optimizer is self.outer or self._busy or self.left:
            return
        self.steps += 1
        if self.steps >= self.settings.inner_steps:
            self.sync()

    def sync(self, last: bool = False) -> None:
        """Round ``self.round``: upload, wait for the average, step the global weights, take them."""
        if self.left or self.global_ is None:
            return
        self._busy, started, n = True, time.time(), self.round
        try:
            values = (self.global_.detach() - self._local()).numpy() if self.steps else torch.empty(0).numpy()
            if not torch.isfinite(torch.from_numpy(values)).all():
                raise FloatingPointError(f"DILOCO round {n}: this worker's weights hold NaN or infinite values "
                                         f"(its training diverged)")
            sent = codec.encode(values, self.settings.compression.value)
            counted = self._upload(n, sent, last)
            received = self._fetch(n)
            average = torch.from_numpy(codec.decode(received))
            if average.numel():
                if average.numel() != self.global_.numel():
                    raise RuntimeError(f"DILOCO round {n}: the average holds {average.numel()} values, the model "
                                       f"{self.global_.numel()}")
                self.global_.grad = average
                self.outer.step()
                self.outer.zero_grad(set_to_none=True)
            self._to_local()
            self.round, self.steps, self.left = n + 1, 0, last and counted
            self.reporter.log_system(outer_round=n, sync_seconds=time.time() - started, sent_bytes=len(sent),
                                     received_bytes=len(received))
        finally:
            self._busy = False
        if last and not counted:
            self.sync(last=True)  # its leaving came too late for round n: it says so in the next one

    def _local(self) -> torch.Tensor:
        """This worker's weights, one flat float32 vector on the CPU."""
        with torch.no_grad():
            return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in self.params])

    def _to_local(self) -> None:
        """This worker's weights := the global weights."""
        with torch.no_grad():
            offset = 0
            for p in self.params:
                p.copy_(self.global_[offset:offset + p.numel()].view_as(p))
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
        self.dropped = resp.json().get("dropped") or []
        return True

    def _fetch(self, n: int) -> bytes:
        """Round ``n``'s average, asked for until it is made (or the job's collective timeout)."""
        patience = 2 * (self.settings.round_timeout or self.spec.collective_timeout) + 30  # the server's deadline first
        deadline, delay = time.time() + patience, POLL_FIRST
        while True:
            resp = self._ask("get", f"{self.url}/{n}")
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

    def _ask(self, method: str, url: str, **kwargs) -> requests.Response:
        """A call to the server, tried again while it is away or busy (a server restart)."""
        deadline = time.time() + defaults.OUTAGE_TOLERANCE
        while True:
            try:
                resp = getattr(self.reporter.session, method)(url, timeout=600, **kwargs)
                if resp.status_code not in (429, 502, 503, 504) or time.time() > deadline:
                    return resp
            except requests.ConnectionError:
                if time.time() > deadline:
                    raise
            time.sleep(1.0)
