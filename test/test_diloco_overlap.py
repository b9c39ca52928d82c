"""DILOCO's overlapped rounds (``diloco={"overlap": True}``): two workers (gpu_client.rank.strategies.diloco, as a
rank runs them) against the server app served on a loopback port, each with a model of one
weight vector that the test moves by known amounts in place of training. A worker's sync point
returns before the others have uploaded; each average is applied one round late, on top of the
worker's own progress; the last round is waited for, so both end on the same global weights."""
from __future__ import annotations

import threading
import types

import pytest
import torch
from werkzeug.serving import make_server

from gpu_client.rank.strategies.diloco import Diloco
from gpu_client.rank.reporter import Reporter
from test_diloco import placed
from zwdx.protocol.spec import Diloco as DilocoSpec


@pytest.fixture
def served(app):
    """The app behind a real HTTP server on a free loopback port."""
    httpd = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()


class Vector(torch.nn.Module):
    def __init__(self, values):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(values, dtype=torch.float32))


class Checkpoints:
    """What ``attach`` needs of the job's checkpointer: somewhere to register the worker's state."""
    def track(self, obj, name):
        self.tracked = (obj, name)


def workers(app, url: str, **settings) -> list[tuple[Diloco, Vector]]:
    _, ranks, job = placed(app, compression="none", **settings)
    out = []
    for rank, api in enumerate(ranks):
        spec = types.SimpleNamespace(rank=rank, world_size=2, collective_timeout=30.0, joining=False,
                                     diloco=DilocoSpec.model_validate(job["spec"]["strategy"]))
        reporter = Reporter(url, api.rank_key, job["id"], rank)
        model = Vector([1.0, 2.0, 3.0])
        worker = Diloco(spec, reporter)
        worker.attach(model, Checkpoints())
        worker._hook.remove()  # the test calls sync() itself (the hook is the process's: it would count both workers' steps)
        out.append((worker, model))
    return out


def train(worker: Diloco, model: Vector, by: list[float]) -> None:
    """In place of H inner steps: the worker's weights move by ``by``."""
    with torch.no_grad():
        model.w += torch.tensor(by)
    worker.steps = worker.settings.inner_steps


def test_an_overlapped_round_applies_its_average_one_round_late_on_top_of_each_workers_progress(app, served):
    (a, ma), (b, mb) = workers(app, served, outer_lr=1.0, outer_momentum=0.0, overlap=True, inner_steps=3,
                                       all_reduce=False)
    w0 = torch.tensor([1.0, 2.0, 3.0])
    d0 = [torch.tensor([1.0, 0.0, -1.0]), torch.tensor([3.0, 2.0, 1.0])]
    d1 = [torch.tensor([0.5, 0.5, 0.5]), torch.tensor([-0.5, 1.5, 0.5])]
    try:
        train(a, ma, d0[0].tolist())
        a.sync()  # round 0 travels; a does not wait for b's upload
        assert a.pending is not None and a.round == 1
        assert torch.equal(ma.w.detach(), w0 + d0[0])  # its own progress, untouched
        train(b, mb, d0[1].tolist())
        b.sync()

        train(a, ma, d1[0].tolist())
        train(b, mb, d1[1].tolist())
        a.sync()  # round 0's average now: global = w0 + mean(d0), and a keeps its round-1 progress
        b.sync()
        mean0 = (d0[0] + d0[1]) / 2
        assert torch.equal(a.global_.detach(), w0 + mean0) and torch.equal(b.global_.detach(), w0 + mean0)
        assert torch.equal(ma.w.detach(), w0 + mean0 + d1[0])
        assert torch.equal(mb.w.detach(), w0 + mean0 + d1[1])

        done = [threading.Thread(target=w.trained) for w in (a, b)]  # the last round is waited for
        for t in done:
            t.start()
        for t in done:
            t.join(60)
        final = w0 + mean0 + (d1[0] + d1[1]) / 2
        assert torch.equal(ma.w.detach(), final) and torch.equal(mb.w.detach(), final)
        assert a.left and b.left and a.pending is None
    finally:
        for w in (a, b):
            w.reporter.close()


