"""The scheduler in process (issue 31 §3: zwdx/server/scheduler.py's mutants): the order jobs
are placed in, what a waiting job says, the port request to rank 0's GPU client and what its
answer (or none) does, what is released when, and the pass's other steps. GPU clients register
over the Socket.IO test client; the rank-0 client's acknowledgement is the callback the
scheduler hands ``socketio.emit`` (the test client never acknowledges)."""
from __future__ import annotations

import logging
import platform
import re
import time

import pytest

from zwdx.protocol import EV_JOB_ASSIGN, EV_RESERVE_PORT, GPU_NAMESPACE
from zwdx.server import scheduler as scheduler_module
from zwdx.server.extensions import socketio

GiB = 1 << 30


def register(socket_client, api, cid: str, slots: int = 1, **fields):
    sock = socket_client("/gpu", api.donor)
    hello = {"client_id": cid, "hostname": f"host-{cid}", "versions": {"python": platform.python_version()},
             "slots": [{"index": i, "kind": "cpu", "memory_total": 8 * GiB, "memory_free": 8 * GiB}
                       for i in range(slots)], **fields}
    answer = sock.emit("register", hello, namespace="/gpu", callback=True)
    assert answer["ok"], answer
    return sock


@pytest.fixture
def asked(monkeypatch):
    """The reserve_port calls the scheduler makes: (payload, to, namespace, callback) each; the
    other emits go out as ever."""
    calls, emit = [], socketio.emit

    def fake(event, data=None, *args, **kwargs):
        if event == EV_RESERVE_PORT:
            calls.append((data, kwargs.get("to"), kwargs.get("namespace"), kwargs.get("callback")))
            return None
        return emit(event, data, *args, **kwargs)
    monkeypatch.setattr(socketio, "emit", fake)
    return calls


def job_of(api, job_id: str) -> dict:
    resp = api.get(f"/jobs/{job_id}")
    assert resp.status_code == 200, resp.text
    return resp.json


def slots_held(ctx, room_id: str) -> dict[str, str | None]:
    return {s["id"]: s.get("job_id") for c in ctx.store.list_clients(room_id) for s in c["slots"]}


def assignments(sock) -> list[dict]:
    return [m["args"][0] for m in sock.get_received("/gpu") if m["name"] == EV_JOB_ASSIGN]


# -- the order -------------------------------------------------------------------------------------
def test_jobs_go_in_fifo_order_and_a_head_that_does_not_fit_holds_back_the_rest(app, api, socket_client, asked):
    ctx = app.extensions["zwdx"]
    register(socket_client, api, "a", slots=2)
    first = api.submit(world_size=1).json["id"]
    wide = api.submit(world_size=2).json["id"]  # fits the room, not the one slot left
    behind = api.submit(world_size=1).json["id"]
    assert ctx.scheduler.schedule_once() == 1
    assert job_of(api, first)["status"] == "starting"
    waiting = job_of(api, wide)
    assert waiting["status"] == "queued" and waiting["waiting_reason"], waiting
    assert job_of(api, behind)["status"] == "queued"  # behind the head that waits: not placed
    assert list(slots_held(ctx, api.room["id"]).values()).count(first) == 1
    assert [c[0] for c in asked] == [{"job_id": first}]


def test_a_job_the_room_could_never_run_holds_back_no_one(app, api, socket_client, asked):
    ctx = app.extensions["zwdx"]
    register(socket_client, api, "a", slots=2)
    never = api.submit(world_size=3).json["id"]
    one = api.submit(world_size=1).json["id"]
    two = api.submit(world_size=1).json["id"]
    assert ctx.scheduler.schedule_once() == 2
    assert job_of(api, never)["status"] == "queued" and job_of(api, never)["waiting_reason"]
    assert job_of(api, one)["status"] == job_of(api, two)["status"] == "starting"
    placed = job_of(api, one)["placement"] + job_of(api, two)["placement"]
    assert sorted((p["client_id"], p["gpu_index"], p["rank"]) for p in placed) == [("a", 0, 0), ("a", 1, 0)]
    assert ctx.scheduler.schedule_once() == 0  # nothing left that fits


