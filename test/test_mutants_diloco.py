"""gpu_client/rank/strategies/diloco.py called in this process (issue 31 item 3: its mutation
score): the Diloco worker driven through its methods against a fake reporter whose ``session``
answers as the server would (or as told), on a clock the test owns (``diloco.time`` replaced),
so every wait, deadline and duration is exact (the fakes: diloco_fakes.py). This file: the
strategy's surface, the tracked state, the step counting, the blocking and the overlapped rounds;
test_mutants_diloco_rounds.py: the server's answers (upload, fetch, retries) and the all-reduce
among workers."""
from __future__ import annotations

import hashlib
import logging
import types

import numpy as np
import pytest
import requests
import torch
import torch.distributed as dist

from diloco_fakes import (BASE, EMPTY, ROUNDS, Checkpoints, Reporter, Server, Three, Vector, average_response, make_spec,
                          response, train)
from diloco_fakes import clock, make  # noqa: F401 (the fixtures)
from gpu_client.rank.strategies import diloco as diloco_module
from gpu_client.rank.strategies.diloco import Diloco
from gpu_client.rank.strategies.parallel import fingerprint
from zwdx import codec, defaults

torch.set_num_threads(1)


# -- the strategy's surface ------------------------------------------------------------------------
def test_a_new_worker_knows_its_place_and_holds_nothing_yet():
    worker = Diloco(make_spec(rank=5, world_size=8, ranks_per_worker=2), Reporter(None))
    assert (worker.per, worker.lead, worker.worker, worker.workers) == (2, False, 2, 4)
    assert worker.base == f"{BASE}/diloco" and worker.url == f"{BASE}/diloco/rounds"
    assert (worker.round, worker.steps, worker.left, worker.params, worker.global_, worker.outer) == (0, 0, False, [], None, None)
    assert worker._hook is None and worker._busy is False and worker.dropped == [] and worker.state_for == set()
    assert worker.anchor is None and worker.pending is None and worker.peers is None and worker.reduced == -1
    assert worker.wrap_as == "DDP" and worker.settings is worker.spec.diloco
    assert Diloco(make_spec(rank=4, world_size=8, ranks_per_worker=2), Reporter(None)).lead is True


def test_a_worker_of_one_rank_meets_alone_and_one_of_several_on_its_port():
    alone = Diloco(make_spec(rank=3, world_size=4), Reporter(None)).rendezvous()
    assert set(alone) == {"store", "rank", "world_size"} and isinstance(alone["store"], dist.HashStore)
    assert (alone["rank"], alone["world_size"]) == (0, 1)
    several = Diloco(make_spec(rank=3, world_size=4, ranks_per_worker=2, worker_port=29600), Reporter(None))
    assert several.rendezvous() == {"init_method": "tcp://127.0.0.1:29600", "rank": 1, "world_size": 2}
    with pytest.raises(RuntimeError) as caught:
        Diloco(make_spec(rank=3, world_size=4, ranks_per_worker=2), Reporter(None)).rendezvous()
    assert str(caught.value) == "a DILOCO worker of several ranks needs its worker_port (an older GPU client?)"


def test_attach_keeps_the_global_weights_the_outer_optimizer_and_says_so(make):
    worker, model, _ = make(outer_lr=0.7, outer_momentum=0.9, overlap=True, inner_steps=4)
    assert worker.params == [model.w]
    assert torch.equal(worker.global_.detach(), torch.tensor([1.0, 2.0, 3.0])) and worker.global_.requires_grad
    assert torch.equal(worker.anchor, worker.global_.detach())
    assert worker.anchor.data_ptr() != worker.global_.data_ptr() != model.w.data_ptr()
    group = worker.outer.param_groups[0]
    assert group["params"] == [worker.global_] and (group["lr"], group["momentum"], group["nesterov"]) == (0.7, 0.9, True)
    assert worker.reporter.outer_step == worker.sync and worker._hook is not None
    assert worker.reporter.logs == [
        "DILOCO: worker 0 of 1, an outer step every 4 inner steps through the server, overlapped with the next "
        "round (one-step delay) (none, outer SGD lr 0.7 momentum 0.9 Nesterov)"]


def test_attach_registers_the_state_and_a_worker_of_several_ranks_says_so(clock):
    checkpoints = Checkpoints()
    worker = Diloco(make_spec(world_size=4, ranks_per_worker=2, compression="int8"), Reporter(None))
    worker.attach(Vector(1.0), checkpoints)
    worker._hook.remove()
    assert checkpoints.tracked == [(worker, "diloco")]
    assert worker.reporter.logs == ["DILOCO: worker 0 of 2 (2 ranks each, DDP among them), an outer step every 3 "
                                    "inner steps through the server (int8, outer SGD lr 0.5 momentum 0.0)"]
    other = Diloco(make_spec(rank=1, world_size=4, ranks_per_worker=2), Reporter(None))
    other.attach(Vector(1.0), Checkpoints())
    other._hook.remove()
    assert other.reporter.logs == []  # rank 0 alone says it


