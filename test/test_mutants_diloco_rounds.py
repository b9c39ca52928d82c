"""gpu_client/rank/strategies/diloco.py called in this process (issue 31 item 3), continued from
test_mutants_diloco.py (the fakes: diloco_fakes.py): what the worker does with the server's answers
(an upload too late, an average not made yet, gone or damaged, a server away), the all-reduce
among workers, a worker of several ranks and the outer step itself."""
from __future__ import annotations

import hashlib
import logging
import types

import numpy as np
import pytest
import requests
import torch

from gpu_client.rank.strategies import diloco as diloco_module
from gpu_client.rank.strategies.diloco import Diloco
from gpu_client.rank.strategies.rounds import RoundTimeout
from diloco_fakes import clock, make  # noqa: F401 (the fixtures)
from diloco_fakes import (EMPTY, ROUNDS, Checkpoints, Reporter, Three, Vector, average_response, make_spec, response,
                                 train)
from zwdx import codec, defaults

torch.set_num_threads(1)


def pending(status, body=None):
    return response(status, body=body if body is not None else {"waiting_for": [1]})


# -- an upload -------------------------------------------------------------------------------------
def test_an_upload_keeps_the_dropped_workers_and_the_rounds_it_sends_the_state_after(make):
    worker, _, server = make(rank=1, world_size=3)
    server.answer = {"dropped": [0, 2], "state_from": 1}
    assert worker._upload(4, b"data", True) is True
    assert worker.dropped == [0, 2] and worker.state_for == {4}
    assert server.calls == [("put", f"{ROUNDS}/4", {"timeout": 600, "data": b"data", "params": {"last": "true"},
                             "headers": {defaults.SHA256_HEADER: hashlib.sha256(b"data").hexdigest()}})]
    server.answer = {"state_from": 0}
    assert worker._upload(5, b"data", False) is True
    assert worker.dropped == [] and worker.state_for == {4}
    server.answer = {"dropped": None}
    worker._upload(6, b"", False)
    assert worker.dropped == []


def test_an_upload_too_late_is_not_sent_again_and_says_so(make, caplog):
    worker, _, server = make(rank=0)
    server.queued[("put", f"{ROUNDS}/3")] = [response(409, b"round 3 was averaged without it")]
    with caplog.at_level(logging.WARNING, logger=diloco_module.__name__):
        assert worker._upload(3, b"x", False) is False
    assert len(server.calls) == 1 and worker.dropped == []
    assert [r.getMessage() for r in caplog.records] == [
        "rank 0: DILOCO round 3 was averaged without this worker (too late); taking its average"]
    assert worker.reporter.logs[-1] == "DILOCO round 3: rank 0 came too late; it takes the round's average"


@pytest.mark.parametrize("status, text", [(409, "another conflict"), (400, "without it"), (500, "")])
def test_an_upload_refused_otherwise_raises(make, status, text):
    worker, _, server = make()
    server.queued[("put", f"{ROUNDS}/0")] = [response(status, text.encode())]
    with pytest.raises(requests.HTTPError):
        worker._upload(0, b"x", False)


# -- a fetch ---------------------------------------------------------------------------------------
def test_a_fetch_asks_again_more_slowly_until_the_average_is_made(make, clock):
    worker, _, server = make()
    server.queued[("get", f"{ROUNDS}/2")] = [pending(202) for _ in range(12)] + [average_response([1.0])]
    assert worker._fetch(2) == average_response([1.0]).content
    delays = [0.02 * 1.5 ** i for i in range(12)]
    assert clock.sleeps == pytest.approx([min(d, 0.5) for d in delays]) and clock.sleeps[-1] == 0.5
    assert len(server.calls) == 13 and server.calls[0][2] == {"timeout": 600}


def test_a_fetch_counts_the_time_the_server_took_as_none_of_its_patience(make, clock):
    worker, _, server = make(latency=40.0, round_timeout=10.0)  # patience 2 * 10 + 30 = 50 s
    server.queued[("get", f"{ROUNDS}/0")] = [pending(202) for _ in range(3)] + [average_response([2.0])]
    assert worker._fetch(0) == average_response([2.0]).content


