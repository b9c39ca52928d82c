"""The scheduler's loop in process (issue 31 §3: ``Scheduler._loop``, ``__init__``, ``start`` and
``stop``, which test_mutants_scheduler.py leaves to one real-time test): each pass driven on a fake
clock, with the wake and port-answered events as fakes that move the clock instead of waiting,
and the pass's steps as recorders. What it shows: which steps a pass runs (lost GPU clients and
settling on the clock, settling on a kick), how long a kick waits after a pass, a placement
finished at once when rank 0 answers meanwhile, a server that does not lead doing nothing, and a
step that fails logged by name without stopping the pass."""
from __future__ import annotations

import logging
import platform

import pytest
from test_mutants_scheduler import GiB, asked, job_of, placed_one, register  # noqa: F401  (asked: a fixture)

from zwdx.protocol import JobStatus, Parallelism, SlotKind
from zwdx.server import scheduler as scheduler_module

STEPS = ("reap_silent_clients", "settle", "finish_placements", "schedule_once", "join_workers")


class Clock:
    """``time`` for the scheduler module; dyadic times, so that sums are exact."""

    def __init__(self, now: float = 1024.0):
        self.now = now

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        pass


class Hung(Exception):
    """A wait that a real event would never end."""


class FakeEvent:
    """``threading.Event`` whose ``wait`` moves the clock by its timeout instead of waiting (or to
    ``arrive_at``, when it is set then), noting each timeout."""

    def __init__(self, clock: Clock):
        self.clock, self.flag, self.waits, self.arrive_at = clock, False, [], None

    def set(self) -> None:
        self.flag = True

    def clear(self) -> None:
        self.flag = False

    def is_set(self) -> bool:
        return self.flag

    def wait(self, timeout=None) -> bool:
        self.waits.append(timeout)
        if len(self.waits) > 50:
            raise Hung("the loop waits over and over without a pass")
        if self.flag:
            return True
        if timeout is None:
            raise Hung("a wait without a timeout")
        if self.arrive_at is not None and self.clock.now + timeout >= self.arrive_at:
            self.clock.now, self.arrive_at, self.flag = max(self.clock.now, self.arrive_at), None, True
            return True
        self.clock.now += max(timeout, 0.0)
        return False


class Loop:
    """A Scheduler whose loop runs in the test's thread on a fake clock; ``passes`` maps a pass's
    number (from 1) to what happens at its end (in ``join_workers``, its last step)."""

    def __init__(self, app, monkeypatch, passes: dict, fail: bool = False):
        self.app, self.ctx = app, app.extensions["zwdx"]
        self.sched, self.clock = self.ctx.scheduler, Clock()
        self.calls: list[tuple[str, float]] = []
        self.passes, self.fail, self.count = passes, fail, 0
        monkeypatch.setattr(scheduler_module, "time", self.clock)
        monkeypatch.setattr(scheduler_module, "REAP_INTERVAL", 1.0)
        monkeypatch.setattr(scheduler_module, "PASS_INTERVAL", 0.25)
        self.wake, self.port = FakeEvent(self.clock), FakeEvent(self.clock)
        monkeypatch.setattr(self.sched, "_wake", self.wake)
        monkeypatch.setattr(self.sched, "_port_answered", self.port)
        monkeypatch.setattr(self.sched, "_settle", False)
        for name in STEPS:
            monkeypatch.setattr(self.sched, name, self._step(name))

    def _step(self, name):
        def step():
            self.calls.append((name, self.clock.now))
            if name == "join_workers":
                self.count += 1
                self.passes.get(self.count, lambda: None)()
                if self.count >= 8:  # a loop that never ends its passes
                    self.ctx.stopping.set()
            if self.fail:
                raise ValueError(name)
            return 0
        return step

    def run(self) -> list[tuple[float, list[str]]]:
        """The loop until a pass's end sets ``stopping``: each pass's time and steps."""
        self.sched._loop(self.app)
        passes: list[tuple[float, list[str]]] = []
        for name, at in self.calls:
            if not passes or passes[-1][0] != at or name in passes[-1][1]:
                passes.append((at, []))
            passes[-1][1].append(name)
        return passes


