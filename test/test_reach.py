"""Choosing for the user (issue 14, item 4), in-process: the link measurement's endpoint (a
donor token only, capped, rate-limited), the figures a GPU client registers with shown in the
room's client list and in /metrics, and the scheduler's placement keeping DDP/FSDP jobs off
GPU clients known not to reach each other (DILOCO goes anywhere). Across real network
namespaces: test_reach_netns.py."""
from __future__ import annotations

import platform
import time

import pytest

from test_prometheus import scrape, value
from zwdx import defaults
from zwdx.server.placement import plan, unschedulable

H = defaults.TOKEN_HEADER
LINK = {"rtt": 0.012, "up": 12.5e6, "down": 117e6, "measured_at": 1.7e9}


def hello(client_id: str, **fields) -> dict:
    return {"client_id": client_id, "hostname": f"host-{client_id}", "versions": {"python": platform.python_version()},
            "slots": [{"index": 0, "kind": "cpu", "memory_total": 1 << 30, "memory_free": 1 << 30}], **fields}


def test_the_link_endpoint_takes_a_donor_token_caps_its_bytes_and_is_rate_limited(make_app):
    app = make_app(RATE_LIMIT_LINK="6 per minute")
    client = app.test_client()
    room = client.post("/api/v1/rooms", json={"name": "r"}).json
    donor = {H: room["donor_token"]}
    url = f"{defaults.API_PREFIX}/link"
    down = client.get(f"{url}?bytes=100000", headers=donor)
    assert down.status_code == 200 and len(down.data) == 100000
    assert client.get(f"{url}?bytes=0", headers=donor).data == b""
    up = client.post(url, data=b"x" * 70000, headers=donor)
    assert up.status_code == 200 and up.json == {"bytes": 70000}
    too_many = client.get(f"{url}?bytes={defaults.LINK_PROBE_MAX_BYTES + 1}", headers=donor)
    assert too_many.status_code == 400 and too_many.json["error"]["field"] == "bytes"
    too_large = client.post(url, data=b"x" * (defaults.LINK_PROBE_MAX_BYTES + 1), headers=donor)
    assert too_large.status_code == 413
    submitter = client.get(f"{url}?bytes=10", headers={H: room["submitter_token"]})
    assert submitter.status_code == 403 and "submitter token" in submitter.json["error"]["message"]
    limited = client.get(f"{url}?bytes=10", headers=donor)  # the 7th in the minute, whichever the answers
    assert limited.status_code == 429 and "link measurements" in limited.json["error"]["message"]


def test_registered_link_and_reach_port_show_in_the_room_and_in_metrics(api, socket_client):
    gpu = socket_client("/gpu", api.donor)
    assert gpu.emit("register", hello("c1", link=LINK, reach_port=40123), namespace="/gpu", callback=True)["ok"]
    wrong = gpu.emit("register", hello("c1", link={**LINK, "rtt": -1}), namespace="/gpu", callback=True)
    assert wrong["ok"] is False and "link.rtt" in wrong["error"]
    client = api.get("/room").json["clients"][0]
    assert client["link"] == LINK and client["reach_port"] == 40123 and client["unreachable"] == []
    # a register that did not measure again (a reconnect within LINK_REFRESH) keeps the figures
    assert gpu.emit("register", hello("c1", reach_port=40123), namespace="/gpu", callback=True)["ok"]
    assert api.get("/room").json["clients"][0]["link"] == LINK
    other = socket_client("/gpu", api.donor)
    assert other.emit("register", hello("c2"), namespace="/gpu", callback=True)["ok"]  # an older client: no figures
    samples = scrape(api.client)
    room = api.room["id"]
    assert value(samples, "zwdx_client_link_rtt_seconds", room=room, client="c1") == pytest.approx(0.012)
    assert value(samples, "zwdx_client_link_bytes_per_second", room=room, client="c1", direction="up") == 12.5e6
    assert value(samples, "zwdx_client_link_bytes_per_second", room=room, client="c1", direction="down") == 117e6
    assert "c2" not in {dict(k).get("client") for k in samples.get("zwdx_client_link_rtt_seconds", {})}


