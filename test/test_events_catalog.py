"""The Socket.IO events are documented beside the REST API: docs/events.md is generated from
zwdx/protocol/events.py and the payload types (``zwdx.protocol.catalog``), names every event,
and what the server pushes to dashboards is exactly the type the page names."""
from __future__ import annotations

import os
import subprocess
import sys

from conftest import placed_job
from zwdx.protocol import catalog, events
from zwdx.protocol.job import JobView
from zwdx.protocol.rest import ClientsUpdate, JobEvents

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_checked_in_page_is_what_the_module_makes():
    with open(catalog.PATH, encoding="utf-8") as fh:
        checked_in = fh.read()
    assert checked_in == catalog.render(), (
        f"docs/events.md differs from zwdx/protocol/catalog.py: run `{catalog.COMMAND}` and commit the file")


def test_check_fails_on_a_stale_page_and_says_how_to_regenerate(tmp_path):
    stale = tmp_path / "events.md"
    stale.write_text(catalog.render().replace("`RanksExited`", "`RanksGone`"))
    done = subprocess.run([sys.executable, "-m", "zwdx.protocol.catalog", "--check", "--path", str(stale)], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 1 and catalog.COMMAND in done.stderr


def test_every_event_is_in_the_catalog_once_with_its_namespace():
    names = {value for name, value in vars(events).items() if name.startswith("EV_")}
    listed = [e.name for e in catalog.EVENTS]
    assert sorted(listed) == sorted(names)
    page = catalog.render()
    for e in catalog.EVENTS:
        assert f"| `{e.name}` | `{e.namespace}` |" in page and f"### `{e.payload.__name__}`" in page
    ui = {e.name for e in catalog.EVENTS if e.namespace == events.UI_NAMESPACE}
    assert ui == {events.EV_JOB_UPDATE, events.EV_JOB_EVENTS, events.EV_CLIENTS_UPDATE}


def exactly(model, payload: dict) -> None:
    """``payload`` is a ``model`` and holds nothing the model does not declare."""
    assert model.model_validate(payload).model_dump(mode="json") == payload


def test_what_dashboards_receive_is_the_declared_type(app, api, socket_client):
    ui = socket_client("/ui", api.token)
    gpu = socket_client("/gpu", api.donor)
    answer = gpu.emit("register", {"client_id": "c1", "hostname": "h", "versions": {"python": "3.11.7"},
                                   "slots": [{"index": 0, "kind": "cpu", "memory_total": 10, "memory_free": 10}]},
                      namespace="/gpu", callback=True)
    assert answer["ok"], answer
    job = api.submit().json
    received = ui.get_received("/ui")
    updates = [m["args"][0] for m in received if m["name"] == events.EV_JOB_UPDATE]
    assert updates and updates[-1]["id"] == job["id"]
    for payload in updates:
        exactly(JobView, payload)
    clients = [m["args"][0] for m in received if m["name"] == events.EV_CLIENTS_UPDATE]
    assert clients and clients[0]["clients"] == []  # the room had no GPU client when the dashboard connected
    for payload in clients:
        exactly(ClientsUpdate, payload)


def test_the_events_a_rank_reports_reach_dashboards_as_job_events(app, socket_client):
    room, rank0, job = placed_job(app, "watched")
    ui = socket_client("/ui", room.token)
    resp = rank0.post(f"/jobs/{job['id']}/events", json={"events": [
        {"kind": "metric", "rank": 0, "key": "0:1", "step": 0, "data": {"loss": 1.5}, "ts": 1.0},
        {"kind": "log", "rank": 0, "key": "0:2", "data": {"text": "hello"}}]})
    assert resp.json == {"stored": 2}, resp.text
    pushed = [m["args"][0] for m in ui.get_received("/ui") if m["name"] == events.EV_JOB_EVENTS]
    assert len(pushed) == 1 and [e["seq"] for e in pushed[0]["events"]] == [1, 2]
    exactly(JobEvents, pushed[0])
    assert pushed[0]["events"][1]["data"] == {"text": "hello"}