ALL, PLACING = list(STEPS), ["finish_placements", "schedule_once", "join_workers"]


def test_each_pass_reaps_and_settles_on_the_clock_and_a_kick_waits_out_the_pass_interval(app, monkeypatch):
    loop: Loop

    def advance(seconds, settle=None):
        def then():
            loop.clock.now += seconds  # the pass took this long
            if settle is not None:
                loop.sched.kick(settle=settle)
        return then
    loop = Loop(app, monkeypatch, {1: advance(0.0625, settle=False), 2: advance(0.125, settle=True),
                                   3: advance(0.125, settle=False), 4: loop_stops(app)})
    assert loop.run() == [
        (1025.0, ALL),              # no kick: the first pass after REAP_INTERVAL, on the clock
        (1025.25, PLACING),         # kicked: PASS_INTERVAL after the last pass began; not yet a round
        (1025.625, ["settle"] + PLACING),  # kicked to settle: settles; three times the 0.125 s pass took
        (1026.0, ALL),              # one REAP_INTERVAL after the first: on the clock again
    ]
    assert loop.wake.waits == [1.0] * 4 and loop.port.waits == [0.1875, 0.25, 0.25]
    assert loop.sched._settle is False and not loop.wake.is_set()


def loop_stops(app):
    return app.extensions["zwdx"].stopping.set


def test_a_rank0_answer_during_the_wait_finishes_placements_at_once_and_the_wait_goes_on(app, monkeypatch, caplog):
    loop: Loop

    def kicked_and_answered():
        loop.sched.kick()
        loop.port.arrive_at = 1025.125

    def failing():
        loop.calls.append(("finish_placements", loop.clock.now))
        raise ValueError("x")
    loop = Loop(app, monkeypatch, {1: kicked_and_answered, 2: loop_stops(app)})
    monkeypatch.setattr(loop.sched, "finish_placements", failing)
    with caplog.at_level(logging.ERROR, logger="zwdx.server.scheduler"):
        assert loop.run() == [(1025.0, ALL), (1025.125, ["finish_placements"]), (1025.25, PLACING)]
    assert loop.port.waits == [0.25, 0.125] and not loop.port.is_set()
    assert [r.getMessage() for r in caplog.records] == ["scheduler: finishing placements failed"] * 3


def test_a_server_that_does_not_lead_places_nothing_until_it_does(app, monkeypatch):
    ctx = app.extensions["zwdx"]
    leads = iter([False, False, True])
    monkeypatch.setattr(ctx.lease, "held", lambda: next(leads, True))
    loop = Loop(app, monkeypatch, {1: loop_stops(app)})
    assert loop.run() == [(1027.0, ALL)]  # two passes skipped, the loop going on
    assert loop.wake.waits == [1.0, 1.0, 1.0]


def test_a_step_that_fails_is_logged_by_name_and_the_pass_goes_on(app, monkeypatch, caplog):
    loop = Loop(app, monkeypatch, {1: loop_stops(app)}, fail=True)
    with caplog.at_level(logging.ERROR, logger="zwdx.server.scheduler"):
        assert loop.run() == [(1025.0, ALL)]
    assert [r.getMessage() for r in caplog.records] == [
        "scheduler: reaping lost gpu clients failed", "scheduler: settling failed jobs failed",
        "scheduler: finishing placements failed", "scheduler: placing jobs failed",
        "scheduler: placing joining DILOCO workers failed"]


def test_a_stopped_server_runs_no_pass(app, monkeypatch):
    loop = Loop(app, monkeypatch, {})
    loop.ctx.stopping.set()
    assert loop.run() == [] and loop.wake.waits == []


# -- start and stop ---------------------------------------------------------------------------------
@pytest.mark.app_config(SCHEDULER=True)
def test_start_runs_the_loop_in_a_named_daemon_thread_and_stop_ends_it(app):
    sched = app.extensions["zwdx"].scheduler
    assert sched._thread.name == "zwdx-scheduler" and sched._thread.daemon and sched._thread.is_alive()
    sched.stop()
    assert not sched._thread.is_alive()