def test_a_placement_names_each_rank_its_slot_in_order(app, api, socket_client, asked, caplog):
    ctx = app.extensions["zwdx"]
    register(socket_client, api, "b", slots=1)
    register(socket_client, api, "a", slots=2)
    job_id = api.submit(world_size=3).json["id"]
    with caplog.at_level(logging.INFO, logger="zwdx.server.scheduler"):
        assert ctx.scheduler.schedule_once() == 1
    job = job_of(api, job_id)
    assert [(p["rank"], p["client_id"], p["gpu_index"], p["hostname"], p["kind"]) for p in job["placement"]] == [
        (0, "a", 0, "host-a", "cpu"), (1, "a", 1, "host-a", "cpu"), (2, "b", 0, "host-b", "cpu")]
    held = slots_held(ctx, api.room["id"])
    assert all(v == job_id for v in held.values()), held
    assert f"job {job_id}: placed on 3 slot(s): rank 0@host-a:0, rank 1@host-a:1, rank 2@host-b:0" in caplog.text
    # the port is asked of rank 0's GPU client, on its own connection
    [(payload, to, namespace, callback)] = asked
    assert payload == {"job_id": job_id} and namespace == GPU_NAMESPACE and callable(callback)
    assert to == ctx.store.get_client("a")["sid"]
    request = ctx.scheduler._asked[job_id]
    assert (request.client_id, request.attempt, sorted(request.rank_keys)) == ("a", job["attempt"], [0, 1, 2])
    assert all(k.startswith("rk_") for k in request.rank_keys.values())
    assert len(set(request.rank_keys.values())) == 3
    assert not request.answered and request.error is None


def test_a_job_whose_last_ranks_are_still_stopping_waits_and_holds_back_the_rest(app, api, socket_client, asked):
    ctx = app.extensions["zwdx"]
    register(socket_client, api, "a", slots=2)
    old = api.submit(world_size=1).json["id"]
    clients = ctx.views.of(api.room["id"])
    clients["a"]["slots"][1]["job_id"] = old  # a rank of its last attempt, not yet exited
    assert ctx.scheduler._try_start(ctx.store.get_job(old), clients) is scheduler_module._BLOCKED
    assert job_of(api, old)["status"] == "queued" and asked == []
    assert not any(slots_held(ctx, api.room["id"]).values())


# -- the port request and its answer ---------------------------------------------------------------
def placed_one(app, api, socket_client, asked, cid: str = "a"):
    ctx = app.extensions["zwdx"]
    sock = register(socket_client, api, cid)
    job_id = api.submit(world_size=1).json["id"]
    assert ctx.scheduler.schedule_once() == 1
    sock.get_received("/gpu")
    return ctx, sock, job_id


def test_the_answer_wakes_the_scheduler_and_the_placement_is_assigned_with_it(app, api, socket_client, asked):
    ctx, sock, job_id = placed_one(app, api, socket_client, asked)
    assert ctx.scheduler.finish_placements() == 0  # not answered yet, not due
    assert job_id in ctx.scheduler._asked
    ctx.scheduler._wake.clear()
    assert not ctx.scheduler._port_answered.is_set()
    asked[0][3]({"addr": "10.1.2.3", "port": 29555})
    assert ctx.scheduler._port_answered.is_set() and ctx.scheduler._wake.is_set()
    assert ctx.scheduler.finish_placements() == 1
    assert job_id not in ctx.scheduler._asked
    job = job_of(api, job_id)
    assert job["status"] == "starting" and job["master"] == {"addr": "10.1.2.3", "port": 29555}, job
    [assignment] = assignments(sock)
    assert (assignment["job_id"], assignment["master_addr"], assignment["master_port"]) == (job_id, "10.1.2.3", 29555)
    assert assignment["ranks"][0]["rank"] == 0 and assignment["ranks"][0]["key"].startswith("rk_")
    assert ctx.scheduler.finish_placements() == 0  # done once