def test_the_workers_first_ranks_try_to_reach_each_other_and_rank_0_says_how_it_went(clock, monkeypatch):
    formed, peers = [], object()
    monkeypatch.setattr(diloco_module, "form", lambda *a: formed.append(a) or answer)
    answer = (peers, "")
    first = Diloco(make_spec(world_size=3, all_reduce=True), Reporter(None))
    first.attach(Vector(1.0), Checkpoints())
    first._hook.remove()
    assert formed == [("10.0.0.9", 29500, 0, 3, 30.0)] and first.peers is peers
    assert first.reporter.logs == [
        "DILOCO: the workers reach each other: rounds average by all-reduce among them (gloo)",
        "DILOCO: worker 0 of 3, an outer step every 3 inner steps by all-reduce (none, outer SGD lr 0.5 momentum 0.0)"]
    answer = (None, "a reason")
    second = Diloco(make_spec(rank=2, world_size=3, all_reduce=True), Reporter(None))
    second.attach(Vector(1.0), Checkpoints())
    second._hook.remove()
    assert formed[-1] == ("10.0.0.9", 29500, 2, 3, 30.0) and second.peers is None and second.reporter.logs == []
    third = Diloco(make_spec(world_size=3, all_reduce=True), Reporter(None))
    third.attach(Vector(1.0), Checkpoints())
    third._hook.remove()
    assert third.reporter.logs[0] == "DILOCO: the workers do not all reach each other (a reason): rounds go through the server"
    formed.clear()
    for spec in (make_spec(world_size=3), make_spec(world_size=1, all_reduce=True),
                 make_spec(rank=1, world_size=4, ranks_per_worker=2, all_reduce=True)):
        worker = Diloco(spec, Reporter(None))
        worker.attach(Vector(1.0), Checkpoints())
        worker._hook.remove()
    assert formed == []  # off, a single worker, a worker's second rank


def test_a_joining_worker_joins_instead_of_reaching_its_peers(clock, monkeypatch):
    joined, formed = [], []
    monkeypatch.setattr(diloco_module.joining, "join", joined.append)
    monkeypatch.setattr(diloco_module, "form", lambda *a: formed.append(a) or (None, ""))
    worker = Diloco(make_spec(rank=1, world_size=3, all_reduce=True, joining=True), Reporter(None))
    worker.attach(Vector(1.0), Checkpoints())
    worker._hook.remove()
    assert joined == [worker] and formed == []


def test_a_shadow_says_so_in_its_own_log_alone_and_spot_checks_keep_the_rounds_on_the_server(clock, monkeypatch,
                                                                                              caplog):
    formed = []
    monkeypatch.setattr(diloco_module, "form", lambda *a: formed.append(a) or (None, ""))
    shadow = Diloco(make_spec(rank=0, world_size=2, shadow=2, verify=0.5, all_reduce=True), Reporter(None))
    assert shadow.shadow == 2 and shadow.uploads_weights() is False
    with caplog.at_level(logging.INFO, logger=diloco_module.__name__):
        shadow.attach(Vector(1.0), Checkpoints())
    shadow._hook.remove()
    assert shadow.reporter.logs == [] and formed == []
    assert [r.getMessage() for r in caplog.records] == [
        "rank 2: DILOCO shadow of worker 0: its uploads are compared with the worker's, never averaged"]
    checked = Diloco(make_spec(rank=0, world_size=2, verify=0.5, all_reduce=True), Reporter(None))
    checked.attach(Vector(1.0), Checkpoints())
    checked._hook.remove()
    assert formed == [] and checked.shadow is None and checked.uploads_weights() is True
    assert "through the server" in checked.reporter.logs[-1]
    assert Diloco(types.SimpleNamespace(**{k: v for k, v in vars(make_spec()).items() if k != "shadow"}),
                  Reporter(None)).shadow is None  # an older GPU client's spec


def test_the_layout_says_the_workers_place(group_of_one):
    worker = Diloco(make_spec(rank=0, world_size=2), Reporter(None))
    out = worker.layout(Vector(1.0, 2.0))
    assert out["role"] == "replica" and out["params"] == 2
    assert out["text"] == "DiLoCo worker 0 of 2: the whole model, an outer step every 3 inner steps"
    several = Diloco(make_spec(rank=3, world_size=4, ranks_per_worker=2), Reporter(None))
    assert several.layout(Vector(1.0))["text"] == ("DiLoCo worker 1 of 2, rank 1 of its 2 (DDP): the whole model, "
                                                   "an outer step every 3 inner steps")