@pytest.mark.parametrize("settings, patience", [({"round_timeout": 10.0}, 50), ({"collective_timeout": 7.5}, 45)])
def test_a_fetch_gives_up_after_twice_the_rounds_timeout_naming_the_ranks_waited_for(make, clock, monkeypatch,
                                                                                      settings, patience):
    recorded = []
    monkeypatch.setattr(diloco_module.collectives, "record", recorded.append)
    worker, _, server = make(**settings)
    start = clock.now
    server.queued[("get", f"{ROUNDS}/1")] = [pending(202, {"waiting_for": [2, 3]}) for _ in range(200)]
    with pytest.raises(RoundTimeout) as caught:
        worker._fetch(1)
    assert str(caught.value) == (f"DILOCO round 1: rank(s) [2, 3] did not upload their pseudo-gradients "
                                 f"within {patience} s")
    assert recorded == [caught.value]
    assert start + patience < clock.now <= start + patience + 0.5  # it asked once past its deadline, not sooner


def test_a_fetch_waits_exactly_its_patience(make, clock):
    worker, _, server = make(round_timeout=0.01)  # patience 30.02 s: the deadline falls on the sleeps' sum
    server.queued[("get", f"{ROUNDS}/0")] = [pending(202) for _ in range(200)]
    with pytest.raises(RoundTimeout):
        worker._fetch(0)
    asked = len(server.calls)
    assert clock.now - 1000.0 > 30.02 and clock.now - clock.sleeps[-1] - 1000.0 <= 30.02 and asked == len(clock.sleeps) + 1


def test_a_fetch_asks_once_more_at_its_deadline(make, clock):
    worker, _, server = make(round_timeout=10.0)  # patience 50 s; every wait 10 s: asked at 0, 10, ... 60 s
    clock.step = 10.0
    server.queued[("get", f"{ROUNDS}/0")] = [pending(202) for _ in range(20)]
    with pytest.raises(RoundTimeout):
        worker._fetch(0)
    assert len(server.calls) == 7 and clock.now == 1060.0


def test_an_average_gone_or_damaged_or_refused_fails_the_round(make):
    worker, _, server = make()
    server.queued[("get", f"{ROUNDS}/5")] = [response(404)]
    with pytest.raises(RuntimeError) as caught:
        worker._fetch(5)
    assert str(caught.value) == ("DILOCO round 5: its average is gone; this worker fell more than a round behind "
                                 "the others, and the job goes on without it")
    damaged = average_response([1.0])
    damaged._content += b"!"
    server.queued[("get", f"{ROUNDS}/5")] = [damaged]
    with pytest.raises(RuntimeError) as caught:
        worker._fetch(5)
    assert str(caught.value) == "DILOCO round 5: the average arrived damaged (sha256 differs)"
    server.queued[("get", f"{ROUNDS}/5")] = [response(500)]
    with pytest.raises(requests.HTTPError):
        worker._fetch(5)
    unsigned = average_response([1.0])
    del unsigned.headers[defaults.SHA256_HEADER]
    server.queued[("get", f"{ROUNDS}/5")] = [unsigned]
    with pytest.raises(RuntimeError):
        worker._fetch(5)


# -- a server away ---------------------------------------------------------------------------------
@pytest.mark.parametrize("status", [429, 502, 503, 504])
def test_a_server_away_or_busy_is_asked_again_each_second(make, clock, status):
    worker, _, server = make()
    server.queued[("get", "http://x/1")] = [response(status), response(status), response(200, b"ok")]
    assert worker._ask("get", "http://x/1").content == b"ok"
    assert clock.sleeps == [1.0, 1.0]


@pytest.mark.parametrize("status", [404, 409, 500, 200])
def test_other_answers_are_returned_at_once(make, clock, status):
    worker, _, server = make()
    server.queued[("put", "http://x/1")] = [response(status)]
    assert worker._ask("put", "http://x/1", data=b"d").status_code == status
    assert clock.sleeps == [] and server.calls == [("put", "http://x/1", {"timeout": 600, "data": b"d"})]