@pytest.mark.parametrize("answer, words", [
    ((), "did not offer a rendezvous address: its answer: the body must be a JSON object, got NoneType"),
    (({"addr": "", "port": 29555},), "did not offer a rendezvous address: its answer: field 'addr'"),
    (({"addr": "10.1.2.3", "port": 0},), "did not offer a rendezvous address: its answer: field 'port'"),
])
def test_an_answer_that_is_no_port_offer_places_the_job_again_elsewhere(app, api, socket_client, asked, answer,
                                                                          words):
    ctx, sock, job_id = placed_one(app, api, socket_client, asked)
    asked[0][3](*answer)
    assert ctx.scheduler.finish_placements() == 0
    job = job_of(api, job_id)
    assert job["status"] == "queued" and job["avoid"] == ["a"] and job["master"] is None, job
    assert f"rank-0 gpu client a {words}" in job["waiting_reason"], job["waiting_reason"]
    assert not any(slots_held(ctx, api.room["id"]).values())
    assert assignments(sock) == []


@pytest.mark.app_config(RESERVE_TIMEOUT=0.2, START_TRIES=3)
def test_no_answer_within_reserve_timeout_places_the_job_again_not_there(app, api, socket_client, asked):
    ctx = app.extensions["zwdx"]
    register(socket_client, api, "a")
    register(socket_client, api, "b")
    job_id = api.submit(world_size=1).json["id"]
    assert ctx.scheduler.schedule_once() == 1
    first = job_of(api, job_id)["placement"][0]["client_id"]
    request = ctx.scheduler._asked[job_id]
    assert 0.1 < request.deadline - time.time() <= 0.2
    assert ctx.scheduler.finish_placements() == 0 and job_id in ctx.scheduler._asked  # before the deadline
    time.sleep(0.25)
    assert ctx.scheduler.finish_placements() == 0 and job_id not in ctx.scheduler._asked
    job = job_of(api, job_id)
    assert job["status"] == "queued" and job["avoid"] == [first], job
    assert f"rank-0 gpu client {first} did not offer a rendezvous address: no answer within 0.2 s" \
        in job["waiting_reason"]
    assert not any(slots_held(ctx, api.room["id"]).values())
    assert ctx.scheduler.schedule_once() == 1
    assert job_of(api, job_id)["placement"][0]["client_id"] != first


@pytest.mark.app_config(START_TRIES=1)
def test_the_last_try_fails_the_job_and_frees_its_slots(app, api, socket_client, asked):
    ctx, sock, job_id = placed_one(app, api, socket_client, asked)
    asked[0][3]({"addr": "", "port": 1})
    ctx.scheduler.finish_placements()
    job = job_of(api, job_id)
    assert job["status"] == "failed" and "gave up after 1 placement(s) that did not start" in job["reason"], job
    assert not any(slots_held(ctx, api.room["id"]).values())


def test_a_rank0_client_that_cannot_be_asked_frees_the_job_at_once(app, api, socket_client, monkeypatch):
    ctx = app.extensions["zwdx"]
    register(socket_client, api, "a")
    emit = socketio.emit

    def broken(event, *args, **kwargs):
        if event == EV_RESERVE_PORT:
            raise ConnectionError("gone as we wrote")
        return emit(event, *args, **kwargs)
    monkeypatch.setattr(socketio, "emit", broken)
    job_id = api.submit(world_size=1).json["id"]
    ctx.scheduler._wake.clear()
    assert ctx.scheduler.schedule_once() == 1
    request = ctx.scheduler._asked[job_id]
    assert request.answered and request.error == "ConnectionError('gone as we wrote')"
    assert ctx.scheduler._port_answered.is_set() and ctx.scheduler._wake.is_set()
    assert ctx.scheduler.finish_placements() == 0
    job = job_of(api, job_id)
    assert job["status"] == "queued" and job["avoid"] == ["a"]
    assert "did not offer a rendezvous address: ConnectionError('gone as we wrote')" in job["waiting_reason"]


