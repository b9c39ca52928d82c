"""What follows a job's move (``zwdx.server.jobs.effects``): ``apply`` does what an ``Effects``
asks in one order (stop the placement's ranks, free slots, show the job, show the room's GPU
clients, wake the scheduler), so that whoever hears of a move sees its slots free."""
from __future__ import annotations

from types import SimpleNamespace

from store_backends import job_record
from zwdx.server.jobs import effects
from zwdx.server.jobs.effects import Effects, Release, apply, stopping


def fake_ctx(done: list):
    store = SimpleNamespace(release_slots=lambda job_id, client_id=None: done.append(("release", job_id, client_id)))
    scheduler = SimpleNamespace(kick=lambda settle=False: done.append(("kick", settle)))
    return SimpleNamespace(store=store, scheduler=scheduler)


def test_apply_stops_frees_shows_and_kicks_in_that_order(monkeypatch):
    done: list = []
    monkeypatch.setattr(effects, "tell_clients", lambda ctx, job, event, payload: done.append(("tell", job.id, event)))
    monkeypatch.setattr(effects.notify, "job_changed", lambda job: done.append(("show", job.id)))
    monkeypatch.setattr(effects.notify, "clients_changed",
                        lambda ctx, room, joined_or_left=False: done.append(("room", room, joined_or_left)))
    job = job_record("j1", "r1", "failed")
    apply(fake_ctx(done), Effects(stop=stopping(job, "cancelled"), release=(Release("j1", "c1"), Release("j1")),
                                  show=job, room="r1", kick=True))
    assert done == [("tell", "j1", "job_cancel"), ("release", "j1", "c1"), ("release", "j1", None), ("show", "j1"),
                    ("room", "r1", False), ("kick", False)]


def test_nothing_asked_does_nothing_and_settle_kicks_to_settle(monkeypatch):
    done: list = []
    apply(fake_ctx(done), Effects())
    assert done == []
    apply(fake_ctx(done), Effects(settle=True))
    assert done == [("kick", True)]


def test_a_stop_names_the_attempt_only_when_asked():
    job = job_record("j1", "r1", "starting")
    assert stopping(job, "why")[1].attempt is None
    assert stopping(job, "why", 3)[1].model_dump()["attempt"] == 3