def test_a_server_away_past_the_patience_gives_its_last_answer_or_error(make, clock):
    worker, _, server = make(patience=3.0)
    server.queued[("get", "http://x/1")] = [response(503) for _ in range(10)]
    assert worker._ask("get", "http://x/1").status_code == 503
    assert len(server.calls) == 5  # at 0, 1, 2, 3 s (the deadline, still in) and 4 s
    server.calls.clear()
    server.queued[("get", "http://x/2")] = [requests.ConnectionError("refused") for _ in range(10)]
    with pytest.raises(requests.ConnectionError):
        worker._ask("get", "http://x/2")
    assert len(server.calls) == 5
    server.queued[("get", "http://x/3")] = [requests.ConnectionError("refused"), response(200, b"back")]
    assert worker._ask("get", "http://x/3").content == b"back"


# -- the outer step --------------------------------------------------------------------------------
def test_the_outer_step_takes_an_average_of_the_models_size_only(make):
    worker, _, _ = make(outer_lr=0.5, outer_momentum=0.5, nesterov=False)
    worker._apply(0, torch.empty(0))
    assert torch.equal(worker.global_.detach(), torch.tensor([1.0, 2.0, 3.0])) and worker.outer.state_dict()["state"] == {}
    with pytest.raises(RuntimeError) as caught:
        worker._apply(4, torch.ones(2))
    assert str(caught.value) == "DILOCO round 4: the average holds 2 values, the model 3"
    worker._apply(0, torch.tensor([2.0, 0.0, -2.0]))
    worker._apply(1, torch.tensor([2.0, 0.0, -2.0]))  # momentum: 2 then 2 * 0.5 + 2 = 3
    assert torch.equal(worker.global_.detach(), torch.tensor([-1.5, 2.0, 5.5])) and worker.global_.grad is None


def test_the_workers_weights_travel_as_one_float32_vector_in_parameter_order(make):
    model = Three().double()
    worker, _, _ = make(model=model)
    assert worker.global_.dtype == torch.float32 and torch.equal(worker.global_.detach(), torch.arange(1.0, 8.0))
    worker._to_local(torch.tensor([9.0, 8, 7, 6, 5, 4, 3]))
    assert torch.equal(model.a, torch.tensor([[9.0, 8], [7, 6]], dtype=torch.float64)) and model.b.item() == 5
    assert torch.equal(model.c, torch.tensor([4.0, 3.0], dtype=torch.float64))
    assert model.a.dtype == torch.float64 and worker._local().dtype == torch.float32
    worker._to_local()
    assert torch.equal(worker._local(), torch.arange(1.0, 8.0))


# -- a worker of several ranks ----------------------------------------------------------------------
def test_a_worker_of_several_ranks_shares_its_first_ranks_answer(make, group_of_one):
    worker, model, server = make(world_size=2, ranks_per_worker=2)
    server.averages[0] = [2.0, 2.0, 2.0]
    train(worker, model, [1.0, 1.0, 1.0])
    worker.sync()
    assert torch.equal(model.w.detach(), torch.tensor([0.0, 1.0, 2.0]))
    system = worker.reporter.system[0]
    assert system["sent_bytes"] == len(server.uploads[0]) > 0 and system["received_bytes"] > 0
    average, counted, sent, received = worker._shared((torch.tensor([1.0, 2.0]), False, 7, 9))
    assert torch.equal(average, torch.tensor([1.0, 2.0])) and (counted, sent, received) == (False, 7, 9)
    assert type(counted) is bool and type(sent) is int
    assert worker._shared((torch.empty(0), True, 3, 4))[1:] == (True, 3, 4)


def test_a_workers_other_rank_sends_nothing_and_reports_no_bytes(make, group_of_one):
    worker, model, server = make(rank=1, world_size=2, ranks_per_worker=2)
    train(worker, model, [1.0, 1.0, 1.0])
    assert worker._exchange(0, torch.ones(3), False) is None
    worker.sync()
    assert server.calls == [] and worker.round == 1 and torch.equal(model.w.detach(), torch.tensor([1.0, 2.0, 3.0]))
    assert worker.reporter.system[0]["sent_bytes"] == 0 and worker.reporter.system[0]["received_bytes"] == 0
    average, counted, sent, received = worker._shared((torch.tensor([1.0, 2.0]), True, 7, 9))  # its head, as rank 0's
    assert torch.equal(average, torch.tensor([1.0, 2.0])) and (counted, sent, received) == (True, 0, 0)


def test_a_worker_of_one_rank_shares_nothing(clock):
    worker = Diloco(make_spec(), Reporter(None))
    out = (torch.ones(1), True, 1, 2)
    assert worker._shared(out) is out