def test_a_rank0_client_without_a_connection_is_not_asked(app, api, socket_client, asked):
    ctx = app.extensions["zwdx"]
    register(socket_client, api, "a")
    job_id = api.submit(world_size=1).json["id"]
    clients = ctx.views.of(api.room["id"])
    clients["a"]["sid"] = None
    record = ctx.store.get_job(job_id)
    assert ctx.scheduler._try_start(record, clients) == scheduler_module._STARTED
    assert asked == []
    request = ctx.scheduler._asked[job_id]
    assert request.answered and request.error == "ConnectionError('the gpu client is not connected')"


def test_a_job_cancelled_while_its_port_was_asked_lets_its_slots_go(app, api, socket_client, asked):
    ctx, sock, job_id = placed_one(app, api, socket_client, asked)
    assert api.post(f"/jobs/{job_id}/cancel").status_code in (200, 202)
    asked[0][3]({"addr": "10.1.2.3", "port": 29555})
    assert ctx.scheduler.finish_placements() == 0
    assert job_of(api, job_id)["status"] == "cancelled"
    assert not any(slots_held(ctx, api.room["id"]).values())
    assert assignments(sock) == []


def test_an_answer_for_an_earlier_attempt_does_nothing(app, api, socket_client, asked):
    ctx, sock, job_id = placed_one(app, api, socket_client, asked)
    ctx.scheduler._asked[job_id].attempt -= 1
    asked[0][3]({"addr": "10.1.2.3", "port": 29555})
    assert ctx.scheduler.finish_placements() == 0
    job = job_of(api, job_id)
    assert job["status"] == "starting" and job["master"] is None
    assert any(slots_held(ctx, api.room["id"]).values())
    assert assignments(sock) == []


# -- a room that cannot be placed ------------------------------------------------------------------
def test_a_room_that_fails_says_so_to_its_jobs_logs_once_and_the_others_are_placed(
        app, api, room_api, socket_client, asked, monkeypatch, caplog):
    ctx = app.extensions["zwdx"]
    other = room_api("other")
    register(socket_client, other, "b")
    broken = api.submit(world_size=1).json["id"]
    fine = other.submit(world_size=1).json["id"]
    place = ctx.scheduler.schedule_room

    def schedule_room(room_id):
        if room_id == api.room["id"]:
            raise RuntimeError("a record that does not read")
        return place(room_id)
    monkeypatch.setattr(ctx.scheduler, "schedule_room", schedule_room)
    with caplog.at_level(logging.ERROR, logger="zwdx.server.scheduler"):
        assert ctx.scheduler.schedule_once() == 1
        assert ctx.scheduler.schedule_once() == 0
    assert caplog.text.count(f"room {api.room['id']} not placed") == 1
    assert job_of(api, broken)["waiting_reason"] == ("the scheduler cannot place this room's jobs (RuntimeError: a "
                                                     "record that does not read); see the server's log")
    assert job_of(other, fine)["status"] == "starting"
    monkeypatch.setattr(ctx.scheduler, "schedule_room", place)
    ctx.scheduler.schedule_once()
    assert api.room["id"] not in ctx.scheduler._failing


def test_a_step_that_raises_is_logged_and_returns_none(caplog):
    def boom():
        raise ValueError("x")
    with caplog.at_level(logging.ERROR, logger="zwdx.server.scheduler"):
        assert scheduler_module._guarded("a step", boom) is None
    assert [r.getMessage() for r in caplog.records] == ["scheduler: a step failed"]
    assert scheduler_module._guarded("a step", lambda a, b: a + b, 1, 2) == 3


# -- the pass's other steps ------------------------------------------------------------------------
def test_kick_wakes_and_only_settle_asks_to_settle(app):
    sched = app.extensions["zwdx"].scheduler
    sched._wake.clear()
    sched.kick()
    assert sched._wake.is_set() and sched._settle is False
    sched.kick(settle=True)
    assert sched._settle is True


