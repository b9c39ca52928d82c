"""``bench/control_plane.py --kill-one AT``: what a level with a killed server process reports and
when it passes (bench/kill_one.py). The drops and jobs here are written as the load generators
write them; the bench gathers them from a live run (slow, on the device host)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import kill_one  # noqa: E402
from control_plane import passed  # noqa: E402
from recorder import Recorder  # noqa: E402

KILL = 1000.0


def level(drops: list[list], jobs: dict, lat: dict | None = None, errors: dict | None = None) -> dict:
    return {"lat": lat or {}, "held": 10, "clients": 10, "errors": errors or {},
            "kill": kill_one.summarize(drops, jobs, KILL)}


def test_dropped_clients_are_timed_from_the_drop_to_their_register_elsewhere():
    drops = [["a", KILL + 0.1, KILL + 2.1, KILL + 1.1], ["b", KILL + 0.2, KILL + 4.2], ["c", KILL + 0.3, None],
             ["before", KILL - 30, KILL - 29]]  # a drop long before the kill is not the kill's
    k = kill_one.summarize(drops, {"j1": "completed"}, KILL)
    assert (k["dropped"], k["back"], k["not_back"]) == (3, 2, 1)
    assert (k["p50_s"], k["max_s"], k["connected_max_s"]) == (3.0, 4.0, 1.0)
    assert kill_one.verdict(k) == ["1 of 3 dropped clients not back within 10 s"]


def test_a_job_never_final_or_failed_is_lost_and_a_client_back_late_fails_the_level():
    jobs = {"done": "completed", "stuck": "resuming", "failed": "failed", "unseen": None}
    k = kill_one.summarize([["a", KILL, KILL + 12.5]], jobs, KILL)
    assert (k["jobs"], k["jobs_lost"], k["late"]) == (4, 3, 1)
    assert kill_one.verdict(k) == ["1 of 1 dropped clients not back within 10 s", "3 of 4 jobs lost"]
    assert not passed(level([["a", KILL, KILL + 12.5]], jobs), 200)[0]


def test_calls_and_errors_during_the_kill_are_reported_not_gated():
    slow = {"n": 5, "p50": 3000.0, "p99": 8000.0, "max": 8000.0}
    fast = {"n": 50, "p50": 10.0, "p99": 50.0, "max": 60.0}
    lat = {"socket.io heartbeat": fast, "socket.io heartbeat" + kill_one.DURING: slow}
    ok, why = passed(level([["a", KILL, KILL + 2]], {"j": "completed"}, lat,
                           {"POST /events (metrics)" + kill_one.DURING: 3}), 200)
    assert ok, why
    assert not passed(level([["a", KILL, KILL + 2]], {"j": "completed"}, {"socket.io heartbeat": slow}), 200)[0]
    assert not passed(level([["a", KILL, KILL + 2]], {"j": "completed"}, lat, {"POST /jobs": 1}), 200)[0]
    # a call overlaps the kill's span when it ends after the kill and starts before the span ends
    assert kill_one.during(KILL, KILL - 1, KILL + 0.5) and kill_one.during(KILL, KILL + 9, KILL + 20)
    assert not kill_one.during(KILL, KILL - 2, KILL - 1) and not kill_one.during(None, KILL, KILL)


def test_a_kill_that_dropped_no_client_does_not_pass():
    assert not passed(level([], {"j": "completed"}), 200)[0]


def test_a_load_generator_files_errors_by_when_their_call_ran(monkeypatch):
    rec = Recorder()
    rec.t0, rec.t1, rec.kill_time = KILL - 5, KILL + 20, KILL
    for now, started in ((KILL - 2, KILL - 3), (KILL + 3, KILL - 0.5), (KILL + 15, KILL + 11), (KILL + 40, KILL + 39)):
        monkeypatch.setattr("recorder.time.time", lambda now=now: now)
        rec.error("POST /jobs", RuntimeError("HTTP 502"), started)
    assert rec.errors == {"POST /jobs": 2, "POST /jobs" + kill_one.DURING: 1, "POST /jobs" + kill_one.AFTER: 1}
    assert not passed(level([["a", KILL, KILL + 2]], {"j": "completed"}, errors=rec.errors), 200)[0]
    del rec.errors["POST /jobs"]  # what is left (the kill's span, after the window) is shown, not gated
    assert passed(level([["a", KILL, KILL + 2]], {"j": "completed"}, errors=rec.errors), 200)[0]
    rec.kill_time = None  # without a kill, what comes after the window is not kept
    rec.error("POST /jobs", RuntimeError("HTTP 502"), KILL + 39)
    assert "POST /jobs" not in rec.errors