@pytest.mark.parametrize("rank, per, dropped, uploads", [
    (0, 1, [], True), (1, 1, [], False), (1, 1, [0], True), (2, 1, [0], False), (2, 1, [0, 1], True),
    (2, 2, [0], True), (1, 2, [0], False), (0, 2, [2], True)])
def test_the_first_rank_not_dropped_uploads_the_weights(rank, per, dropped, uploads):
    worker = Diloco(make_spec(rank=rank, world_size=4, ranks_per_worker=per), Reporter(None))
    worker.dropped = dropped
    assert worker.uploads_weights() is uploads


def test_the_global_fingerprint_covers_the_parameters_alone():
    model, worker = Three(), Diloco(make_spec(), Reporter(None))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    params_only = fingerprint({"a": state["a"], "b": state["b"], "c": state["c"]})
    assert worker.global_fingerprint(model, state) == params_only != fingerprint(state)
    wrapped = torch.nn.Module()
    wrapped.module = model  # as DDP holds it
    assert worker.global_fingerprint(wrapped, state) == params_only
    assert worker.global_fingerprint(model, None) is None


# -- the tracked state -----------------------------------------------------------------------------
def test_the_state_round_trips_and_a_resumed_worker_starts_from_the_global_weights(make):
    worker, model, _ = make(outer_momentum=0.5)
    train(worker, model, [1.0, 1.0, 1.0])
    worker.sync()
    state = worker.state_dict()
    assert set(state) == {"global", "outer", "round"} and state["round"] == 1
    assert torch.equal(state["global"], worker.global_.detach()) and state["global"].data_ptr() != worker.global_.data_ptr()
    assert state["outer"]["state"][0]["momentum_buffer"] is not None
    other, other_model, _ = make(outer_momentum=0.5, model=Vector(9.0, 9.0, 9.0))
    other.pending, other.round = "in flight", 7
    other.load_state_dict({**state, "round": torch.tensor(1)})
    assert other.round == 1 and type(other.round) is int and other.pending is None
    assert torch.equal(other.global_.detach(), state["global"]) and torch.equal(other_model.w.detach(), state["global"])
    assert torch.equal(other.anchor, state["global"]) and other.anchor.data_ptr() != other.global_.data_ptr()
    assert torch.equal(other.outer.state_dict()["state"][0]["momentum_buffer"], state["outer"]["state"][0]["momentum_buffer"])


# -- counting steps --------------------------------------------------------------------------------
def test_every_inner_steps_th_step_of_any_optimizer_takes_an_outer_step(make):
    worker, model, server = make(inner_steps=3)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    for expected in (1, 2):
        inner.step()
        assert worker.steps == expected and server.calls == []
    inner.step()
    assert worker.steps == 0 and worker.round == 1 and [u for _, u in server.urls()] == [f"{ROUNDS}/0"] * 2
    worker.outer.step()  # the outer optimizer's own steps do not count
    assert worker.steps == 0
    worker.left = True
    inner.step()
    assert worker.steps == 0


def test_steps_taken_while_a_round_is_under_way_do_not_count_and_those_after_do(make):
    worker, model, server = make(inner_steps=5)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    server.during = inner.step  # another optimizer steps while the round travels
    train(worker, model, [1.0, 0.0, 0.0])
    worker.sync()
    assert worker.steps == 0 and worker._busy is False
    server.during = None
    inner.step()
    assert worker.steps == 1


def test_a_sync_before_attach_or_after_leaving_does_nothing(clock):
    worker = Diloco(make_spec(), Reporter(Server(clock)))
    worker.sync()
    assert worker.reporter.session.calls == [] and worker.round == 0


def test_a_round_that_fails_leaves_the_worker_free_to_count_again(make):
    worker, model, server = make()
    server.queued[("put", f"{ROUNDS}/0")] = [response(500)]
    train(worker, model, [1.0, 0.0, 0.0])
    with pytest.raises(requests.HTTPError):
        worker.sync()
    assert worker._busy is False


