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


def test_a_joining_worker_takes_the_servers_global_weights(app):
    from zwdx.protocol import SlotKind
    from zwdx.protocol.job import PlacementEntry
    from zwdx.server.jobs import lifecycle
    from zwdx.server.auth import hash_secret
    from zwdx.server.jobs import Job
    net = model()
    room, (r0, r1), job = placed(app, start_weights.encode(net), world_size=2)
    ctx, url = app.extensions["zwdx"], f"/jobs/{job['id']}/diloco"
    weights = torch.nn.Parameter(flat(net).clone())
    sgd = torch.optim.SGD([weights], lr=0.7, momentum=0.9, nesterov=True)  # the settings' defaults

    def stepped(n: int) -> None:  # an honest worker's global weights after round n
        weights.grad = torch.from_numpy(codec.decode(r0.get(f"{url}/rounds/{n}").data))
        sgd.step()

    vectors = [0.01 * v for v in honest(2, weights.numel(), seed=0)]
    put(r0, job, 0, vectors[0])
    put(r1, job, 0, vectors[1])
    stepped(0)
    lifecycle.client_lost(ctx, f"gpu-{job['id']}-1", "staged")
    ctx.store.upsert_client({"id": "late", "room_id": room.room["id"], "hostname": "late", "status": "online"},
                            [{"id": "late:0", "client_id": "late", "room_id": room.room["id"], "index": 0, "kind": "cpu"}])
    entry = PlacementEntry(rank=1, client_id="late", gpu_index=0, kind=SlotKind.CPU)
    assert Job.load(ctx.store, job["id"]).join(entry, "late:0", hash_secret("rk_late"))
    joiner = r1.as_(None, rank_key="rk_late")
    assert joiner.post(f"/jobs/{job['id']}/ranks/1", json={"status": "running"}).json["ok"]
    assert joiner.get(f"{url}/state").status_code == 202

    put(r0, job, 1, 0.01 * honest(1, weights.numel(), seed=1)[0])  # round 1: rank 0 alone
    stepped(1)
    got = joiner.get(f"{url}/state")
    assert got.status_code == 200, got.json  # the server's, at once: no worker was asked
    state = safetensors.numpy.load(got.data)
    assert np.array_equal(state["global"], weights.detach().numpy())  # to the bit
    assert np.array_equal(state["momentum"], sgd.state[weights]["momentum_buffer"].numpy())
    after = room.get(f"/jobs/{job['id']}").json
    assert after["joins"]["1"]["round"] == 2 and after["joins"]["1"].get("state_from") is None
    forged = safetensors.numpy.save({"global": state["global"] + 1}, metadata={"round": "2"})
    assert r0.put(f"{url}/state/2", data=forged).status_code == 409  # no one waits for a worker's word
    assert joiner.get(f"{url}/state").data == got.data
    logs = [e["data"]["text"] for e in room.get(f"/jobs/{job['id']}/events").json["events"] if e["kind"] == "log"]
    assert any("rank(s) 1 joined: from the server's own global weights after round 1, uploading from round 2" in t
               for t in logs), logs
    put(r0, job, 2, vectors[0])
    put(joiner, job, 2, vectors[1])  # from round 2 on, the rounds wait for it again
    assert codec.decode(joiner.get(f"{url}/rounds/2").data).size == weights.numel()


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
            w.pending._thread.join(30)  # round 1 averaged before the loss: the joiner joins after round 2
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
        attached.start()  # it waits for the global weights
        train(a, ma, [0.5, 0.5, 0.5])
        a.sync()  # round 2, averaged with rank 0 alone: the server writes its global weights after it
        train(a, ma, [0.5, 0.5, 0.5])
        a.sync()  # round 3: rank 0 applies round 2's average; the joiner uploads from round 4
        attached.join(30)
        assert not attached.is_alive() and joiner.round == 4 and joiner.pending is not None
        joiner._hook.remove()
        assert torch.equal(joiner.global_.detach(), a.global_.detach())
        assert torch.equal(joiner.outer.state[joiner.global_]["momentum_buffer"], a.outer.state[a.global_]["momentum_buffer"])
        assert room.get(f"/jobs/{job['id']}").json["joins"]["1"].get("state_from") is None
        assert not a.state_for  # no worker was named to send them
    finally:
        for w in (a, b, joiner):
            if w is not None:
                w.reporter.close()
        httpd.shutdown()
