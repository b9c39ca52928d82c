"""``bench/control_plane.py --stalls``: a py-spy timeline of the server's main thread, read as
busy periods (runs of samples in which the gevent hub never got back to waiting for I/O), the
longest first with what ran in them. The timeline here is written as py-spy writes one
(speedscope, idle samples kept); the bench records it from a live server."""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

from control_plane import STALL_RATE, summarize_stalls  # noqa: E402

HUB = {"name": "Hub.run", "file": "/venv/site-packages/gevent/hub.py", "line": 647}
VIEW = {"name": "post_events", "file": "/src/zwdx/server/api.py", "line": 290}
STORE = {"name": "SQLiteStore.add_events", "file": "/src/zwdx/server/store/sqlite.py", "line": 341}
LIST = {"name": "SQLiteStore.list_clients", "file": "/src/zwdx/server/store/sqlite.py", "line": 153}
SCHED = {"name": "Scheduler.schedule_room", "file": "/src/zwdx/server/scheduler.py", "line": 229}
SLEEP = {"name": "_checkpoint_loop", "file": "/src/zwdx/server/store/sqlite_db.py", "line": 236}


def timeline(tmp_path, main: list[str]) -> str:
    frames = [HUB, VIEW, STORE, LIST, SCHED, SLEEP]
    stacks = {"idle": [0], "events": [1, 2], "listing": [4, 3]}
    doc = {"shared": {"frames": frames}, "profiles": [
        # another thread first, with as many samples, none of them in the hub
        {"type": "sampled", "name": "Thread 2", "samples": [[5]] * len(main), "weights": [0.004] * len(main)},
        {"type": "sampled", "name": "Thread 1", "samples": [stacks[s] for s in main],
         "weights": [0.004] * len(main)}]}
    path = tmp_path / "server.speedscope.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_the_longest_busy_periods_come_first_with_what_ran_in_them(tmp_path):
    main = ["idle"] * 5 + ["events"] * 2 + ["idle"] + ["listing"] * 30 + ["events"] * 3 + ["idle"] * 10 + ["events"]
    found = summarize_stalls(timeline(tmp_path, main))
    tick = 1000.0 / STALL_RATE
    assert found["samples"] == len(main) and found["periods"] == 3
    assert found["busy_share"] == (2 + 33 + 1) / len(main)
    ms, ran = found["longest"][0]
    assert ms == 33 * tick
    # innermost zwdx frame first, then its caller; the most samples first
    assert [tuple(r) for r in ran] == [
        ("SQLiteStore.list_clients (sqlite.py:153) < Scheduler.schedule_room (scheduler.py:229)", 30),
        ("SQLiteStore.add_events (sqlite.py:341) < post_events (api.py:290)", 3)]
    assert [p[0] for p in found["longest"]] == [33 * tick, 2 * tick, tick]
    assert dict(found["over_ms"])[100] == (1 if 33 * tick >= 100 else 0)


def test_a_missing_or_broken_timeline_is_no_figures(tmp_path):
    assert summarize_stalls(str(tmp_path / "none.json")) is None
    (tmp_path / "bad.json").write_text("{")
    assert summarize_stalls(str(tmp_path / "bad.json")) is None