def test_a_restarted_server_gives_online_and_busy_clients_the_client_timeout(app, api, socket_client):
    ctx = app.extensions["zwdx"]
    register(socket_client, api, "a")
    before = time.time()
    ctx.scheduler.grace_after_restart()
    client = ctx.store.get_client("a")
    assert client["status"] == "offline" and client["sid"] is None
    assert before + ctx.settings.client_timeout <= client["lost_after"] <= time.time() + ctx.settings.client_timeout


def test_a_client_past_its_deadline_is_declared_lost_saying_why(app, api, socket_client, caplog):
    ctx = app.extensions["zwdx"]
    register(socket_client, api, "a")
    register(socket_client, api, "b")
    register(socket_client, api, "c")
    ctx.store.update_client("a", {"lost_after": time.time() - 1, "last_seen": time.time() - 5})
    ctx.store.update_client("b", {"lost_after": time.time() - 1, "last_seen": time.time() - 7,
                                  "disconnected_at": time.time() - 7})
    ctx.store.update_client("c", {"lost_after": time.time() + 60})
    with caplog.at_level(logging.WARNING):
        ctx.scheduler.reap_silent_clients()
    assert re.search(r"gpu-client a: lost \(no heartbeat for 5\.\d s\)", caplog.text), caplog.text
    assert re.search(r"gpu-client b: lost \(connection dropped and not back for 7\.\d s\)", caplog.text)
    assert ctx.store.get_client("a")["status"] == ctx.store.get_client("b")["status"] == "offline"
    assert ctx.store.get_client("c")["status"] == "online"
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ctx.scheduler.reap_silent_clients()  # offline, holding no ranks: lost once
    assert "lost" not in caplog.text


def test_a_new_leader_gives_clients_held_by_no_live_process_the_client_timeout(app, api, socket_client):
    ctx = app.extensions["zwdx"]
    register(socket_client, api, "a")
    register(socket_client, api, "b")
    ctx.store.update_client("b", {"lost_after": time.time() + 0.5})
    sched = ctx.scheduler
    sched._settle = False
    before = time.time()
    sched.took_over()
    assert ctx.store.get_client("a").get("lost_after") is None  # held by a live process
    assert ctx.store.get_client("b")["lost_after"] >= before + ctx.settings.client_timeout
    assert sched._settle is True


# -- memory held on a host, the loop -----------------------------------------------------------------
def test_the_ram_other_jobs_ranks_hold_on_a_host_counts_against_a_job_that_needs_memory(app, api, socket_client,
                                                                                         asked):
    ctx = app.extensions["zwdx"]
    sock = socket_client("/gpu", api.donor)
    hello = {"client_id": "a", "hostname": "host-a", "versions": {"python": platform.python_version()},
             "slots": [{"index": i, "kind": "cpu", "memory_total": 16 * GiB, "memory_free": 12 * GiB}
                       for i in range(2)]}
    assert sock.emit("register", hello, namespace="/gpu", callback=True)["ok"]
    first = api.submit(world_size=1, memory_required=10 * GiB).json["id"]
    assert ctx.scheduler.schedule_once() == 1
    second = api.submit(world_size=1, memory_required=8 * GiB).json["id"]
    assert ctx.scheduler.schedule_once() == 0
    job = job_of(api, second)
    assert job["status"] == "queued" and "6.0 GiB left" in job["waiting_reason"], job
    held = ctx.scheduler._held_memory(ctx.store.get_job(second), [s for c in ctx.views.of(api.room["id"]).values()
                                                                  for s in c["slots"]])
    assert held == {first: 10 * GiB}
    assert ctx.scheduler._held_memory(ctx.store.get_job(first), []) == {}  # asked only for a job that needs memory
    third = api.submit(world_size=1).json["id"]  # needs none: not held back by RAM, but behind the head
    assert ctx.scheduler.schedule_once() == 0 and job_of(api, third)["status"] == "queued"


