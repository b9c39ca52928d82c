"""Fixtures, two kinds:

- In-process (flaskr's conftest), fast: ``app`` (``create_app`` on a temporary data dir, the
  scheduler off; ``@pytest.mark.app_config(SCHEDULER=True)`` or ``make_app(**config)`` for
  another config), ``client`` (``app.test_client()``), ``api`` (the REST API as the holder of
  a fresh room's submitter token, ``api.donor`` its donor token; ``room_api()`` for another
  room), ``socket_client`` (Flask-SocketIO's test client on /gpu or /ui), ``placed_job(app,
  name)`` (a room with a job placed under a rank key the test holds). For validation,
  authorization and state transitions. Socket.IO
  is bound to the app made last (one ``socketio`` per process, as in the server).
- Real processes, for what needs them: ``server`` (a server process and its data dir;
  ``@pytest.mark.server_args("--client-timeout", "5")`` adds arguments), ``sdk``, ``room``
  (``room["token"]`` its submitter token, ``room["donor_token"]``), ``start_client`` (GPU-client
  processes, with the donor token); and ``cluster``: one server and two GPU clients shared by a
  module's tests, for those that leave it as they found it.

Two lanes: a test that starts processes is ``slow`` (the process fixtures mark it so; a module
that starts its own says ``pytestmark = pytest.mark.slow``), the rest is the fast lane
(``-m "not slow"``). Under ``CI`` a run that skipped anything fails (see needs.py).
"""
from __future__ import annotations

import os
import platform
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from needs import in_ci, leave_out_gpu_tests  # noqa: E402
from procs import GpuClient, Server, wait_until  # noqa: E402
from wire_auth import connect_auth

#: Fixtures that start processes: a test using one is in the slow lane.
PROCESS_FIXTURES = {"server", "sdk", "room", "start_client", "cluster", "shared_cluster",
                    "mongo_server"}  # nx-27017 (store_backends.py: its params mark the mongo half)


#: Seconds the slow lane's longest xdist groups took in CI (run_all.sh --tests: "test files by
#: time"; the Docker files are one group). Only the order in which pytest-xdist hands groups to
#: its workers depends on them: the longest first, so that none is left to run alone at the end
#: while the other worker idles (a group not listed counts 8 s a test, the lane's average, up to
#: about the last one listed).
GROUP_SECONDS = {"test/test_diloco_verify.py": 274, "docker": 270, "test/test_openapi.py": 203,
                 "test/test_resilience.py": 197, "test/test_bench.py": 194, "test/test_models.py": 158,
                 "test/test_outages.py": 136, "test/test_diloco_elastic.py": 123, "test/test_compile_cache.py": 122,
                 "test/test_runner.py": 108, "test/test_rendezvous_port.py": 105, "test/test_failures.py": 99,
                 "test/test_promises_training.py": 96, "test/test_pipeline.py": 88, "test/parity/test_parity.py": 87,
                 "test/test_sdk.py": 87, "test/test_scripts_e2e.py": 84, "test/parity/test_parity_pipeline.py": 72,
                 "test/test_netns.py": 70, "test/test_lost_peer.py": 68, "test/test_e2e.py": 66,
                 "test/test_promises_resilience.py": 65, "test/test_dashboard_browser.py": 63,
                 "test/test_diloco_netns.py": 58, "test/test_ddp_verify.py": 90, "test/test_step_check.py": 70,
                 "test/test_fsdp_verify.py": 75, "test/test_fsdp_check.py": 55}


def pytest_configure(config):
    if getattr(config.option, "dist", "no") == "loadgroup":
        # xdist would hand out the groups with the most tests first; the order of the items is
        # the longest groups first instead (pytest_collection_modifyitems), kept as it is
        config.option.loadscopereorder = False
    config.addinivalue_line("markers", "app_config(**config): the config of the in-process `app` fixture "
                                       "(e.g. SCHEDULER=True)")
    config.addinivalue_line("markers", "server_args(*args): more arguments for the `server` fixture's process")
    config.addinivalue_line("markers", "xdist_group(name): tests pytest-xdist runs on one worker (set per file below)")


@pytest.hookimpl(tryfirst=True)  # before -m picks the lane
def pytest_collection_modifyitems(config, items):
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        # under pytest-xdist (the slow lane runs on 2 workers: run_all.sh --tests), a file's tests
        # stay on one worker, in order (module-scoped clusters start once), and the Docker files
        # share one (one engine: test_docker_isolation.py runs the image test_docker.py builds)
        if item.get_closest_marker("xdist_group") is None:
            group = "docker" if item.get_closest_marker("docker") else item.nodeid.split("::", 1)[0]
            item.add_marker(pytest.mark.xdist_group(group))
    if getattr(config.option, "dist", "no") == "loadgroup":
        def group(item) -> str:
            marker = item.get_closest_marker("xdist_group")
            return marker.args[0] if marker.args else marker.kwargs.get("name", "")
        tests: dict[str, int] = {}
        for item in items:
            if item.get_closest_marker("slow"):
                tests[group(item)] = tests.get(group(item), 0) + 1
        # a stable sort: each group's tests stay in their order (module-scoped fixtures start once)
        items.sort(key=lambda item: -GROUP_SECONDS.get(group(item), min(8 * tests.get(group(item), 0), 57)))
    leave_out_gpu_tests(config, items)  # where torch sees no GPU, unless asked for