# -- the all-reduce among workers ------------------------------------------------------------------
class Peers:
    """The workers' gloo group as the worker sees it: what it was given, what it answers."""

    def __init__(self, clock, mean, members=2, leavers=0, flagged=None, world=3, fail=None):
        self.clock, self.mean, self.members, self.leavers, self.world = clock, mean, members, leavers, world
        self.flagged, self.fail, self.calls = flagged or {}, fail, []

    def average(self, values, numel, leaving):
        return self._answer(("average", values, numel, leaving))[:3]

    def combine(self, values, numel, leaving, trim):
        return self._answer(("combine", values, numel, leaving, trim))

    def _answer(self, call):
        self.calls.append(call)
        if self.fail:
            raise self.fail
        self.clock.now += 1.5
        return self.mean, self.members, self.leavers, self.flagged

    def wire_bytes(self, numel):
        return 10 * numel


def test_a_round_averages_by_all_reduce_among_the_workers_as_the_codec_would_deliver(make, clock):
    worker, model, server = make(world_size=3, aggregate="mean", compression="int8")
    worker.peers = peers = Peers(clock, torch.tensor([2.0, 2.0, 2.0]))
    train(worker, model, [1.0, 2.0, -3.0])
    worker.sync()
    values = np.array([-1.0, -2.0, 3.0], np.float32)
    (kind, delivered, numel, leaving), = peers.calls
    assert (kind, numel, leaving) == ("average", 3, False)
    assert torch.equal(delivered, torch.from_numpy(codec.decode(codec.encode(values, "int8"))))
    assert not torch.equal(delivered, torch.from_numpy(values)) and server.calls == []
    assert torch.equal(model.w.detach(), torch.tensor([0.0, 1.0, 2.0])) and worker.reduced == 0
    assert worker.reporter.system == [{"outer_round": 0, "sync_seconds": 1.5, "sent_bytes": 30, "received_bytes": 30,
                                       "all_reduce": 1.0}]
    assert worker.reporter.logs[-1] == ("diloco round 0: combined the pseudo-gradients of 2 worker(s) (mean) by "
                                        "all-reduce among the workers (gloo, float32 of the int8 values, about 30 "
                                        "bytes out of each, 1.50 s)")
    assert worker.peers is peers
    worker.sync()  # nothing to add: an empty vector
    assert peers.calls[1][1].numel() == 0 and worker.reduced == 1


def test_a_robust_round_all_gathers_and_names_the_workers_flagged(make, clock, group_of_one):
    worker, model, server = make(world_size=6, ranks_per_worker=2, aggregate="robust", trim=1)
    worker.peers = peers = Peers(clock, torch.ones(3), members=3, flagged={2: "far", 1: "odd"})
    train(worker, model, [1.0, 1.0, 1.0])
    worker.trained()
    (kind, delivered, numel, leaving, trim), = peers.calls
    assert (kind, numel, leaving, trim) == ("combine", 3, True, 1) and torch.equal(delivered, -torch.ones(3))
    assert worker.left is True and server.calls == []
    assert worker.reporter.system[0]["sent_bytes"] == 36 == worker.reporter.system[0]["received_bytes"]
    assert worker.reporter.logs[-1] == ("diloco round 0: combined the pseudo-gradients of 3 worker(s) (robust) by "
                                        "all-gather among the workers (gloo, float32 of the none values, about 36 "
                                        "bytes out of each, 1.50 s); worker 1 (rank 2) flagged: odd; worker 2 "
                                        "(rank 4) flagged: far")


def test_only_rank_0_describes_the_all_reduce(make, clock):
    worker, model, _ = make(rank=1, world_size=3, aggregate="mean")
    worker.peers = Peers(clock, torch.ones(3))
    worker.sync()
    assert worker.reporter.logs == [] and worker.reduced == 0


