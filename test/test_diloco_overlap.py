"""DILOCO's overlapped rounds (``diloco={"overlap": True}``): two workers (gpu_client.diloco, as a
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

from gpu_client.diloco import Diloco
from gpu_client.reporter import Reporter
from test_diloco import placed, submit
from zwdx.protocol.diloco import DilocoSettings


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
                                     diloco=DilocoSettings.model_validate(job["spec"]["diloco"]))
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
    assert submit(api, parallelism="DILOCO").json["spec"]["diloco"]["overlap"] is False
    assert submit(api, parallelism="DILOCO", diloco={"overlap": True}).json["spec"]["diloco"]["overlap"] is True
    before = api.jobs()
    resp = submit(api, parallelism="DILOCO", diloco={"overlap": "yes"})
    assert resp.status_code == 400 and resp.json["error"]["field"] == "diloco.overlap", resp.json
    assert api.jobs() == before
