"""The group commit of ranks' events (``zwdx/server/batches.py``): requests that arrive while a
write is in progress go together in the next one, each is answered with its own events once
they are stored, every event is stored once, and one request's failure is its own."""
from __future__ import annotations

import threading
import time

import pytest

from zwdx.errors import StoreError
from zwdx.server.batches import EventWriter
from zwdx.server.store import open_store


@pytest.fixture
def store(tmp_path):
    opened = open_store(str(tmp_path), None)
    yield opened
    opened.close()


class SlowStore:
    """The embedded store, each write taking a while (as under a busy write lock)."""

    def __init__(self, store, pause=0.02, broken=()):
        self.store, self.pause, self.broken, self.sizes = store, pause, set(broken), []

    def add_event_batches(self, batches):
        time.sleep(self.pause)
        if self.broken & {job_id for job_id, _ in batches}:
            raise StoreError("this job's events cannot be written")
        self.sizes.append(len(batches))
        return self.store.add_event_batches(batches)


def metric(rank, key):
    return {"kind": "metric", "rank": rank, "key": key, "step": 0, "data": {"loss": 1.0}, "ts": 1.0}


def post_together(writer, posts):
    """Each (job id, events) from a thread of its own, all at once; job id -> the answers."""
    answers, errors, start = {}, {}, threading.Barrier(len(posts))

    def post(n, job_id, events):
        start.wait()
        try:
            answers[n] = writer.add(job_id, events)
        except StoreError as exc:
            errors[n] = exc
    threads = [threading.Thread(target=post, args=(n, *p)) for n, p in enumerate(posts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return answers, errors


def test_requests_that_come_during_a_write_are_written_together_and_stored_once(store):
    slow = SlowStore(store)
    writer = EventWriter(slow)
    # 40 ranks post at once; each batch is sent twice (a retry), once with a new event too
    posts = [(f"j{r % 4}", [metric(r, "a")]) for r in range(40)] + \
            [(f"j{r % 4}", [metric(r, "a"), metric(r, "b")]) for r in range(40)]
    answers, errors = post_together(writer, posts)
    assert not errors and len(answers) == 80
    assert writer.requests == 80 and writer.writes < 20, slow.sizes  # together, not one write a request
    assert sum(len(a) for a in answers.values()) == 80  # 40 "a" and 40 "b": each stored once
    for job in range(4):
        stored = store.get_events(f"j{job}")
        assert sorted((e["rank"], e["key"]) for e in stored) == \
            sorted((r, k) for r in range(job, 40, 4) for k in "ab")
        assert [e["seq"] for e in stored] == list(range(1, 21))


def test_a_failing_request_fails_alone_and_the_others_are_stored(store):
    writer = EventWriter(SlowStore(store, broken={"bad"}))
    answers, errors = post_together(writer, [("bad", [metric(0, "x")])] + [("ok", [metric(r, "x")]) for r in range(9)])
    assert len(errors) == 1 and isinstance(errors[0], StoreError)
    assert sorted(len(a) for a in answers.values()) == [1] * 9
    assert len(store.get_events("ok")) == 9 and store.get_events("bad") == []
    assert writer.add("ok", [metric(0, "y")])[0]["seq"] == 10  # the writer goes on