# -- under CI, nothing may be skipped ---------------------------------------------------------------
#: "node id: reason" of each test (or module) that was skipped in this session.
SKIPPED: list[str] = []


def _note(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):  # an xfail ran; a skip did not
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        SKIPPED.append(f"{report.nodeid or '(collection)'}: {reason}")


#: Seconds each test file took (setup, call and teardown of its tests), for the summary below.
FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    _note(report)
    path = report.nodeid.split("::", 1)[0]
    FILE_SECONDS[path] = FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_collectreport(report):
    _note(report)


def pytest_sessionfinish(session):
    if in_ci() and SKIPPED and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if FILE_SECONDS and terminalreporter.config.getoption("durations", None) is not None:
        # where a lane's time goes, per file (--durations names single tests; most of a lane's
        # time is in files of many middling ones)
        total = sum(FILE_SECONDS.values())
        terminalreporter.section(f"test files by time ({total:.0f} s in all, the 25 slowest)")
        for path, seconds in sorted(FILE_SECONDS.items(), key=lambda kv: -kv[1])[:25]:
            terminalreporter.line(f"{seconds:8.1f}s {100 * seconds / total:5.1f}%  {path}")
    if in_ci() and SKIPPED:
        terminalreporter.section("skipped under CI: the run fails", red=True, bold=True)
        for line in SKIPPED:
            terminalreporter.line(line)
        terminalreporter.line("CI runs every test; make what each needs available (./setup.sh --test) "
                              "or fix the test (needs.py says how a test asks for what it needs).")


