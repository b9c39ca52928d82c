"""GET /metrics as Prometheus reads it (its own text parser): jobs, queues, GPU clients, slots,
request latencies and job timings, labels without job ids; who may scrape."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import placed_job


def scrape(client, **kwargs) -> dict[str, dict[tuple, float]]:
    """name -> {labels as sorted (key, value) pairs: value} of one scrape (samples by their own name)."""
    resp = client.get("/metrics", **kwargs)
    assert resp.status_code == 200, resp.data
    assert resp.content_type.startswith("text/plain")
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(resp.data.decode()):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    """The sample of ``name`` whose labels include ``labels`` (0 when none has them)."""
    want = set(labels.items())
    found = [v for key, v in samples.get(name, {}).items() if want <= set(key)]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else 0.0


def test_jobs_queues_clients_and_slots_are_what_the_rooms_hold(app, api, socket_client):
    room_b = api.create_room("b")
    waiting = [api.submit(name=f"w{i}").json["id"] for i in range(2)]
    room_b.submit(name="b0")
    gpu = socket_client("/gpu", api.donor)
    answer = gpu.emit("register", {"client_id": "c1", "hostname": "h1", "versions": {"python": "3.11.7"},
                                   "slots": [{"index": 0, "kind": "cpu", "memory_total": 1000, "memory_free": 600,
                                              "utilization": 42.0},
                                             {"index": 1, "kind": "cpu", "memory_total": 1000, "memory_free": 900}]},
                      namespace="/gpu", callback=True)
    assert answer["ok"], answer
    placed_room, _, placed = placed_job(app, "placed")  # a room of its own, one busy slot of client gpu-placed

    samples = scrape(app.test_client())
    a, b, c = api.room["id"], room_b.room["id"], placed_room.room["id"]
    assert value(samples, "zwdx_jobs", room=a, status="queued") == 2
    assert value(samples, "zwdx_jobs", room=b, status="queued") == 1
    assert value(samples, "zwdx_jobs", room=c, status="starting") == 1
    assert value(samples, "zwdx_queue_depth", room=a) == 2 and value(samples, "zwdx_queue_depth", room=c) == 0
    assert value(samples, "zwdx_queue_oldest_wait_seconds", room=a) >= 0
    assert value(samples, "zwdx_gpu_clients", room=a, status="online") == 1
    assert value(samples, "zwdx_slots", room=a, state="free") == 2
    assert value(samples, "zwdx_slots", room=c, state="busy") == 1
    assert value(samples, "zwdx_slot_utilization_percent", room=a, client="c1", slot="0") == 42.0
    assert value(samples, "zwdx_slot_memory_free_bytes", room=a, client="c1", slot="1") == 900
    assert value(samples, "zwdx_slot_memory_total_bytes", room=a, client="c1", slot="0") == 1000
    assert value(samples, "zwdx_build_info") == 1

    # No label value is a job id (unbounded), and no token is anywhere in the answer.
    text = app.test_client().get("/metrics").data.decode()
    for job_id in [*waiting, placed["id"]]:
        assert job_id not in text
    for token in (api.token, api.donor, room_b.token):
        assert token not in text


def test_a_heartbeat_shows_at_the_next_scrape_and_the_process_says_what_it_holds(app, api, socket_client):
    gpu = socket_client("/gpu", api.donor)
    slot = {"index": 0, "kind": "cpu", "memory_total": 1000, "memory_free": 900, "utilization": 5.0}
    assert gpu.emit("register", {"client_id": "c1", "hostname": "h1", "versions": {"python": "3.11.7"},
                                 "slots": [slot]}, namespace="/gpu", callback=True)["ok"]
    assert gpu.emit("heartbeat", {"slots": [{"index": 0, "utilization": 77.0}]}, namespace="/gpu",
                    callback=True)["ok"]  # kept in the process's memory, not yet in the store
    _, rank, placed = placed_job(app, "events")
    assert rank.post(f"/jobs/{placed['id']}/events", json={"events": [
        {"kind": "metric", "step": 0, "data": {"loss": 1.0}}]}).status_code == 200
    samples = scrape(app.test_client())
    assert value(samples, "zwdx_slot_utilization_percent", room=api.room["id"], client="c1", slot="0") == 77.0
    assert value(samples, "zwdx_presence_clients") == 1
    assert value(samples, "zwdx_event_posts_total") == 1 and value(samples, "zwdx_event_writes_total") == 1


def test_requests_and_job_ends_are_counted_by_route_and_status(app, api):
    before = scrape(app.test_client())
    job = api.submit(name="to-cancel").json
    assert api.get(f"/jobs/{job['id']}").status_code == 200
    assert api.post(f"/jobs/{job['id']}/cancel").status_code == 200
    after = scrape(app.test_client())

    def grew(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    room = api.room["id"]
    assert grew("zwdx_jobs_ended_total", room=room, status="cancelled") == 1
    assert grew("zwdx_job_duration_seconds_count", status="cancelled") == 1
    # Latencies by the route's rule, never its path (no job id in a label).
    assert grew("zwdx_http_request_duration_seconds_count", method="GET", route="/api/v1/jobs/<job_id>",
                status="200") == 1
    assert grew("zwdx_http_request_duration_seconds_count", method="POST", route="/api/v1/jobs", status="201") == 1
    assert value(after, "zwdx_jobs", room=room, status="cancelled") == 1


def test_a_placed_job_records_how_long_it_waited(app):
    before = scrape(app.test_client())
    room, _, _ = placed_job(app, "waited")
    after = scrape(app.test_client())
    room_id = room.room["id"]
    assert value(after, "zwdx_job_wait_seconds_count", room=room_id) - \
        value(before, "zwdx_job_wait_seconds_count", room=room_id) == 1


def test_without_a_metrics_token_only_this_machine_may_scrape(client):
    assert client.get("/metrics").status_code == 200
    far = client.get("/metrics", environ_base={"REMOTE_ADDR": "203.0.113.9"})
    assert far.status_code == 403 and "metrics token" in far.json["error"]["message"]


@pytest.mark.app_config(METRICS_TOKEN="m3trics-secret")
def test_with_a_metrics_token_it_is_asked_of_everyone(client):
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    far = {"REMOTE_ADDR": "203.0.113.9"}
    ok = client.get("/metrics", headers={"Authorization": "Bearer m3trics-secret"}, environ_base=far)
    assert ok.status_code == 200 and b"zwdx_jobs" in ok.data
    assert b"m3trics-secret" not in ok.data


def test_the_grafana_dashboard_asks_only_for_metrics_the_server_exports(app, api):
    import json
    import pathlib
    import re
    placed_job(app, "for-the-dashboard")
    api.submit(name="waiting")
    exported = set()  # every series name a family declares, whether or not it has samples yet
    for line in app.test_client().get("/metrics").data.decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            name = name.removesuffix("_total")
            exported |= {"counter": {f"{name}_total"}, "histogram": {f"{name}_bucket", f"{name}_count",
                                                                      f"{name}_sum"}}.get(kind, {name})
    dashboard = json.loads((pathlib.Path(__file__).parent.parent / "docs" / "grafana-dashboard.json").read_text())
    asked = {name for panel in dashboard["panels"] for target in panel["targets"]
             for name in re.findall(r"\bzwdx_[a-z_]+", target["expr"])}
    assert asked and asked <= exported, asked - exported