@pytest.mark.parametrize("last, leavers, told", [(True, 1, True), (True, 3, False), (False, 1, False)])
def test_a_worker_leaving_ends_the_all_reduce_and_the_last_tells_the_server(make, clock, last, leavers, told):
    worker, model, server = make(world_size=3, aggregate="mean")
    worker.peers = Peers(clock, torch.ones(3), leavers=leavers)
    train(worker, model, [1.0, 1.0, 1.0])  # it told the server it leaves with nothing to add
    worker.sync(last=last)
    assert worker.peers is None
    assert server.calls == ([("put", f"{ROUNDS}/1", {"timeout": 600, "data": EMPTY, "params": {"last": "true"},
                                                     "headers": {defaults.SHA256_HEADER: hashlib.sha256(EMPTY).hexdigest()}})]
                            if told else [])


def test_a_failed_all_reduce_goes_through_the_server_from_then_on(make, clock, caplog):
    worker, model, server = make(world_size=3, aggregate="mean")
    worker.peers = peers = Peers(clock, torch.ones(3), fail=RuntimeError("peer gone"))
    train(worker, model, [1.0, 1.0, 1.0])
    with caplog.at_level(logging.WARNING, logger=diloco_module.__name__):
        worker.sync()
    assert worker.peers is None and len(peers.calls) == 1 and worker.reduced == -1
    assert [r.getMessage() for r in caplog.records] == ["rank 0: DILOCO round 0: all-reduce failed: peer gone"]
    assert worker.reporter.logs[-1] == ("DILOCO round 0: rank 0's all-reduce failed (RuntimeError); its rounds go "
                                        "through the server from now on")
    assert server.urls() == [("put", f"{ROUNDS}/0"), ("get", f"{ROUNDS}/0")]
    assert worker.reporter.system[0]["all_reduce"] == 0.0 and torch.equal(model.w.detach(), torch.tensor([1.5, 2.5, 3.5]))


def test_an_average_of_another_size_fails_the_round_it_came_in(make):
    worker, model, server = make()
    server.averages[0] = [1.0, 2.0]
    with pytest.raises(RuntimeError) as caught:
        worker.sync()
    assert str(caught.value) == "DILOCO round 0: the average holds 2 values, the model 3"
    overlapped, _, server = make(overlap=True)
    server.averages[0] = [1.0, 2.0]
    overlapped.sync()
    with pytest.raises(RuntimeError) as caught:
        overlapped.sync()
    assert str(caught.value) == "DILOCO round 0: the average holds 2 values, the model 3"


def test_overlapped_weights_that_diverged_name_their_round(make):
    worker, model, server = make(overlap=True)
    worker.sync()
    train(worker, model, [float("inf"), 0.0, 0.0])
    with pytest.raises(FloatingPointError) as caught:
        worker.sync()
    assert str(caught.value).startswith("DILOCO round 1: this worker's weights hold NaN")


def test_a_worker_of_several_ranks_broadcasts_a_float64_head_then_the_float32_average(make, monkeypatch):
    """What a worker's other rank receives into matches what its first rank sends (a fake broadcast
    plays the first rank: one rank alone cannot tell a wrong dtype)."""
    sent = []

    def broadcast(tensor, src):
        sent.append((tensor.dtype, tensor.numel(), src))
        tensor.copy_(torch.tensor([3.0, 1.0, 10.0, 20.0] if len(sent) % 2 else [1.0, 2.0, 3.0], dtype=tensor.dtype))

    first, _, _ = make(world_size=2, ranks_per_worker=2)
    other, _, _ = make(rank=1, world_size=2, ranks_per_worker=2)
    monkeypatch.setattr(diloco_module, "dist", types.SimpleNamespace(broadcast=broadcast))
    first._shared((torch.tensor([4.0, 5.0, 6.0]), True, 10, 20))
    average, counted, nsent, received = other._shared(None)
    assert torch.equal(average, torch.tensor([1.0, 2.0, 3.0])) and (counted, nsent, received) == (True, 0, 0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the user's code may have
    try:
        other._shared(None)
    finally:
        torch.set_default_dtype(default)
    assert sent == [(torch.float64, 4, 0), (torch.float32, 3, 0)] * 3


def test_two_workers_try_to_reach_each_other(clock, monkeypatch):
    formed = []
    monkeypatch.setattr(diloco_module, "form", lambda *a: formed.append(a) or (None, "no"))
    worker = Diloco(make_spec(rank=1, world_size=2, all_reduce=True), Reporter(None))
    worker.attach(Vector(1.0), Checkpoints())
    worker._hook.remove()
    assert formed == [("10.0.0.9", 29500, 1, 2, 30.0)]