# -- blocking rounds -------------------------------------------------------------------------------
def test_a_blocking_round_uploads_the_pseudo_gradient_and_steps_the_global_weights_with_the_average(make):
    worker, model, server = make(latency=0.25)
    server.averages[0] = [2.0, -2.0, 4.0]
    train(worker, model, [1.0, 2.0, -3.0])
    worker.sync()
    sent = codec.encode(np.array([-1.0, -2.0, 3.0], np.float32), "none")
    assert server.uploads[0] == sent
    put = server.calls[0]
    assert put[0:2] == ("put", f"{ROUNDS}/0") and put[2]["params"] == {"last": "false"} and put[2]["timeout"] == 600
    assert put[2]["headers"] == {defaults.SHA256_HEADER: hashlib.sha256(sent).hexdigest()}
    assert server.urls()[1] == ("get", f"{ROUNDS}/0")
    expected = torch.tensor([0.0, 3.0, 1.0])  # w0 - 0.5 * average
    assert torch.equal(worker.global_.detach(), expected) and torch.equal(model.w.detach(), expected)
    assert worker.global_.grad is None
    assert (worker.round, worker.steps, worker.left) == (1, 0, False)
    received = len(average_response([0.0, 0.0, 0.0]).content)
    assert worker.reporter.system == [{"outer_round": 0, "sync_seconds": 0.5, "sent_bytes": len(sent),
                                       "received_bytes": received, "all_reduce": 0.0}]


def test_a_worker_that_has_not_stepped_adds_nothing_and_a_second_round_has_its_number(make):
    worker, model, server = make()
    worker.sync()
    assert server.uploads[0] == codec.encode(np.zeros(0, np.float32), "none")
    assert torch.equal(worker.global_.detach(), torch.tensor([1.0, 2.0, 3.0])) and worker.round == 1
    train(worker, model, [1.0, 1.0, 1.0])
    worker.sync()
    assert server.urls()[2:] == [("put", f"{ROUNDS}/1"), ("get", f"{ROUNDS}/1")]
    assert torch.equal(model.w.detach(), torch.tensor([1.5, 2.5, 3.5]))  # its own average: w0 + 0.5 * d
    assert [s["outer_round"] for s in worker.reporter.system] == [0, 1]


def test_the_last_round_says_so_and_the_worker_leaves(make):
    worker, model, server = make()
    train(worker, model, [1.0, 1.0, 1.0])
    worker.trained()
    assert server.calls[0][2]["params"] == {"last": "true"} and worker.left is True
    assert worker.reporter.outer_step is None
    worker.sync()
    assert len(server.calls) == 2


def test_trained_stops_the_outer_steps_even_when_the_last_round_fails(make):
    worker, model, server = make()
    server.queued[("put", f"{ROUNDS}/0")] = [response(500)]
    with pytest.raises(requests.HTTPError):
        worker.trained()
    assert worker.reporter.outer_step is None
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert worker.steps == 0


def test_a_last_round_averaged_without_it_says_it_leaves_in_the_next(make):
    worker, model, server = make()
    server.queued[("put", f"{ROUNDS}/0")] = [response(409, b"round 0 was averaged without it")]
    server.averages[0] = [1.0, 1.0, 1.0]
    train(worker, model, [1.0, 1.0, 1.0])
    worker.trained()
    assert server.urls() == [("put", f"{ROUNDS}/0"), ("get", f"{ROUNDS}/0"), ("put", f"{ROUNDS}/1"),
                             ("get", f"{ROUNDS}/1")]
    assert server.calls[2][2]["params"] == {"last": "true"} and server.uploads[1] == codec.encode(np.zeros(0, np.float32), "none")
    assert worker.left is True and worker.round == 2
    assert torch.equal(model.w.detach(), torch.tensor([0.5, 1.5, 2.5]))  # round 0's average, not its own


def test_a_round_sends_the_global_weights_to_a_joining_worker_when_named(make):
    worker, model, server = make()
    server.answer = {"dropped": [], "state_from": 0}
    train(worker, model, [1.0, 1.0, 1.0])
    worker.sync()
    assert server.urls()[2] == ("put", f"{BASE}/diloco/state/1") and worker.state_for == set()


def test_weights_that_diverged_stop_the_round_before_anything_travels(make):
    worker, model, server = make()
    for bad in (float("nan"), float("inf")):
        train(worker, model, [bad, 0.0, 0.0])
        with pytest.raises(FloatingPointError) as caught:
            worker.sync()
        assert str(caught.value) == ("DILOCO round 0: this worker's weights hold NaN or infinite values "
                                     "(its training diverged)")
    assert server.calls == []
    worker._finite(0, torch.tensor([1.0, -2.0]))


