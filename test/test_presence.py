"""Presence (``zwdx/server/presence.py``): a GPU client's heartbeats stay in the memory of the
server process that holds its connection; the store is written when what matters changes, and
listings show the fresh figures. A client silent past its deadline is declared lost by its own
process. In process: the app and Flask-SocketIO's test client as the GPU client."""
from __future__ import annotations

import time

import pytest

from zwdx.protocol import ClientStatus

SLOT = {"index": 0, "kind": "cpu", "name": "CPU", "memory_total": 64_000, "memory_free": 64_000}
HELLO = {"client_id": "p1", "hostname": "h", "versions": {"python": "3.11.7"}, "slots": [SLOT]}


def call(sock, event, payload):
    return sock.emit(event, payload, namespace="/gpu", callback=True)


def beat(sock, free, utilization):
    return call(sock, "heartbeat", {"slots": [{"index": 0, "memory_free": free, "utilization": utilization}]})


def test_heartbeats_stay_in_the_process_and_listings_show_them(app, api, socket_client):
    ctx = app.extensions["zwdx"]
    gpu = socket_client("/gpu", api.donor)
    assert call(gpu, "register", HELLO)["ok"]
    stored = ctx.store.list_clients(api.room["id"])
    time.sleep(0.01)
    for n in range(5):
        assert beat(gpu, 63_500, n) == {"ok": True}
    ctx.presence.step()  # free memory moved by less than 1/64 of the total: nothing that matters
    assert ctx.store.list_clients(api.room["id"]) == stored  # not even its last seen
    (shown,) = api.get("/room").json["clients"]
    assert shown["last_seen"] > stored[0]["last_seen"]
    assert (shown["slots"][0]["memory_free"], shown["slots"][0]["utilization"]) == (63_500, 4)
    assert beat(gpu, 30_000, 90) == {"ok": True}  # a job took half its memory: placement must know
    ctx.presence.step()
    (written,) = ctx.store.list_clients(api.room["id"])
    assert written["slots"][0]["memory_free"] == 30_000 and written["last_seen"] > shown["last_seen"]
    assert written["status"] == ClientStatus.ONLINE.value and written["lost_after"] is None


def test_a_silent_client_is_declared_lost_by_its_own_process(app, api, socket_client):
    ctx = app.extensions["zwdx"]
    gpu = socket_client("/gpu", api.donor)
    assert call(gpu, "register", HELLO)["ok"]
    ctx.scheduler.reap_silent_clients()  # the store's reaper leaves a client a process holds alone
    assert ctx.store.get_client("p1")["status"] == ClientStatus.ONLINE.value
    ctx.presence.step(now=time.time() + float(app.config["CLIENT_TIMEOUT"]) + 1)
    assert ctx.store.get_client("p1")["status"] == ClientStatus.OFFLINE.value
    assert ctx.presence.held("p1") is None
    assert call(gpu, "heartbeat", {"slots": []})["ok"] is False  # told to register again
    assert call(gpu, "register", HELLO)["ok"] and ctx.store.get_client("p1")["status"] == ClientStatus.ONLINE.value


def test_a_client_the_store_no_longer_has_online_is_told_to_register_again(app, api, socket_client):
    ctx = app.extensions["zwdx"]
    gpu = socket_client("/gpu", api.donor)
    assert call(gpu, "register", HELLO)["ok"]
    ctx.store.update_client("p1", {"status": ClientStatus.OFFLINE.value})  # declared lost elsewhere
    assert beat(gpu, 1_000, 5) == {"ok": True}  # a material change: written at the next step, which finds it gone
    ctx.presence.step()
    assert ctx.presence.held("p1") is None
    assert call(gpu, "heartbeat", {"slots": []})["ok"] is False


def test_a_heartbeat_that_names_other_running_jobs_is_written_at_once(app, api, socket_client):
    ctx = app.extensions["zwdx"]
    gpu = socket_client("/gpu", api.donor)
    assert call(gpu, "register", HELLO)["ok"]
    assert call(gpu, "heartbeat", {"running": [{"job_id": "j1", "attempt": 0}]}) == {"ok": True}
    assert ctx.store.get_client("p1")["running_jobs"] == ["j1:0"]  # no step needed: placement judges by it
    assert call(gpu, "heartbeat", {"running": []}) == {"ok": True}
    assert ctx.store.get_client("p1")["running_jobs"] == []


@pytest.mark.app_config(CLIENT_TIMEOUT=0.5)
def test_an_app_without_its_scheduler_declares_no_silent_client_lost_by_itself(app, api, socket_client):
    ctx = app.extensions["zwdx"]  # SCHEDULER=False, as the in-process tests make their apps
    gpu = socket_client("/gpu", api.donor)
    assert call(gpu, "register", HELLO)["ok"]
    time.sleep(2.5)  # two steps of its loop past the client's deadline
    assert ctx.store.get_client("p1")["status"] == ClientStatus.ONLINE.value and ctx.presence.held("p1")