@pytest.mark.app_config(SCHEDULER=True)
def test_the_loop_places_a_job_and_finishes_its_placement_when_rank0_answers(app, api, socket_client, asked):
    ctx = app.extensions["zwdx"]
    sock = register(socket_client, api, "a")
    job_id = api.submit(world_size=1).json["id"]
    ctx.scheduler.kick()
    deadline = time.time() + 10  # a pass every 0.2 s; a mutant that stops the loop is a timeout
    while not asked and time.time() < deadline:
        time.sleep(0.02)
    assert asked and asked[0][0] == {"job_id": job_id}
    asked[0][3]({"addr": "10.9.9.9", "port": 4242})
    while job_of(api, job_id)["master"] is None and time.time() < deadline:
        time.sleep(0.02)
    assert job_of(api, job_id)["master"] == {"addr": "10.9.9.9", "port": 4242}
    assert [a["master_port"] for a in assignments(sock)] == [4242]
    ctx.scheduler.stop()
    assert ctx.stopping.is_set() and not ctx.scheduler._thread.is_alive()


def test_a_server_without_the_scheduler_starts_no_loop(app):
    sched = app.extensions["zwdx"].scheduler
    sched.start(app)
    assert sched._thread is None


def test_a_resuming_job_is_judged_by_the_ranks_it_may_go_on_with():
    from types import SimpleNamespace

    from zwdx.protocol import JobStatus
    spec = {"resources": {"world_size": 4, "gpus_per_client": 1}, "recovery": {"min_world_size": 2, "tries": 5},
            "code": "kept"}
    resuming = SimpleNamespace(status=JobStatus.RESUMING, world_size=3)
    assert scheduler_module._least(resuming, spec) == {
        "resources": {"world_size": 2, "gpus_per_client": 1}, "recovery": {"min_world_size": None, "tries": 5},
        "code": "kept"}
    spec_none = {**spec, "recovery": {"min_world_size": None, "tries": 5}}
    assert scheduler_module._least(resuming, spec_none)["resources"]["world_size"] == 3  # the ranks it ran with
    assert scheduler_module._least(SimpleNamespace(status=JobStatus.QUEUED, world_size=3), spec) is spec
    assert scheduler_module._least(SimpleNamespace(status=JobStatus.RESUMING, world_size=None), spec) is spec
    assert spec["resources"]["world_size"] == 4 and spec["recovery"]["min_world_size"] == 2  # not changed in place


def test_an_offline_client_is_reaped_only_while_it_holds_ranks_and_one_that_fails_stops_no_other(
        app, api, socket_client, asked, monkeypatch, caplog):
    ctx = app.extensions["zwdx"]
    for cid in ("a", "b", "c"):
        register(socket_client, api, cid)
    job_id = api.submit(world_size=1).json["id"]
    assert ctx.scheduler.schedule_once() == 1
    assert job_of(api, job_id)["placement"][0]["client_id"] == "a"
    past = time.time() - 1
    for cid in ("a", "b"):
        ctx.store.update_client(cid, {"status": "offline", "lost_after": past, "last_seen": past})
    with caplog.at_level(logging.WARNING):
        ctx.scheduler.reap_silent_clients()
    assert "gpu-client a: lost" in caplog.text and "gpu-client b" not in caplog.text
    assert job_of(api, job_id)["status"] != "starting"
    # a restart: the offline client holding nothing keeps its record as it is
    ctx.scheduler.grace_after_restart()
    assert ctx.store.get_client("b").get("lost_after") == past and ctx.store.get_client("b")["status"] == "offline"
    assert ctx.store.get_client("c")["lost_after"] > time.time()

    lost, client_lost = [], scheduler_module.jobs.client_lost

    def flaky(ctx_, client_id, reason):
        if client_id == "b":
            raise RuntimeError("a record that does not read")
        lost.append(client_id)
        return client_lost(ctx_, client_id, reason)
    monkeypatch.setattr(scheduler_module.jobs, "client_lost", flaky)
    for cid in ("b", "c"):
        ctx.store.update_client(cid, {"status": "online", "lost_after": time.time() - 1})
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="zwdx.server.scheduler"):
        ctx.scheduler.reap_silent_clients()
    assert lost == ["c"]
    assert [r.getMessage() for r in caplog.records if r.name == "zwdx.server.scheduler"] == [
        f"scheduler: gpu client b of room {api.room['id']} not reaped"]


