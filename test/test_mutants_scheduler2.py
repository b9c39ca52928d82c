"""The scheduler's loop in process (issue 31 §3: ``Scheduler._loop``, ``__init__``, ``start`` and
``stop``, which test_mutants_scheduler.py leaves to one real-time test): each pass driven on a fake
clock, with the wake and port-answered events as fakes that move the clock instead of waiting,
and the pass's steps as recorders. What it shows: which steps a pass runs (lost GPU clients and
settling on the clock, settling on a kick), how long a kick waits after a pass, a placement
finished at once when rank 0 answers meanwhile, a server that does not lead doing nothing, and a
step that fails logged by name without stopping the pass."""
from __future__ import annotations

import logging

import pytest

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