def test_a_shared_server_leaves_the_grace_to_the_lease_and_a_lone_one_gives_it_at_start(app, monkeypatch):
    ctx = app.extensions["zwdx"]
    sched, graced, looped = ctx.scheduler, [], []
    monkeypatch.setattr(ctx, "settings", ctx.settings.model_copy(update={"scheduler": True}))
    monkeypatch.setattr(sched, "grace_after_restart", lambda: graced.append(True))
    monkeypatch.setattr(sched, "_loop", lambda app: looped.append(app))
    monkeypatch.setattr(ctx.lease, "shared", True)
    monkeypatch.setattr(ctx.lease, "on_taken", [])
    sched.start(app)
    sched._thread.join(5)
    assert ctx.lease.on_taken == [sched.took_over] and graced == [] and looped == [app]
    monkeypatch.setattr(ctx.lease, "shared", False)
    sched.start(app)
    sched._thread.join(5)
    assert ctx.lease.on_taken == [sched.took_over] and graced == [True] and looped == [app, app]


def test_stop_sets_stopping_wakes_the_loop_and_waits_for_it_ten_seconds(app):
    sched = app.extensions["zwdx"].scheduler
    joined = []
    assert sched._thread is None and sched._asked == {} and sched._failing == {} and sched._settle is False
    sched.stop()  # never started: nothing to wait for
    sched._wake.clear()
    sched._port_answered.clear()
    sched._thread = type("T", (), {"join": lambda self, timeout: joined.append(timeout)})()
    sched.stop()
    assert joined == [10.0] and sched._wake.is_set() and sched._port_answered.is_set()
    assert app.extensions["zwdx"].stopping.is_set()


# -- what test_mutants_scheduler.py left alive -------------------------------------------------------
def test_the_ram_of_a_job_no_longer_stored_counts_as_none(app, api):
    ctx = app.extensions["zwdx"]
    job_id = api.submit(world_size=1, memory_required=GiB).json["id"]
    slots = [{"job_id": "gone", "kind": "cpu"}, {"job_id": job_id, "kind": "cpu"}, {"job_id": "gpu", "kind": "cuda"},
             {"job_id": None, "kind": "cpu"}]
    assert ctx.scheduler._held_memory(ctx.store.get_job(job_id), slots) == {"gone": 0, job_id: GiB}


def test_a_placement_names_the_slots_gpu_keeps_the_passes_view_as_the_store_and_says_what_mixed_costs(
        app, api, socket_client, asked, monkeypatch, caplog):
    ctx = app.extensions["zwdx"]
    hello = {"client_id": "a", "hostname": "host-a", "versions": {"python": platform.python_version()},
             "slots": [{"index": i, "kind": "cpu", "name": f"CPU {i}", "memory_total": 8 * GiB, "memory_free": 8 * GiB}
                       for i in range(2)]}
    assert socket_client("/gpu", api.donor).emit("register", hello, namespace="/gpu", callback=True)["ok"]
    kinds = []
    monkeypatch.setattr(scheduler_module, "mixed", lambda ks: kinds.append(list(ks)) or (
        "mixed test: what it costs" if len(kinds) == 2 else None))
    plain, noted = api.submit(world_size=1).json["id"], api.submit(world_size=1).json["id"]
    view = ctx.views.of(api.room["id"])
    with caplog.at_level(logging.INFO, logger="zwdx.server.scheduler"):
        for job_id in (plain, noted):
            assert ctx.scheduler._try_start(ctx.store.get_job(job_id), view) is scheduler_module._STARTED
    assert kinds == [[SlotKind.CPU], [SlotKind.CPU]]
    assert [r.getMessage() for r in caplog.records] == [
        f"job {plain}: placed on 1 slot(s): rank 0@host-a:0",
        f"job {noted}: placed on 1 slot(s): rank 0@host-a:1 (mixed test: what it costs)"]
    assert [p["gpu_name"] for j in (plain, noted) for p in job_of(api, j)["placement"]] == ["CPU 0", "CPU 1"]
    reasons = {j: [e.get("reason") for e in job_of(api, j)["timeline"] if e["status"] == "starting"] for j in (plain, noted)}
    assert reasons == {plain: [None], noted: ["mixed test: what it costs"]}
    stored = {s["id"]: (s.get("job_id"), s.get("rank")) for c in ctx.store.list_clients(api.room["id"]) for s in c["slots"]}
    assert {s["id"]: (s.get("job_id"), s.get("rank")) for s in view["a"]["slots"]} == stored \
        == {"a:0": (plain, 0), "a:1": (noted, 0)}


