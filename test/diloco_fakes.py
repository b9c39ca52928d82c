"""The fakes the in-process tests of gpu_client/rank/strategies/diloco.py share
(test_mutants_diloco.py, test_mutants_diloco_rounds.py): a clock the test owns (``diloco.time``
replaced), a reporter whose ``session`` answers as a server of one worker would (or as told),
the checkpointer's ``track``, small models, a spec, and a worker made from them (``make``)."""
from __future__ import annotations

import hashlib
import json
import types

import numpy as np
import pytest
import requests
import torch

from gpu_client.rank.strategies import diloco as diloco_module
from gpu_client.rank.strategies.diloco import Diloco
from zwdx import codec, defaults
from zwdx.protocol.spec import Diloco as DilocoSpec

BASE = "http://srv/api/v1/jobs/j1"
ROUNDS = f"{BASE}/diloco/rounds"
#: A worker's upload with nothing to add.
EMPTY = codec.encode(np.zeros(0, np.float32), "none")


class Clock:
    """``diloco.time`` in the tests: time moves only when the worker sleeps or a request takes long."""

    def __init__(self):
        self.now, self.sleeps = 1000.0, []

    def time(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += self.step or seconds

    #: Seconds every sleep takes instead of those asked for (None: those asked for).
    step = None


def response(status=200, content=b"", headers=None, body=None):
    resp = requests.Response()
    resp.status_code, resp.url, resp.encoding = status, ROUNDS, "utf-8"
    resp._content = json.dumps(body).encode() if body is not None else content
    resp.headers.update(headers or {})
    return resp


def average_response(values, compression="none"):
    data = codec.encode(np.asarray(values, np.float32), compression)
    return response(200, data, {defaults.SHA256_HEADER: hashlib.sha256(data).hexdigest()})


class Server:
    """The reporter's session: a server of one worker (a round's average is its own upload) unless
    told the average (``averages``) or an answer (``queued``: (method, url) -> responses, served first).
    Every call is kept in ``calls``; each takes ``latency`` seconds of the clock."""

    def __init__(self, clock, latency=0.0):
        self.clock, self.latency = clock, latency
        self.calls, self.uploads, self.averages, self.queued = [], {}, {}, {}
        self.answer = {"dropped": []}
        self.during = None  # called inside every request (the training thread, say)

    def _call(self, method, url, kwargs):
        self.calls.append((method, url, kwargs))
        self.clock.now += self.latency
        if self.during:
            self.during()
        queue = self.queued.get((method, url))
        if queue:
            out = queue.pop(0)
            if isinstance(out, Exception):
                raise out
            return out
        n = int(url.rsplit("/", 1)[1]) if url.startswith(ROUNDS) else None
        if method == "put" and n is not None:
            self.uploads[n] = kwargs["data"]
            return response(200, body=self.answer)
        if method == "get" and n is not None:
            if n in self.averages:
                return average_response(self.averages[n])
            data = self.uploads[n]
            return response(200, data, {defaults.SHA256_HEADER: hashlib.sha256(data).hexdigest()})
        return response(200, body={})

    def put(self, url, **kwargs):
        return self._call("put", url, kwargs)

    def get(self, url, **kwargs):
        return self._call("get", url, kwargs)

    def urls(self):
        return [(m, u) for m, u, _ in self.calls]


class Reporter:
    def __init__(self, session, patience=5.0):
        self.session, self.base, self.patience = session, BASE, patience
        self.logs, self.system, self.outer_step = [], [], None

    def log(self, text):
        self.logs.append(text)

    def log_system(self, **values):
        self.system.append(values)


class Checkpoints:
    def __init__(self):
        self.tracked = []

    def track(self, obj, name):
        self.tracked.append((obj, name))


class Vector(torch.nn.Module):
    def __init__(self, *values):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(values, dtype=torch.float32))


class Three(torch.nn.Module):
    """Three parameters of different shapes and a buffer."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        self.b = torch.nn.Parameter(torch.tensor([5.0]))
        self.c = torch.nn.Parameter(torch.tensor([6.0, 7.0]))
        self.register_buffer("seen", torch.tensor([7.0, 8.0]))


def make_spec(rank=0, world_size=1, joining=False, worker_port=None, collective_timeout=30.0, shadow=None, **settings):
    settings = {"compression": "none", "all_reduce": False, "outer_momentum": 0.0, "outer_lr": 0.5,
                "inner_steps": 3, **settings}
    return types.SimpleNamespace(rank=rank, world_size=world_size, joining=joining, worker_port=worker_port, shadow=shadow,
                                 collective_timeout=collective_timeout, master_addr="10.0.0.9", master_port=29500,
                                 diloco=DilocoSpec(**settings))


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(diloco_module, "time", clock)
    return clock


@pytest.fixture
def make(clock):
    """A worker attached to a model, against a Server on the test's clock; its step hook removed at the end."""
    made = []

    def make_worker(model=None, latency=0.0, patience=5.0, **spec):
        server = Server(clock, latency)
        worker = Diloco(make_spec(**spec), Reporter(server, patience))
        model = model if model is not None else Vector(1.0, 2.0, 3.0)
        worker.attach(model, Checkpoints())
        made.append(worker)
        return worker, model, server

    yield make_worker
    for worker in made:
        if worker._hook is not None:
            worker._hook.remove()


def train(worker, model, by):
    """In place of ``inner_steps`` steps: the worker's weights move by ``by``."""
    with torch.no_grad():
        model.w += torch.tensor(by)
    worker.steps = worker.settings.inner_steps
