"""A worker that joins a running DILOCO job starts from the server's own global weights (issue
33), not from another worker's word: where the server holds them (the submitter's start weights
stepped with every round's aggregate), it writes them for the joiner after the round it joins at;
a worker's offer of its own is not taken. In-process; with processes: test_diloco_elastic.py."""
from __future__ import annotations

import numpy as np
import safetensors.numpy
import torch

from test_robust import honest
from test_trust_global import flat, model, placed, put
from zwdx import codec, start_weights

torch.set_num_threads(1)


def joining(app, room, job, rank: int, key: str):
    """Rank ``rank``'s GPU client lost, a new one placed in its place (the scheduler's
    ``join_workers`` does this with a slot it chose); the joiner's Api."""
    from zwdx.protocol import SlotKind
    from zwdx.protocol.job import PlacementEntry
    from zwdx.server.auth import hash_secret
    from zwdx.server.jobs import Job, lifecycle
    ctx = app.extensions["zwdx"]
    lifecycle.client_lost(ctx, f"gpu-{job['id']}-{rank}", "staged")
    ctx.store.upsert_client({"id": "late", "room_id": room.room["id"], "hostname": "late", "status": "online"},
                            [{"id": "late:0", "client_id": "late", "room_id": room.room["id"], "index": 0, "kind": "cpu"}])
    entry = PlacementEntry(rank=rank, client_id="late", gpu_index=0, kind=SlotKind.CPU)
    assert Job.load(ctx.store, job["id"]).join(entry, "late:0", hash_secret(key))
    joiner = room.as_(None, rank_key=key)
    assert joiner.post(f"/jobs/{job['id']}/ranks/{rank}", json={"status": "running"}).json["ok"]
    return joiner


def logged(room, job) -> list[str]:
    return [e["data"]["text"] for e in room.get(f"/jobs/{job['id']}/events").json["events"] if e["kind"] == "log"]


def test_a_joiner_waiting_for_a_round_takes_the_servers_global_weights_after_it(app):
    net = model()
    room, (r0, r1), job = placed(app, start_weights.encode(net), world_size=2)
    url = f"/jobs/{job['id']}/diloco"
    weights = torch.nn.Parameter(flat(net).clone())
    sgd = torch.optim.SGD([weights], lr=0.7, momentum=0.9, nesterov=True)  # the settings' defaults
    vectors = [0.01 * v for v in honest(2, weights.numel(), seed=0)]
    put(r0, job, 0, vectors[0])
    joiner = joining(app, room, job, 1, "rk_late")  # before round 0 is averaged: it waits for it
    assert joiner.get(f"{url}/state").status_code == 202
    weights.grad = torch.from_numpy(codec.decode(r0.get(f"{url}/rounds/0").data))  # averaged now, rank 0 alone
    sgd.step()
    got = joiner.get(f"{url}/state")
    assert got.status_code == 200, got.json  # the server's, at once: no worker was asked
    state = safetensors.numpy.load(got.data)
    assert np.array_equal(state["global"], weights.detach().numpy())  # to the bit
    assert np.array_equal(state["momentum"], sgd.state[weights]["momentum_buffer"].numpy())
    after = room.get(f"/jobs/{job['id']}").json
    assert after["joins"]["1"]["round"] == 1 and after["joins"]["1"].get("state_from") is None
    assert any("rank(s) 1 joined: from the server's own global weights after round 0, uploading from round 1" in t
               for t in logged(room, job))
    put(r0, job, 1, vectors[0])
    put(joiner, job, 1, vectors[1])  # from round 1 on, the rounds wait for it
    assert codec.decode(joiner.get(f"{url}/rounds/1").data).size == weights.numel()


def test_a_workers_offer_of_the_global_weights_is_refused_where_the_server_holds_them(app):
    net = model()
    room, (r0, r1), job = placed(app, start_weights.encode(net), world_size=2)
    url = f"/jobs/{job['id']}/diloco"
    vectors = [0.01 * v for v in honest(2, flat(net).numel(), seed=0)]
    put(r0, job, 0, vectors[0])
    put(r1, job, 0, vectors[1])
    joiner = joining(app, room, job, 1, "rk_late")  # after round 0 was averaged
    forged = safetensors.numpy.save({"global": np.zeros(flat(net).numel(), np.float32)}, metadata={"round": "1"})
    before = [a["id"] for a in app.extensions["zwdx"].store.list_artifacts(job["id"])]
    refused = r0.put(f"{url}/state/1", data=forged)
    assert refused.status_code == 409 and "server's own" in refused.json["error"]["message"], refused.json
    assert [a["id"] for a in app.extensions["zwdx"].store.list_artifacts(job["id"])] == before
    got = joiner.get(f"{url}/state")  # the server's own after round 0, written as it asks
    assert got.status_code == 200 and not np.array_equal(safetensors.numpy.load(got.data)["global"], np.zeros(1))
    assert room.get(f"/jobs/{job['id']}").json["joins"]["1"]["round"] == 1


