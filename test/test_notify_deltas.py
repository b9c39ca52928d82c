"""A room's dashboards get its whole GPU-client list once, then only what changed (issue 35):
a room of thousands of clients where a few moved sends those few."""
from __future__ import annotations

import time

from zwdx.server import notify


def _register(socket_client, api, client_id: str):
    gpu = socket_client("/gpu", api.donor)
    answer = gpu.emit("register", {"client_id": client_id, "hostname": "h", "versions": {"python": "3.11.7"},
                                   "slots": [{"index": 0, "kind": "cpu", "memory_total": 10, "memory_free": 10}]},
                      namespace="/gpu", callback=True)
    assert answer["ok"], answer
    return gpu


def _pushes(ui) -> list[dict]:
    return [m["args"][0] for m in ui.get_received("/ui") if m["name"] == "clients_update"]


def test_a_push_carries_only_the_clients_that_changed_and_the_ids_of_those_gone(app, api, socket_client):
    ctx, room_id = app.extensions["zwdx"], api.room["id"]
    for name in ("c1", "c2", "c3"):
        _register(socket_client, api, name)
    ui = socket_client("/ui", api.token)
    assert [c["id"] for c in _pushes(ui)[0]["clients"]] == ["c1", "c2", "c3"]  # whole, on connect

    assert notify.push_clients(ctx, room_id)  # the room's first push is whole too
    whole = _pushes(ui)[-1]
    assert whole["full"] is True and len(whole["clients"]) == 3

    assert not notify.push_clients(ctx, room_id)  # nothing moved: nothing sent
    assert _pushes(ui) == []

    ctx.store.update_client("c2", {"hostname": "h2"})
    ctx.store.update_client("c3", {"last_seen": time.time() + 1})  # a heartbeat's step alone: not news
    assert notify.push_clients(ctx, room_id)
    delta = _pushes(ui)[-1]
    assert delta["full"] is False and delta["removed"] == []
    assert [(c["id"], c["hostname"]) for c in delta["clients"]] == [("c2", "h2")]

    ctx.store.update_client("c3", {"last_seen": time.time() + notify.LAST_SEEN_STEP + 1})  # seen 30 s on
    ctx.store.update_client("c1", {"status": "offline", "last_seen": 0.0})
    assert ctx.store.remove_clients(room_id, seen_before=1.0) == ["c1"]  # a room's retention, as sweeper.py does
    assert notify.push_clients(ctx, room_id)
    delta = _pushes(ui)[-1]
    assert delta["full"] is False and delta["removed"] == ["c1"]
    assert [c["id"] for c in delta["clients"]] == ["c3"]


def test_a_client_whose_only_news_is_its_heartbeat_is_sent_again_once_its_last_seen_is_a_step_old(app, api,
                                                                                                     socket_client):
    """Its last_seen is measured from the view the dashboards hold, not from the last push: in
    a room where another client changes at every push, an idle client beating every few seconds
    must not show 'last seen' growing for ever."""
    ctx, room_id = app.extensions["zwdx"], api.room["id"]
    _register(socket_client, api, "c1")
    _register(socket_client, api, "busy")
    ui = socket_client("/ui", api.token)
    assert notify.push_clients(ctx, room_id)  # whole
    _pushes(ui)
    start = time.time()
    sent_again = []
    for beat in range(1, 21):  # a heartbeat every 2 s of its clock, a push after each
        ctx.store.update_client("c1", {"last_seen": start + 2 * beat})
        ctx.store.update_client("busy", {"hostname": f"h{beat}"})  # news at every push
        assert notify.push_clients(ctx, room_id)
        sent_again += [beat for c in _pushes(ui)[-1]["clients"] if c["id"] == "c1"]
    assert sent_again == [15], sent_again  # 30 s after the view the dashboards hold, not never
