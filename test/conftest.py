"""Fixtures, two kinds:

- In-process (flaskr's conftest), fast: ``app`` (``create_app`` on a temporary data dir, the
  scheduler off; ``@pytest.mark.app_config(SCHEDULER=True)`` or ``make_app(**config)`` for
  another config), ``client`` (``app.test_client()``), ``api`` (the REST API as the holder of
  a fresh room's submitter token, ``api.donor`` its donor token; ``room_api()`` for another
  room), ``socket_client`` (Flask-SocketIO's test client on /gpu or /ui), ``placed_job(app,
  name)`` (a room with a job placed under a rank key the test holds). For validation,
  authorization and state transitions. Socket.IO
  is bound to the app made last (one ``socketio`` per process, as in the server).
- Real processes, for what needs them: ``server`` (a server process and its data dir), ``sdk``,
  ``room`` (``room["token"]`` its submitter token, ``room["donor_token"]``), ``start_client``
  (GPU-client processes, with the donor token).
"""
from __future__ import annotations

import os
import platform
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from procs import GpuClient, Server, wait_until  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "app_config(**config): the config of the in-process `app` fixture "
                                       "(e.g. SCHEDULER=True)")


@pytest.fixture(autouse=True)
def config_dir(tmp_path, monkeypatch):
    """The SDK's credential store, in a temporary directory: tests never write the real home
    (the variable reaches the processes a test starts too)."""
    path = tmp_path / "zwdx-config"
    monkeypatch.setenv("ZWDX_CONFIG_DIR", str(path))
    return path


# -- in-process: the app, its test clients ------------------------------------------------------
@pytest.fixture
def make_app(tmp_path):
    """make_app(**config) -> a fresh server app in this process: its own data dir under
    tmp_path, the embedded store, the scheduler off unless ``SCHEDULER=True``; each is closed
    (loops stopped, store released) after the test."""
    from zwdx.server import create_app
    apps = []

    def make(**config):
        app = create_app({"DATA_DIR": str(tmp_path / f"app-{len(apps)}"), "MONGO_URI": None, "SCHEDULER": False,
                          "TESTING": True, **config})
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.extensions["zwdx"].close()


@pytest.fixture
def app(request, make_app):
    """The test's app; ``@pytest.mark.app_config(SCHEDULER=True, ...)`` changes its config."""
    marker = request.node.get_closest_marker("app_config")
    return make_app(**(marker.kwargs if marker else {}))


@pytest.fixture
def client(app):
    return app.test_client()


class Api:
    """The REST API of an in-process app as one caller uses it: paths under /api/v1, its room
    token and rank key (when it has them) in the headers. ``api.get("/jobs")`` -> the response."""

    def __init__(self, client, token: str | None = None, rank_key: str | None = None, room: dict | None = None):
        self.client, self.token, self.rank_key, self.room = client, token, rank_key, room

    def as_(self, token: str | None = None, rank_key: str | None = None) -> "Api":
        """The same app, called with another token (None: none) and rank key."""
        return Api(self.client, token, rank_key)

    @property
    def donor(self) -> str:
        """The room's donor token (for GPU clients), from the answer that made the room."""
        return self.room["donor_token"]

    def headers(self, extra: dict | None = None) -> dict:
        from zwdx import defaults
        out = {}
        if self.token is not None:
            out[defaults.TOKEN_HEADER] = self.token
        if self.rank_key is not None:
            out[defaults.RANK_KEY_HEADER] = self.rank_key
        return {**out, **(extra or {})}

    def request(self, method: str, path: str, headers: dict | None = None, **kwargs):
        from zwdx import defaults
        url = path if path.startswith("/health") else f"{defaults.API_PREFIX}{path}"
        return self.client.open(url, method=method.upper(), headers=self.headers(headers), **kwargs)

    def get(self, path: str, **kwargs):
        return self.request("GET", path, **kwargs)

    def post(self, path: str, **kwargs):
        return self.request("POST", path, **kwargs)

    def put(self, path: str, **kwargs):
        return self.request("PUT", path, **kwargs)

    def create_room(self, name: str = "test-room") -> "Api":
        """A new room; the Api of its submitter token (``.room`` is the answer, tokens included)."""
        resp = self.client.post("/api/v1/rooms", json={"name": name})
        assert resp.status_code == 201, resp.text
        return Api(self.client, resp.json["token"], room=resp.json)

    def upload(self, data: bytes = b"a bundle: the server stores it and never opens it", **kwargs) -> dict:
        resp = self.post("/artifacts", data=data, **kwargs)
        assert resp.status_code == 201, resp.text
        return resp.json

    def submit(self, **fields):
        """Upload a bundle and create a job from it (the SDK's two calls); the response."""
        body = {"bundle_artifact": self.upload()["id"], "versions": {"python": platform.python_version()}, **fields}
        return self.post("/jobs", json=body)

    def jobs(self) -> list[dict]:
        resp = self.get("/jobs")
        assert resp.status_code == 200, resp.text
        return resp.json["jobs"]