# -- placement ------------------------------------------------------------------------------------
def client(cid: str, unreachable: dict | None = None) -> dict:
    return {"id": cid, "hostname": f"host-{cid}", "status": "online", "versions": {"python": "3.11.7"},
            "modules": None, "unreachable": [{"client_id": p, "until": t} for p, t in (unreachable or {}).items()],
            "slots": [{"id": f"{cid}:0", "client_id": cid, "index": 0, "kind": "cpu", "job_id": None,
                       "memory_total": 1 << 30, "memory_free": 1 << 30}]}


def job(parallelism: str, world_size: int) -> dict:
    return {"status": "queued", "spec": {"parallelism": parallelism, "world_size": world_size,
                                         "versions": {"python": "3.11.7"}}}


def placed(chosen) -> list[str]:
    return [s["client_id"] for s in chosen] if chosen else []


def test_ddp_and_fsdp_are_placed_only_among_clients_that_reach_each_other():
    now = time.time()
    clients = {c["id"]: c for c in (client("a", {"b": now + 60}), client("b", {"a": now + 60}), client("c"))}
    slots = [s for c in clients.values() for s in c["slots"]]
    for parallelism in ("DDP", "FSDP"):
        chosen, _ = plan(job(parallelism, 2), slots, clients, now=now)
        assert placed(chosen) in (["a", "c"], ["b", "c"]), parallelism  # never a with b
        chosen, reason = plan(job(parallelism, 3), slots, clients, now=now)
        assert chosen is None and "gpu clients a (host host-a) and b (host host-b) cannot reach each other" in \
            reason and "DILOCO" in reason, reason
    chosen, _ = plan(job("DILOCO", 3), slots, clients, now=now)
    assert placed(chosen) == ["a", "b", "c"]  # through the server: anywhere
    chosen, _ = plan(job("DDP", 3), slots, clients, now=now + 61)  # the pair expired
    assert placed(chosen) == ["a", "b", "c"]
    assert unschedulable(job("DDP", 2)["spec"], list(clients.values())) is None


def test_a_job_whose_clients_cannot_meet_is_placed_again_once_without_the_pair(app, api, socket_client):
    from zwdx.protocol import SlotKind
    from zwdx.protocol.job import Master, PlacementEntry
    from zwdx.server.jobs import Job
    store = app.extensions["zwdx"].store
    socks = {}
    for cid in ("a", "b", "c"):
        socks[cid] = socket_client("/gpu", api.donor)
        assert socks[cid].emit("register", hello(cid, reach_port=40000), namespace="/gpu", callback=True)["ok"]
    job_id = api.submit(world_size=2, parallelism="DDP").json["id"]

    def place(on: tuple[str, str]) -> None:
        placement = [PlacementEntry(rank=r, client_id=cid, hostname=f"host-{cid}", gpu_index=0, kind=SlotKind.CPU)
                     for r, cid in enumerate(on)]
        handle = Job.load(store, job_id)
        assert handle.start(placement, [f"{cid}:0" for cid in on], {0: "h0", 1: "h1"})
        assert handle.rendezvous(Master(addr="127.0.0.1", port=29500))

    def report(by: str, peer: str, attempt: int) -> dict:
        return socks[by].emit("unreachable", {"job_id": job_id, "attempt": attempt, "peers": {peer: "no route to host"}},
                              namespace="/gpu", callback=True)

    place(("a", "b"))
    assert report("a", "b", 0) == {"ok": True}
    job = store.get_job(job_id)
    assert job.status == "resuming" and "a (host host-a) and b (host host-b) cannot reach each other" in \
        job.restart_history[0].reason and "placing the job again without the pair" in job.restart_history[0].reason
    store.release_slots(job_id)  # the GPU clients said its ranks exited
    clients = {c["id"]: c for c in store.list_clients(api.room["id"])}
    chosen, _ = plan({"spec": job.spec.model_dump(mode="json"), "status": "resuming", "world_size": 2},
                     [s for c in clients.values() for s in c["slots"]], clients)
    assert {s["client_id"] for s in chosen} in ({"a", "c"}, {"b", "c"})
    place(("a", "c"))  # and a cannot reach c either: no second time, the job fails naming the pair
    assert report("a", "c", 1) == {"ok": True}
    job = store.get_job(job_id)
    assert job.status == "failed" and "gpu clients a (host host-a) and c (host host-c)" in job.reason
    assert 'parallelism="DILOCO"' in job.reason
    assert {c["id"]: c["unreachable"] for c in api.get("/room").json["clients"]} == \
        {"a": ["b", "c"], "b": ["a"], "c": ["a"]}
