"""DILOCO workers that reach each other (gpu_client/rank/strategies/peers.py), in one process: two workers form
their gloo group over rank 0's address and average a round; a worker with nothing to add is
not in the mean; a worker that cannot reach rank 0 gets no group, and neither does rank 0."""
from __future__ import annotations

import socket
import threading

import torch

from gpu_client.rank.strategies.peers import form
from gpu_client.agent.reach import listener
from gpu_client.rank.rendezvous import hold


def held_port() -> int:
    """A port rank 0's store serves on, listening from now on (as its GPU client hands it over)."""
    return hold(listener("127.0.0.1"))


def closed_port() -> socket.socket:
    """A port bound here and not listening, held while the test runs: connecting is refused."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


def both(port: int, work, timeout: float = 10.0) -> list:
    out = [None, None]

    def run(rank: int) -> None:
        out[rank] = work(rank, form("127.0.0.1", port, rank, 2, 30.0, timeout=timeout))
    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_two_workers_that_reach_each_other_average_by_all_reduce():
    def work(rank, formed):
        peers, why = formed
        assert peers is not None, why
        first = peers.average(torch.tensor([1.0, 2.0]) * (rank + 1), 2, leaving=False)
        second = peers.average(torch.tensor([4.0, 4.0]) if rank == 0 else torch.empty(0), 2, leaving=rank == 1)
        return first, second
    (a, a2), (b, b2) = both(held_port(), work)
    assert torch.equal(a[0], torch.tensor([1.5, 3.0])) and torch.equal(a[0], b[0]) and a[1:] == (2, 0)
    assert torch.equal(a2[0], torch.tensor([4.0, 4.0])) and a2[1:] == (1, 1) and b2[1:] == (1, 1)


def test_a_worker_that_cannot_reach_rank_0_goes_through_the_server_and_so_does_rank_0():
    with closed_port() as nobody:
        port = nobody.getsockname()[1]
        alone = form("127.0.0.1", port, 1, 2, 30.0, timeout=1.0)  # nobody listens there
    assert alone[0] is None and f"127.0.0.1:{port} not reached" in alone[1]
    lonely = form("127.0.0.1", held_port(), 0, 2, 30.0, timeout=1.0)  # rank 1 never comes
    assert lonely[0] is None and "heard from rank(s) 0 only" in lonely[1]