def test_without_overlap_a_worker_waits_for_the_rounds_average(app, served):
    (a, ma), (b, mb) = workers(app, served, outer_lr=1.0, outer_momentum=0.0, inner_steps=3, round_timeout=30,
                                       all_reduce=False)
    train(a, ma, [1.0, 1.0, 1.0])
    synced = threading.Thread(target=a.sync)
    synced.start()
    synced.join(1.0)
    assert synced.is_alive()  # waiting for b
    train(b, mb, [3.0, 3.0, 3.0])
    b.sync()
    synced.join(30)
    assert torch.equal(ma.w.detach(), torch.tensor([3.0, 4.0, 5.0])) and torch.equal(mb.w.detach(), ma.w.detach())
    for w in (a, b):
        w.reporter.close()


def test_overlap_is_off_unless_asked_and_must_be_a_boolean(api):
    assert api.submit(parallelism="DILOCO").json["spec"]["strategy"]["overlap"] is False
    assert api.submit(parallelism="DILOCO", diloco={"overlap": True}).json["spec"]["strategy"]["overlap"] is True
    api.refused("diloco.overlap", parallelism="DILOCO", diloco={"overlap": "yes"})


def test_a_worker_joining_an_overlapped_job_ends_on_the_same_global_weights(app, served):
    from zwdx.protocol import SlotKind
    from zwdx.protocol.job import PlacementEntry
    from zwdx.server.jobs import lifecycle
    from zwdx.server.auth import hash_secret
    from zwdx.server.jobs import Job
    (a, ma), (b, mb) = workers(app, served, outer_lr=0.5, outer_momentum=0.5, overlap=True, inner_steps=3,
                               all_reduce=False)
    ctx, job_id = app.extensions["zwdx"], a.reporter.job_id
    for w in (a, b):
        w.reporter.session.post(f"{w.reporter.base}/ranks/{w.spec.rank}", json={"status": "running"}).raise_for_status()
    for n in range(2):
        for w, m in ((a, ma), (b, mb)):
            train(w, m, [0.25 * (n + 1), -0.5, 1.0] if w is a else [1.0, 0.5, -0.25 * n])
            w.sync()
    lifecycle.client_lost(ctx, f"gpu-{job_id}-1", "staged")
    b.reporter.close()
    room = ctx.store.get_job(job_id).room_id
    ctx.store.upsert_client({"id": "late", "room_id": room, "hostname": "late", "status": "online"},
                            [{"id": "late:0", "client_id": "late", "room_id": room, "index": 0, "kind": "cpu"}])
    assert Job.load(ctx.store, job_id).join(PlacementEntry(rank=1, client_id="late", gpu_index=0, kind=SlotKind.CPU),
                                            "late:0", hash_secret("rk_late_overlap"))
    spec = types.SimpleNamespace(rank=1, world_size=2, collective_timeout=30.0, joining=True, diloco=a.settings)
    joiner, mj = Diloco(spec, Reporter(served, "rk_late_overlap", job_id, 1)), Vector([0.0, 0.0, 0.0])
    joiner.reporter.session.post(f"{joiner.reporter.base}/ranks/1", json={"status": "running"}).raise_for_status()
    attached = threading.Thread(target=joiner.attach, args=(mj, Checkpoints()))
    attached.start()  # it waits for the global weights
    try:
        train(a, ma, [0.5, 0.5, 0.5])
        a.sync()  # round 2: the server names rank 0 to send the weights after round 2's average
        train(a, ma, [0.5, 0.5, 0.5])
        a.sync()  # round 3: round 2's average applied, the weights sent (state 3); the joiner uploads from 4
        attached.join(30)
        assert not attached.is_alive() and joiner.round == 4 and joiner.pending is not None
        joiner._hook.remove()
        assert torch.equal(joiner.global_.detach(), a.global_.detach()) and torch.equal(mj.w.detach(), a.global_.detach())
        assert torch.equal(joiner.outer.state[joiner.global_]["momentum_buffer"], a.outer.state[a.global_]["momentum_buffer"])
        train(a, ma, [0.25, 0.0, 0.0])
        train(joiner, mj, [0.0, 0.25, 0.0])
        a.sync()  # round 4 waits for both
        joiner.sync()
        assert torch.equal(joiner.global_.detach(), a.global_.detach())  # both applied round 3's average
        done = [threading.Thread(target=w.trained) for w in (a, joiner)]
        for t in done:
            t.start()
        for t in done:
            t.join(60)
        assert torch.equal(ma.w.detach(), mj.w.detach()) and a.left and joiner.left
    finally:
        for w in (a, joiner):
            w.reporter.close()