# -- overlapped rounds -----------------------------------------------------------------------------
def test_an_overlapped_round_applies_the_previous_average_on_top_of_the_workers_progress(make):
    worker, model, server = make(overlap=True)
    w0, d0, d1 = torch.tensor([1.0, 2.0, 3.0]), [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]
    server.averages[0], server.averages[1] = [2.0, 2.0, 2.0], [-2.0, 0.0, 2.0]
    train(worker, model, d0)
    worker.sync()  # round 0 travels; nothing applied yet
    assert worker.round == 1 and worker.steps == 0 and worker.pending is not None and worker.pending.round == 0
    assert torch.equal(model.w.detach(), w0 + torch.tensor(d0)) and torch.equal(worker.global_.detach(), w0)
    assert torch.equal(worker.anchor, w0 + torch.tensor(d0))
    train(worker, model, d1)
    worker.sync()  # round 0's average: global = w0 - 0.5 * 2; the worker goes on from there plus d1
    assert torch.equal(worker.global_.detach(), torch.tensor([0.0, 1.0, 2.0]))
    assert torch.equal(model.w.detach(), torch.tensor([0.0, 2.0, 2.0])) and torch.equal(worker.anchor, model.w.detach())
    assert worker.round == 2 and not worker.left
    worker.trained()  # round 1's average, then the last round (nothing to add) waited for
    assert torch.equal(worker.global_.detach(), torch.tensor([1.0, 1.0, 1.0])) and torch.equal(model.w.detach(), worker.global_.detach())
    assert worker.left is True and worker.pending is None and worker.round == 3
    assert server.uploads[0] == codec.encode(np.array([-1.0, 0.0, 0.0], np.float32), "none")
    assert server.uploads[1] == codec.encode(np.array([0.0, -1.0, 0.0], np.float32), "none") and server.uploads[2] == EMPTY
    assert [c[2]["params"]["last"] for c in server.calls if c[0] == "put"] == ["false", "false", "true"]
    system = worker.reporter.system
    assert [s for s in system if "outer_round" not in s] == [{"sync_seconds": 0.0}] * 3
    settled = [s for s in system if "outer_round" in s]
    assert [s["outer_round"] for s in settled] == [0, 1, 2] and all(type(s["transfer_seconds"]) is float for s in settled)
    assert settled[0]["sent_bytes"] == len(server.uploads[0]) and settled[0]["received_bytes"] == len(average_response([0.0] * 3).content)
    assert settled[2]["received_bytes"] == len(EMPTY) and all(s["all_reduce"] == 0.0 for s in settled)
    assert set(settled[0]) == {"outer_round", "sent_bytes", "received_bytes", "transfer_seconds", "all_reduce"}


def test_an_overlapped_worker_that_has_not_stepped_adds_nothing_and_starts_from_the_global_weights(make):
    worker, model, server = make(overlap=True)
    server.averages[0] = [2.0, 2.0, 2.0]
    train(worker, model, [1.0, 1.0, 1.0])
    worker.sync()
    with torch.no_grad():
        model.w += 5.0  # moved, but not by its optimizer's steps
    worker.sync()
    worker.pending.result()
    assert server.uploads[1] == EMPTY and torch.equal(model.w.detach(), torch.tensor([0.0, 1.0, 2.0]))


def test_an_overlapped_last_round_averaged_without_it_says_it_leaves_in_the_next(make):
    worker, model, server = make(overlap=True)
    server.queued[("put", f"{ROUNDS}/0")] = [response(409, b"averaged without it")]
    server.averages[0] = [2.0, 2.0, 2.0]
    train(worker, model, [1.0, 1.0, 1.0])
    worker.trained()
    assert [u for _, u in server.urls()] == [f"{ROUNDS}/0", f"{ROUNDS}/0", f"{ROUNDS}/1", f"{ROUNDS}/1"]
    assert server.uploads[1] == EMPTY and server.calls[2][2]["params"] == {"last": "true"}
    assert worker.left is True and worker.round == 2 and torch.equal(model.w.detach(), torch.tensor([0.0, 1.0, 2.0]))


def test_an_overlapped_round_sends_the_state_after_its_average_is_applied(make):
    worker, model, server = make(overlap=True)
    server.answer = {"dropped": [], "state_from": 0}
    train(worker, model, [1.0, 1.0, 1.0])
    worker.sync()
    worker.pending.result()
    assert ("put", f"{BASE}/diloco/state/1") not in server.urls() and worker.state_for == {0}
    worker.sync()
    assert ("put", f"{BASE}/diloco/state/1") in server.urls() and 0 not in worker.state_for


def test_overlapped_weights_that_diverged_stop_the_round(make):
    worker, model, server = make(overlap=True)
    train(worker, model, [float("nan"), 0.0, 0.0])
    with pytest.raises(FloatingPointError):
        worker.sync()
    assert server.calls == [] and worker.pending is None
