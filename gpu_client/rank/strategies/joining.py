"""A worker joining a running DILOCO job (``Diloco`` with ``spec.joining``), and the worker that
sends it the global weights: the server names that one in a round's answer (``state_from``);
after it applies that round's average it sends the global weights and the outer optimizer's
momentum (safetensors, metadata ``round``: the next round) to ``PUT .../diloco/state/<round>``.
The joiner polls ``GET .../diloco/state``, loads them (never unpickled) and starts from them:
blocking, its first round is that one; overlapped, it first fetches that round's average as if
it had sent it, and uploads from the round after.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time

import safetensors.torch
import torch

from zwdx import codec, defaults

from .rounds import POLL_FIRST, POLL_MAX, RoundTimeout, Transfer

log = logging.getLogger(__name__)


def send_state(self, n: int) -> None:  # self: the Diloco worker
    """After round ``n``'s average: the global weights and the outer momentum, for the
    workers waiting to join (when the server named this one to send them)."""
    if n not in self.state_for:
        return
    self.state_for.discard(n)
    tensors = {"global": self.global_.detach().contiguous()}
    momentum = self.outer.state.get(self.global_, {}).get("momentum_buffer")
    if momentum is not None:
        tensors["momentum"] = momentum.detach().contiguous()
    data = safetensors.torch.save(tensors, metadata={"round": str(n + 1)})
    resp = self._ask("put", f"{self.base}/state/{n + 1}", data=data,
                     headers={defaults.SHA256_HEADER: hashlib.sha256(data).hexdigest()})
    if resp.status_code == 409:  # sent by another, or no one waits any more
        log.info("rank %d: DILOCO state %d not taken: %s", self.spec.rank, n + 1, resp.text[:200])
        return
    resp.raise_for_status()


def join(self) -> None:  # self: the Diloco worker
    """This worker joins a running job: it waits for the global weights and the outer
    momentum another worker sends at its next round, and starts from them."""
    patience = 2 * (self.settings.round_timeout or self.spec.collective_timeout) + 30
    deadline, delay = time.time() + patience, POLL_FIRST
    while True:
        resp = self._ask("get", f"{self.base}/state")
        if resp.status_code == 200:
            break
        if resp.status_code != 202:
            resp.raise_for_status()
        if time.time() > deadline:
            raise RoundTimeout(f"DILOCO: no worker sent the global weights to join from within {patience:g} s")
        time.sleep(delay)
        delay = min(delay * 1.5, POLL_MAX)
    data = resp.content
    if hashlib.sha256(data).hexdigest() != resp.headers.get(defaults.SHA256_HEADER):
        raise RuntimeError("DILOCO: the global weights arrived damaged (sha256 differs)")
    length = int.from_bytes(data[:8], "little")
    n = int(json.loads(data[8:8 + length])["__metadata__"]["round"])
    tensors = safetensors.torch.load(data)
    with torch.no_grad():
        self.global_.copy_(tensors["global"])
    if "momentum" in tensors and self.settings.outer_momentum:
        self.outer.state[self.global_]["momentum_buffer"] = tensors["momentum"].clone()
    self._to_local()
    self.anchor = self.global_.detach().clone()
    if self.settings.overlap:  # round n's average is still to come: fetched as if it had sent it
        def fetch():
            received = self._fetch(n)
            return torch.from_numpy(codec.decode(received)), True, 0, len(received)
        self.pending, self.round = Transfer(n, fetch), n + 1
    else:
        self.round = n
    self.reporter.log(f"DILOCO: rank {self.spec.rank} joined the job with the global weights after round "
                      f"{n - 1}; its first round is {self.round}")