def test_a_failing_request_for_packages_is_logged_naming_the_job(app, api, socket_client, asked, monkeypatch, caplog):
    ctx = app.extensions["zwdx"]
    register(socket_client, api, "a")

    def refresh(*args):
        raise ConnectionError("gone")
    monkeypatch.setattr(scheduler_module.clients_of_room, "ask_refresh", refresh)
    job_id = api.submit(world_size=2).json["id"]
    with caplog.at_level(logging.ERROR, logger="zwdx.server.scheduler"):
        assert ctx.scheduler.schedule_once() == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"scheduler: asking gpu clients to look again for job {job_id}'s packages failed"]
    assert job_of(api, job_id)["waiting_reason"]  # it waits as ever, saying why


def test_a_placement_that_cannot_be_finished_or_a_room_that_cannot_be_told_is_logged_naming_it(
        app, api, socket_client, asked, monkeypatch, caplog):
    ctx, sock, job_id = placed_one(app, api, socket_client, asked)
    asked[0][3]({"addr": "10.1.2.3", "port": 29555})

    def unreadable(*args):
        raise ValueError("does not read")
    monkeypatch.setattr(scheduler_module.Job, "load", unreadable)
    with caplog.at_level(logging.ERROR, logger="zwdx.server.scheduler"):
        assert ctx.scheduler.finish_placements() == 0
        monkeypatch.setattr(ctx.scheduler, "schedule_room", unreadable)
        monkeypatch.setattr(ctx.scheduler, "_could_not_place", unreadable)
        api.submit(world_size=1)
        assert ctx.scheduler.schedule_once() == 0
    room = api.room["id"]
    assert [r.getMessage() for r in caplog.records] == [
        f"scheduler: finishing the placement of job {job_id} failed", f"scheduler: room {room} not placed",
        f"scheduler: telling room {room}'s jobs failed"]


def test_a_finished_placement_is_shown_with_its_rendezvous(app, api, socket_client, asked, monkeypatch):
    from zwdx.server import notify
    ctx, sock, job_id = placed_one(app, api, socket_client, asked)
    shown, job_changed = [], notify.job_changed
    monkeypatch.setattr(notify, "job_changed", lambda job: shown.append(job) or job_changed(job))
    asked[0][3]({"addr": "10.1.2.3", "port": 29555})
    assert ctx.scheduler.finish_placements() == 1
    assert [(j.id, j.master and (j.master.addr, j.master.port)) for j in shown] == [(job_id, ("10.1.2.3", 29555))]


def test_join_workers_asks_the_store_for_running_diloco_jobs_counts_every_join_and_logs_a_failing_one(
        app, api, monkeypatch, caplog):
    ctx = app.extensions["zwdx"]
    ids = [api.submit(world_size=1).json["id"] for _ in range(3)]
    queries = []

    def listed(*args, **kwargs):
        queries.append((args, kwargs))
        return [ctx.store.get_job(i) for i in ids]
    monkeypatch.setattr(ctx.store, "list_jobs", listed)

    def join(record):
        if record.id == ids[1]:
            raise ValueError("x")
        return 1
    monkeypatch.setattr(ctx.scheduler, "_join", join)
    with caplog.at_level(logging.ERROR, logger="zwdx.server.scheduler"):
        assert ctx.scheduler.join_workers() == 2
    assert queries == [((None,), {"statuses": [JobStatus.RUNNING], "parallelism": Parallelism.DILOCO})]
    assert [r.getMessage() for r in caplog.records] == [f"scheduler: a worker joining job {ids[1]} failed"]