def test_what_a_room_that_cannot_be_placed_tells_its_jobs_is_cut_at_200_characters(app, api, monkeypatch):
    ctx = app.extensions["zwdx"]
    first = api.submit(world_size=1).json["id"]
    second = api.submit(world_size=1).json["id"]
    load = scheduler_module.Job.load

    def unreadable(store, job_id, *args):
        if job_id == first:
            raise ValueError("does not read as a job")
        return load(store, job_id, *args)
    monkeypatch.setattr(scheduler_module.Job, "load", unreadable)
    ctx.scheduler._could_not_place(api.room["id"], KeyError("k" * 300))
    said = job_of(api, second)["waiting_reason"]
    assert said == f"the scheduler cannot place this room's jobs (KeyError: '{'k' * 199}); see the server's log"
    assert job_of(api, first)["waiting_reason"] != said


def test_a_job_that_waits_asks_the_rooms_gpu_clients_to_look_again_for_its_packages(app, api, socket_client,
                                                                                   asked, monkeypatch):
    ctx = app.extensions["zwdx"]
    register(socket_client, api, "a")
    calls = []
    monkeypatch.setattr(scheduler_module.clients_of_room, "ask_refresh",
                        lambda job_id, spec, clients: calls.append((job_id, spec, sorted(c["id"] for c in clients))))
    job_id = api.submit(world_size=2).json["id"]  # one slot: it waits
    assert ctx.scheduler.schedule_once() == 0
    [(called_id, spec, ids)] = calls
    assert called_id == job_id and ids == ["a"]
    assert spec == ctx.store.get_job(job_id).spec.model_dump(mode="json")


def test_a_free_slot_joins_a_diloco_job_in_a_dropped_workers_place_and_is_told_at_once(
        app, api, room_api, socket_client, asked, caplog):
    from zwdx.server.jobs import lifecycle
    ctx = app.extensions["zwdx"]
    socks = {cid: register(socket_client, api, cid) for cid in ("a", "b")}
    job_id = api.submit(parallelism="DILOCO", world_size=2, diloco={"compression": "none"}).json["id"]
    assert ctx.scheduler.schedule_once() == 1
    asked[0][3]({"addr": "10.1.2.3", "port": 29555})
    assert ctx.scheduler.finish_placements() == 1
    for sock in socks.values():
        [assignment] = assignments(sock)
        rank = assignment["ranks"][0]
        resp = api.as_(None, rank_key=rank["key"]).post(f"/jobs/{job_id}/ranks/{rank['rank']}",
                                                        json={"status": "running"})
        assert resp.json["ok"], resp.json
    assert ctx.scheduler.join_workers() == 0  # nothing dropped
    lifecycle.client_lost(ctx, "b", "gone")
    assert job_of(api, job_id)["status"] == "running"
    assert ctx.scheduler.join_workers() == 0  # no free slot
    ctx.store.set_job(job_id, {"avoid": ["b2"]})  # a GPU client the job passed over: never joins it
    register(socket_client, api, "b2")
    register(socket_client, room_api("elsewhere"), "b3")  # another room's free slot: never joins it
    late = socket_client("/gpu", api.donor)
    assert late.emit("register", {"client_id": "c", "hostname": "host-c", "versions": {
        "python": platform.python_version()}, "slots": [{"index": i, "kind": "cpu", "name": "CPU c",
                                                          "memory_total": 8 * GiB, "memory_free": 8 * GiB}
                                                         for i in range(2)]}, namespace="/gpu", callback=True)["ok"]
    with caplog.at_level(logging.INFO, logger="zwdx.server.scheduler"):
        assert ctx.scheduler.join_workers() == 1
    job = job_of(api, job_id)
    assert [(p["rank"], p["client_id"], p["gpu_index"], p["hostname"], p["kind"], p["gpu_name"])
            for p in job["placement"]] == [(0, "a", 0, "host-a", "cpu", ""), (1, "c", 0, "host-c", "cpu", "CPU c")]
    assert job["joins"]["1"]["client_id"] == "c"
    [told] = assignments(late)
    assert told["joining"] is True and [r["rank"] for r in told["ranks"]] == [1]
    assert told["ranks"][0]["key"].startswith("rk_")
    assert told["master_addr"] == "10.1.2.3"
    assert f"job {job_id}: gpu client c joins as rank 1" in [r.getMessage() for r in caplog.records]
    assert slots_held(ctx, api.room["id"])["c:0"] == job_id and slots_held(ctx, api.room["id"])["c:1"] is None
    assert ctx.scheduler.join_workers() == 0  # placed once


