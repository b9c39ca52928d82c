"""A worker joining a running DILOCO job, in-process: the scheduler places a free slot in a
dropped worker's place, the rounds do not wait for the joiner until the round it joins at, the
worker the server names sends the global weights (safetensors, checked by their header, never
unpickled) and the joiner fetches them. The whole of it with processes: test_diloco_elastic.py."""
from __future__ import annotations

import json
import platform

import numpy as np
import safetensors.numpy

from test_diloco import placed, put
from zwdx import codec


def state_bytes(n: int, numel: int, momentum: bool = True, **meta) -> bytes:
    tensors = {"global": np.arange(numel, dtype=np.float32)}
    if momentum:
        tensors["momentum"] = np.ones(numel, np.float32)
    return safetensors.numpy.save(tensors, metadata={"round": str(n), **meta})


def test_a_joining_worker_starts_from_the_global_weights_at_the_next_round(app):
    from zwdx.protocol.job import PlacementEntry
    from zwdx.protocol import SlotKind
    from zwdx.server.jobs import lifecycle
    from zwdx.server.auth import hash_secret
    from zwdx.server.jobs import Job, wanting
    room, (r0, r1), job = placed(app, compression="none")
    ctx, url = app.extensions["zwdx"], f"/jobs/{job['id']}/diloco"
    for rank, api in enumerate((r0, r1)):
        assert api.post(f"/jobs/{job['id']}/ranks/{rank}", json={"status": "running"}).json["ok"]
    assert put(r0, job, 0, [1.0, 1.0], "none").status_code == 201
    assert put(r1, job, 0, [3.0, 3.0], "none").json["ready"]
    lifecycle.client_lost(ctx, f"gpu-{job['id']}-1", "staged")
    assert wanting(ctx.store.get_job(job["id"])) == [1]

    # a new GPU client's slot in rank 1's place (the scheduler's join_workers does this with a slot plan() chose)
    ctx.store.upsert_client({"id": "late", "room_id": room.room["id"], "hostname": "late", "status": "online"},
                            [{"id": "late:0", "client_id": "late", "room_id": room.room["id"], "index": 0, "kind": "cpu"}])
    entry = PlacementEntry(rank=1, client_id="late", gpu_index=0, kind=SlotKind.CPU)
    assert Job.load(ctx.store, job["id"]).join(entry, "late:0", hash_secret("rk_late"))
    joiner = r1.as_(None, rank_key="rk_late")
    view = room.get(f"/jobs/{job['id']}").json
    assert "gpu client late joined as rank 1" in view["timeline"][-1]["reason"] and view["status"] == "running"
    assert view["joins"]["1"]["round"] is None and wanting(ctx.store.get_job(job["id"])) == []
    assert r1.get(f"{url}/state").status_code == 403  # the dropped worker's key is no longer rank 1's

    assert joiner.post(f"/jobs/{job['id']}/ranks/1", json={"status": "running"}).json["ok"]
    # round 1 does not wait for it; rank 0 is named to send the global weights after it
    first = put(r0, job, 1, [2.0, 2.0], "none").json
    assert first["ready"] and first["expected"] == [0] and first["state_from"] == 0
    assert joiner.get(f"{url}/state").status_code == 202

    before = [a["id"] for a in ctx.store.list_artifacts(job["id"])]
    for data, status in [(state_bytes(3, 2), 409),                      # not the state after the newest round
                         (b"\x80\x04 a pickle", 400),
                         (state_bytes(2, 3), 400),                      # not the model's size
                         (state_bytes(1, 2), 400),                      # metadata says another round
                         (safetensors.numpy.save({"global": np.ones(2, np.float64)}, metadata={"round": "2"}), 400)]:
        n = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])["__metadata__"]["round"] if data[:1] != b"\x80" else 2
        resp = r0.put(f"{url}/state/{2 if status == 400 else n}", data=data)
        assert resp.status_code == status, resp.json
    assert [a["id"] for a in ctx.store.list_artifacts(job["id"])] == before

    sent = state_bytes(2, 2)
    answer = r0.put(f"{url}/state/2", data=sent)
    assert answer.status_code == 201 and answer.json["expected"] == [0, 1], answer.json
    got = joiner.get(f"{url}/state")
    assert got.status_code == 200 and got.data == sent
    assert room.get(f"/jobs/{job['id']}").json["joins"]["1"] == {"client_id": "late", "placed_at": view["joins"]["1"][
        "placed_at"], "round": 2, "state_from": 0}
    assert r0.put(f"{url}/state/2", data=sent).status_code == 409  # no one waits any more
    logs = [e["data"]["text"] for e in room.get(f"/jobs/{job['id']}/events").json["events"] if e["kind"] == "log"]
    assert any("rank(s) 1 joined: from rank 0's global weights after round 1, uploading from round 2" in t
               for t in logs), logs

    # from round 2 on, the rounds wait for it again
    assert put(r0, job, 2, [1.0, 0.0], "none").json["waiting_for"] == [1]
    both = put(joiner, job, 2, [3.0, 2.0], "none").json
    assert both["ready"] and both["members"] == [0, 1]
    assert codec.decode(joiner.get(f"{url}/rounds/2").data).tolist() == [2.0, 1.0]


def test_the_scheduler_gives_a_dropped_workers_place_to_a_free_slot(app):
    from zwdx.server.jobs import lifecycle
    room, (r0, r1), job = placed(app, compression="none")
    ctx = app.extensions["zwdx"]
    for rank, api in enumerate((r0, r1)):
        assert api.post(f"/jobs/{job['id']}/ranks/{rank}", json={"status": "running"}).json["ok"]
    assert ctx.scheduler.join_workers() == 0  # nothing dropped
    lifecycle.client_lost(ctx, f"gpu-{job['id']}-0", "staged")
    assert ctx.scheduler.join_workers() == 0  # no free slot
    client = ctx.store.get_client(f"gpu-{job['id']}-0")
    ctx.store.upsert_client({**{k: client[k] for k in ("id", "room_id", "hostname")}, "status": "online",
                             "versions": {"python": platform.python_version()}},
                            [{"id": f"gpu-{job['id']}-0:0", "client_id": client["id"], "room_id": client["room_id"],
                              "index": 0, "kind": "cpu"}])
    assert ctx.scheduler.join_workers() == 1, ctx.store.get_job(job["id"]).waiting_reason
    after = room.get(f"/jobs/{job['id']}").json
    assert after["joins"]["0"]["client_id"] == client["id"] and after["restarts"] == 0
    assert [p["client_id"] for p in after["placement"]] == [client["id"], f"gpu-{job['id']}-1"]
    assert ctx.scheduler.join_workers() == 0  # placed once