@pytest.mark.parametrize("stop", ["no_slot", "taken"])
def test_a_join_that_stops_half_way_counts_the_workers_that_joined(app, api, socket_client, asked, monkeypatch, stop):
    ctx = app.extensions["zwdx"]
    register(socket_client, api, "a", slots=2)
    record = ctx.store.get_job(api.submit(world_size=1).json["id"])
    monkeypatch.setattr(scheduler_module, "wanting", lambda r: [1, 2])
    plans = [([{"id": "a:0", "client_id": "a", "index": 0}], None),
             (None if stop == "no_slot" else [{"id": "a:1", "client_id": "a", "index": 1}], "none")]
    monkeypatch.setattr(scheduler_module, "plan", lambda *args: plans.pop(0))
    joins = [True, False]
    monkeypatch.setattr(scheduler_module.Job, "join", lambda self, entry, slot_id, key_hash: joins.pop(0))
    told = []
    monkeypatch.setattr(scheduler_module.jobs, "assign", lambda ctx_, job, keys, joining: told.append(sorted(keys)))
    monkeypatch.setattr(scheduler_module.jobs, "placed", lambda ctx_, job: None)
    assert ctx.scheduler._join(record) == 1 and told == [[1]]


def test_a_joining_worker_counts_the_ram_other_jobs_ranks_hold_on_its_host(app, api, socket_client, asked,
                                                                           monkeypatch):
    """A DILOCO worker joins only where the host's RAM, less what other jobs' CPU ranks hold, has
    room for it, as a job placed afresh (the joiner used to see the free slots alone: none held)."""
    ctx = app.extensions["zwdx"]
    register(socket_client, api, "a", slots=2)  # 8 GiB of RAM
    holding = api.submit(world_size=1, memory_required=6 * GiB).json["id"]
    assert ctx.scheduler.schedule_once() == 1
    monkeypatch.setattr(scheduler_module, "wanting", lambda r: [1])
    joined = []
    monkeypatch.setattr(scheduler_module.Job, "join", lambda self, entry, slot_id, key_hash: joined.append(
        (self.id, slot_id)) or True)
    monkeypatch.setattr(scheduler_module.jobs, "assign", lambda *args, **kwargs: None)
    monkeypatch.setattr(scheduler_module.jobs, "placed", lambda *args: None)
    big = ctx.store.get_job(api.submit(world_size=1, memory_required=4 * GiB).json["id"])
    small = ctx.store.get_job(api.submit(world_size=1, memory_required=GiB).json["id"])
    assert ctx.scheduler._join(big) == 0  # 8 GiB less the 6 held: no room for 4
    assert ctx.scheduler._join(small) == 1 and joined == [(small.id, "a:1")]
    assert holding != small.id


def test_a_resuming_job_is_placed_on_fewer_ranks_down_to_its_min_world_size(app, api, socket_client, asked):
    """plan reads the job's status and the ranks it ran with: a resuming job that ran with 2 and
    may go on with 1 takes the one slot there is."""
    ctx = app.extensions["zwdx"]
    register(socket_client, api, "a")
    job_id = api.submit(world_size=2, min_world_size=1).json["id"]
    assert ctx.scheduler.schedule_once() == 0  # a new job needs its world_size
    ctx.store.set_job(job_id, {"status": "resuming", "world_size": 2})
    assert ctx.scheduler.schedule_once() == 1
    assert [p["client_id"] for p in job_of(api, job_id)["placement"]] == ["a"]


def test_a_port_request_is_due_at_its_deadline_exactly(app, api, socket_client, asked, monkeypatch):
    ctx, sock, job_id = placed_one(app, api, socket_client, asked)
    request = ctx.scheduler._asked[job_id]
    monkeypatch.setattr(scheduler_module, "time", Clock(request.deadline - 0.5))
    assert ctx.scheduler.finish_placements() == 0 and job_id in ctx.scheduler._asked  # not yet
    monkeypatch.setattr(scheduler_module, "time", Clock(request.deadline))
    assert ctx.scheduler.finish_placements() == 0 and job_id not in ctx.scheduler._asked  # due: placed again
    assert job_of(api, job_id)["status"] == "queued"


def test_placing_a_room_yields_to_the_waiting_connections_without_sleeping(app, api, socket_client, asked,
                                                                           monkeypatch):
    ctx = app.extensions["zwdx"]
    register(socket_client, api, "a")
    api.submit(world_size=1)
    clock, slept = Clock(), []
    clock.sleep = slept.append
    monkeypatch.setattr(scheduler_module, "time", clock)
    assert ctx.scheduler.schedule_once() == 1 and slept == [0]