def test_a_worker_joining_an_overlapped_job_starts_from_the_servers_weights_and_agrees_to_the_bit(app):
    """Two real DILOCO workers (``test_diloco_overlap``'s, moved by known amounts in place of
    training) and a joiner, overlapped, the job submitted with start weights: the joiner's global
    weights and momentum are the server's, and they are its peer's to the bit (numpy's outer step
    is torch's), though no worker sent them."""
    import threading
    import types

    from werkzeug.serving import make_server

    from gpu_client.rank.reporter import Reporter
    from gpu_client.rank.strategies.diloco import Diloco
    from test_diloco_overlap import Checkpoints, Vector, train
    from zwdx.protocol import SlotKind
    from zwdx.protocol.job import PlacementEntry
    from zwdx.protocol.spec import Diloco as DilocoSpec
    from zwdx.server.auth import hash_secret
    from zwdx.server.jobs import Job, lifecycle
    httpd = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url, ctx = f"http://127.0.0.1:{httpd.server_port}", app.extensions["zwdx"]
    room, ranks, job = placed(app, start_weights.encode(Vector([1.0, 2.0, 3.0])), world_size=2, outer_lr=0.5,
                              outer_momentum=0.5, overlap=True, inner_steps=3, all_reduce=False)
    settings = DilocoSpec.model_validate(job["spec"]["strategy"])
    pairs = []
    for rank, api in enumerate(ranks):
        spec = types.SimpleNamespace(rank=rank, world_size=2, collective_timeout=30.0, joining=False, diloco=settings)
        worker, m = Diloco(spec, Reporter(url, api.rank_key, job["id"], rank)), Vector([1.0, 2.0, 3.0])
        worker.attach(m, Checkpoints())
        worker._hook.remove()
        pairs.append((worker, m))
    (a, ma), (b, mb) = pairs
    joiner = None
    try:
        for n in range(2):
            train(a, ma, [0.25 * (n + 1), -0.5, 1.0])
            a.sync()
            train(b, mb, [1.0, 0.5, -0.25 * n])
            b.sync()
        for w in (a, b):
            w.pending._thread.join(30)  # round 1 averaged before the loss
        lifecycle.client_lost(ctx, f"gpu-{job['id']}-1", "staged")
        ctx.store.upsert_client({"id": "late", "room_id": room.room["id"], "hostname": "late", "status": "online"},
                                [{"id": "late:0", "client_id": "late", "room_id": room.room["id"], "index": 0,
                                  "kind": "cpu"}])
        assert Job.load(ctx.store, job["id"]).join(PlacementEntry(rank=1, client_id="late", gpu_index=0,
                                                                  kind=SlotKind.CPU), "late:0", hash_secret("rk_j"))
        spec = types.SimpleNamespace(rank=1, world_size=2, collective_timeout=30.0, joining=True, diloco=settings)
        joiner, mj = Diloco(spec, Reporter(url, "rk_j", job["id"], 1)), Vector([0.0, 0.0, 0.0])
        joiner.reporter.session.post(f"{joiner.reporter.base}/ranks/1", json={"status": "running"}).raise_for_status()
        attached = threading.Thread(target=joiner.attach, args=(mj, Checkpoints()))
        attached.start()
        attached.join(30)  # at once: the server holds the global weights after round 1
        assert not attached.is_alive() and joiner.round == 3 and joiner.pending is not None
        joiner._hook.remove()
        train(a, ma, [0.5, 0.5, 0.5])
        a.sync()  # round 2: rank 0 applies round 1's average
        assert torch.equal(joiner.global_.detach(), a.global_.detach())
        assert torch.equal(joiner.outer.state[joiner.global_]["momentum_buffer"], a.outer.state[a.global_]["momentum_buffer"])
        assert room.get(f"/jobs/{job['id']}").json["joins"]["1"].get("state_from") is None
        assert not a.state_for  # no worker was named to send them
    finally:
        for w in (a, b, joiner):
            if w is not None:
                w.reporter.close()
        httpd.shutdown()