def placed_job(app, name: str) -> tuple[Api, Api, dict]:
    """A new room of ``app`` with one job placed on one CPU slot of a GPU client (as the
    scheduler places it: ``zwdx.server.job.Job.start``) under a rank key the test holds: the
    room's Api, its rank 0's Api (the rank key alone, as a rank process calls), and the job as
    submitted."""
    from zwdx.protocol import SlotKind
    from zwdx.protocol.job import PlacementEntry
    from zwdx.server.auth import hash_secret
    from zwdx.server.job import Job
    room = Api(app.test_client()).create_room(name)
    bundle = room.upload(f"bundle of {name}".encode())
    job = room.post("/jobs", json={"bundle_artifact": bundle["id"], "versions": {"python": platform.python_version()},
                                   "world_size": 1}).json
    ctx, key = app.extensions["zwdx"], f"rk_{name}"
    client_id = f"gpu-{name}"
    ctx.store.upsert_client({"id": client_id, "room_id": room.room["id"], "hostname": name, "status": "online"},
                            [{"id": f"{client_id}:0", "client_id": client_id, "room_id": room.room["id"], "index": 0,
                              "kind": "cpu"}])
    placement = [PlacementEntry(rank=0, client_id=client_id, gpu_index=0, kind=SlotKind.CPU)]
    assert Job.load(ctx.store, job["id"]).start(placement, [f"{client_id}:0"], {0: hash_secret(key)})
    return room, room.as_(None, rank_key=key), job


@pytest.fixture
def room_api(app):
    """room_api(name="test-room", app=None) -> the REST API of ``app`` (the test's by default)
    as the holder of a fresh room's token."""
    def make(name: str = "test-room", app=app) -> Api:
        return Api(app.test_client()).create_room(name)
    return make


@pytest.fixture
def api(room_api) -> Api:
    """The REST API as the holder of a fresh room's token (``api.room``: the room, token included)."""
    return room_api()


@pytest.fixture
def socket_client(app):
    """socket_client(namespace="/gpu", token=None) -> Flask-SocketIO's test client of the app,
    connecting with ``auth={"token": token}`` (``is_connected(namespace)`` says whether the
    server let it in); disconnected after the test."""
    from zwdx.server import socketio
    made = []

    def connect(namespace: str = "/gpu", token: str | None = None):
        sock = socketio.test_client(app, namespace=namespace, auth={"token": token} if token else None)
        made.append(sock)
        return sock

    yield connect
    for sock in made:
        if sock.is_connected():
            sock.disconnect()


# -- real processes --------------------------------------------------------------------------------
@pytest.fixture
def server(tmp_path):
    srv = Server(str(tmp_path / "server"))
    yield srv
    srv.stop()


@pytest.fixture
def sdk(server):
    from zwdx import ZWDX
    return ZWDX(server.url)


@pytest.fixture
def room(sdk):
    return sdk.create_room("test-room")


@pytest.fixture
def start_client(server, room, tmp_path):
    """start_client(name) -> GpuClient process registered in the test room (with its donor token)."""
    started = []

    def start(name: str = "", wait: bool = True, **kwargs) -> GpuClient:
        name = name or f"c{len(started)}"
        client = GpuClient(server.url, room["donor_token"], str(tmp_path / name), client_id=f"client-{name}", **kwargs)
        started.append(client)
        if wait:
            from zwdx import ZWDX
            sdk = ZWDX(server.url, room_token=room["token"])
            wait_until(lambda: any(c["id"] == client.client_id and c["status"] == "online"
                                   for c in sdk.get_room()["clients"]),
                       30, what=f"gpu client {name} online\n{client.output() if not client.alive() else ''}")
        return client

    yield start
    for client in started:
        client.stop()