@pytest.fixture(autouse=True)
def seeded():
    """Every test starts from the same random state: the models it builds here (shipped to the
    GPU clients as they are) start from the same weights on every run, so an accuracy or loss
    threshold is a property of the code, not of the draw. (Python's own ``random`` stays
    unseeded: tests draw names from it that concurrent runs must not share.)"""
    if "torch" in sys.modules:  # a test module that builds models imported it
        sys.modules["torch"].manual_seed(0)


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
def group_of_one():
    """A torch.distributed process group of this process alone (gloo, in memory), for the test only:
    what a rank's strategy or checkpointer needs of one, in-process."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


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

    def refused(self, field: str, **fields) -> dict:
        """``submit(**fields)`` is a 400 naming ``field`` and stores no job; the error."""
        before = self.jobs()
        resp = self.submit(**fields)
        assert resp.status_code == 400, resp.json
        assert resp.json["error"]["field"] == field, resp.json
        assert self.jobs() == before
        return resp.json["error"]

    def jobs(self) -> list[dict]:
        resp = self.get("/jobs")
        assert resp.status_code == 200, resp.text
        return resp.json["jobs"]


def placed_job(app, name: str) -> tuple[Api, Api, dict]:
    """A new room of ``app`` with one job placed on one CPU slot of a GPU client (as the
    scheduler places it: ``zwdx.server.jobs.Job.start``) under a rank key the test holds: the
    room's Api, its rank 0's Api (the rank key alone, as a rank process calls), and the job as
    submitted."""
    room, ranks, job = placed_ranks(app, name, 1)
    return room, ranks[0], job


def placed_ranks(app, name: str, world_size: int) -> tuple[Api, list[Api], dict]:
    """``placed_job`` of ``world_size`` ranks, each on a CPU slot of the one GPU client: the
    room's Api, each rank's Api (its own key), the job."""
    from zwdx.protocol import SlotKind
    from zwdx.protocol.job import PlacementEntry
    from zwdx.server.auth import hash_secret
    from zwdx.server.jobs import Job
    room = Api(app.test_client()).create_room(name)
    bundle = room.upload(f"bundle of {name}".encode())
    job = room.post("/jobs", json={"bundle_artifact": bundle["id"], "versions": {"python": platform.python_version()},
                                   "world_size": world_size}).json
    ctx = app.extensions["zwdx"]
    keys = [f"rk_{name}" if r == 0 else f"rk_{name}_{r}" for r in range(world_size)]
    client_id = f"gpu-{name}"
    ctx.store.upsert_client({"id": client_id, "room_id": room.room["id"], "hostname": name, "status": "online"},
                            [{"id": f"{client_id}:{r}", "client_id": client_id, "room_id": room.room["id"], "index": r,
                              "kind": "cpu"} for r in range(world_size)])
    placement = [PlacementEntry(rank=r, client_id=client_id, gpu_index=r, kind=SlotKind.CPU) for r in range(world_size)]
    assert Job.load(ctx.store, job["id"]).start(placement, [f"{client_id}:{r}" for r in range(world_size)],
                                                {r: hash_secret(k) for r, k in enumerate(keys)})
    return room, [room.as_(None, rank_key=k) for k in keys], job


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
        sock = socketio.test_client(app, namespace=namespace, auth=connect_auth(token) if token else None)
        made.append(sock)
        return sock

    yield connect
    for sock in made:
        if sock.is_connected():
            sock.disconnect()


# -- real processes --------------------------------------------------------------------------------
@pytest.fixture
def server(request, tmp_path):
    """A server process on a free port, its data dir under tmp_path; ``@pytest.mark.server_args(...)``
    adds command-line arguments (a shorter ``--client-timeout``); a test that also asks for
    ``mongo_uri`` (store_backends.py) gets it on that MongoDB database."""
    marker = request.node.get_closest_marker("server_args")
    extra = list(marker.args) if marker else []
    if "mongo_uri" in request.fixturenames:
        extra += ["--mongo-uri", request.getfixturevalue("mongo_uri")]
    srv = Server(str(tmp_path / "server"), extra=extra or None)
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
    """start_client(name) -> GpuClient process registered in the test room (with its donor token);
    ``start_client.together(*names)`` -> those GPU clients, started at once and then waited for
    (a start is mostly the client's own imports and registration: several overlap)."""
    started = []

    def online(clients: list[GpuClient]) -> None:
        from zwdx import ZWDX
        sdk = ZWDX(server.url, room_token=room["token"])

        def up() -> bool:
            ids = {c["id"] for c in sdk.get_room()["clients"] if c["status"] == "online"}
            return all(client.client_id in ids for client in clients)
        wait_until(up, 30 + 15 * (len(clients) - 1), what=f"gpu clients {[c.client_id for c in clients]} online\n"
                   + "\n".join(c.output() for c in clients if not c.alive()))

    def start(name: str = "", wait: bool = True, **kwargs) -> GpuClient:
        name = name or f"c{len(started)}"
        client = GpuClient(server.url, room["donor_token"], str(tmp_path / name), client_id=f"client-{name}", **kwargs)
        started.append(client)
        if wait:
            online([client])
        return client

    def together(*names: str, **kwargs) -> list[GpuClient]:
        clients = [start(name, wait=False, **kwargs) for name in names]
        online(clients)
        return clients

    start.together = together  # type: ignore[attr-defined]
    yield start
    GpuClient.stop_all(started)


class Cluster:
    """One server and two GPU clients (``client-a``, ``client-b``, one CPU slot each) in one room,
    started once for a module: ``server``, ``sdk`` (holding the room's token), ``room`` (its
    ``token``), ``clients``. GPU clients serve one room, so the module's tests share it; each
    starts as if alone: ``ready()`` waits until both clients are online with every slot free
    (starting again a client a test left dead), and ``tidy()`` cancels what a test left
    unfinished. Tests that kill a client or need another room size start their own."""

    NAMES = ("a", "b")

    def __init__(self, base, client_args: list[str] | None = None):
        """``client_args``: more options of each ``zwdx gpu-client`` (``["--cpu-slots", "2"]``)."""
        from zwdx import ZWDX
        self.base, self.client_args = base, client_args
        self.server = Server(str(base / "server"))
        self.sdk = ZWDX(self.server.url, remember=False)
        self.room = self.sdk.create_room("cluster")
        self.sdk.room_token = self.room["token"]
        self.clients = [self._start(name) for name in self.NAMES]
        self.ready()

    def _start(self, name: str) -> GpuClient:
        return GpuClient(self.server.url, self.room["donor_token"], str(self.base / name), client_id=f"client-{name}",
                         extra=self.client_args)

    def _state(self) -> dict:
        return {c["id"]: c for c in self.sdk.get_room()["clients"]}

    def ready(self, timeout: float = 60) -> None:
        for i, client in enumerate(self.clients):
            if not client.alive():
                client.stop()
                self.clients[i] = self._start(self.NAMES[i])

        def idle() -> bool:
            state = self._state()
            return all(c.client_id in state and state[c.client_id]["status"] == "online"
                       and all(s["job_id"] is None for s in state[c.client_id]["slots"]) for c in self.clients)
        wait_until(idle, timeout, what=f"the cluster's GPU clients online and idle: {self._state()}")

    def tidy(self) -> None:
        from zwdx.protocol import FINISHED
        for job in self.sdk.list_jobs():
            if job["status"] not in FINISHED:
                self.sdk.cancel_job(job["id"])

    def stop(self) -> None:
        GpuClient.stop_all(self.clients)
        self.server.stop()


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("cluster"))
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster(shared_cluster) -> Cluster:
    """The module's Cluster, ready: both GPU clients online and idle, nothing queued."""
    shared_cluster.ready()
    yield shared_cluster
    shared_cluster.tidy()
