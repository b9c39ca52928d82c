"""A rank's reporter paces its posts: at most one batch of events per flush interval, however
often the training loop reports (a loop that reported every step posted after every step, on a
fast server faster than the server takes one rank's events: 429s, events held back; CI saw it)."""
from __future__ import annotations

import time
import types

from gpu_client.rank.reporter import Reporter


class CountingSession:
    def __init__(self):
        self.posts, self.events = [], 0

    def post(self, url, json=None, timeout=None):
        self.posts.append(time.monotonic())
        self.events += len((json or {}).get("events", []))
        return types.SimpleNamespace(status_code=200, text="", raise_for_status=lambda: None)


def test_a_tight_loop_of_metrics_goes_in_a_few_batches_and_every_event_arrives():
    reporter = Reporter("http://127.0.0.1:9", "rk_test", "job", 0, flush_interval=0.2)
    session = reporter.session = CountingSession()
    started = time.monotonic()
    sent = 0
    while time.monotonic() - started < 1.0:  # a fast training loop: a metric every millisecond
        reporter.log_metrics(loss=1.0 / (sent + 1))
        sent += 1
        time.sleep(0.001)
    assert reporter.flush(timeout=10)
    took = time.monotonic() - started
    reporter.close()
    assert session.events == sent
    # one batch per 0.2 s (and the first at once): a rank's pace stays far under the server's limit
    assert len(session.posts) <= took / 0.2 + 2, (len(session.posts), sent, took)
    gaps = [b - a for a, b in zip(session.posts, session.posts[1:])]
    assert all(gap >= 0.19 for gap in gaps), gaps