def test_a_new_leader_extends_the_deadline_of_clients_holding_ranks_and_shortens_none(app, api, socket_client, asked):
    ctx = app.extensions["zwdx"]
    register(socket_client, api, "c")
    job_id = api.submit(world_size=1).json["id"]
    assert ctx.scheduler.schedule_once() == 1  # c holds its rank
    for cid in ("d", "e"):
        register(socket_client, api, cid)
    past, later = time.time() - 5, time.time() + 10_000
    ctx.store.update_client("c", {"status": "offline", "lost_after": None})
    ctx.store.update_client("d", {"status": "offline", "lost_after": past})  # holds nothing
    ctx.store.update_client("e", {"lost_after": later})
    before = time.time()
    ctx.scheduler.took_over()
    assert slots_held(ctx, api.room["id"])["c:0"] == job_id
    assert before + ctx.settings.client_timeout <= ctx.store.get_client("c")["lost_after"] < later
    assert ctx.store.get_client("d")["lost_after"] == past
    assert ctx.store.get_client("e")["lost_after"] == later


def test_settling_asks_each_room_with_active_jobs_and_one_that_fails_stops_no_other(
        app, api, room_api, socket_client, asked, monkeypatch, caplog):
    ctx = app.extensions["zwdx"]
    other, idle = room_api("other"), room_api("idle")
    register(socket_client, api, "a")
    register(socket_client, other, "b")
    for room in (api, other, idle):
        room.submit(world_size=1)
    assert ctx.scheduler.schedule_once() == 2  # idle has no GPU client: its job stays queued
    calls = []

    def settle_suspects(ctx_, room_id):
        calls.append((ctx_, room_id))
        if room_id == api.room["id"]:
            raise RuntimeError("a record that does not read")
    monkeypatch.setattr(scheduler_module.jobs, "settle_suspects", settle_suspects)
    with caplog.at_level(logging.ERROR, logger="zwdx.server.scheduler"):
        ctx.scheduler.settle()
    assert sorted(calls, key=lambda c: c[1]) == sorted([(ctx, api.room["id"]), (ctx, other.room["id"])],
                                                       key=lambda c: c[1])
    assert [r.getMessage() for r in caplog.records] == [f"scheduler: settling the jobs of room {api.room['id']} failed"]


def test_a_restarted_server_gives_an_offline_client_holding_ranks_the_client_timeout(app, api, socket_client, asked):
    ctx = app.extensions["zwdx"]
    register(socket_client, api, "a")
    api.submit(world_size=1)
    assert ctx.scheduler.schedule_once() == 1
    ctx.store.update_client("a", {"status": "offline", "lost_after": None})
    ctx.scheduler.grace_after_restart()
    assert ctx.store.get_client("a")["lost_after"] > time.time()


def test_a_job_that_moved_on_as_its_port_was_offered_lets_its_slots_go(app, api, socket_client, asked, monkeypatch):
    ctx, sock, job_id = placed_one(app, api, socket_client, asked)
    monkeypatch.setattr(scheduler_module.Job, "rendezvous", lambda self, master: False)  # lost the race
    asked[0][3]({"addr": "10.1.2.3", "port": 29555})
    assert ctx.scheduler.finish_placements() == 0
    assert not any(slots_held(ctx, api.room["id"]).values())
    assert assignments(sock) == []
