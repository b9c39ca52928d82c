"""How `zwdx server` serves: every connection a greenlet of one OS thread (gevent, the default),
or one OS thread per connection (`--async-mode threading`, and when gevent is missing)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import requests
import socketio

from procs import Server, wait_until
from zwdx import ZWDX
from wire_auth import connect_auth

CLIENTS = 60


def os_threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("Threads:"))


def gpu_client(url: str, token: str, client_id: str) -> socketio.Client:
    """A bare GPU client over a websocket, as gpu_client/agent/agent.py connects: registered, one slot."""
    sio = socketio.Client(reconnection=False)
    sio.connect(url, namespaces=["/gpu"], auth=connect_auth(token), transports=["websocket"], wait_timeout=30)
    answer = sio.call("register", {"client_id": client_id, "hostname": client_id, "versions": {"python": "3.11.7"},
                                   "slots": [{"index": 0, "kind": "cpu", "memory_total": 1000, "memory_free": 1000}]},
                      namespace="/gpu", timeout=30)
    assert answer["ok"], answer
    return sio


def test_the_server_holds_many_gpu_clients_on_one_os_thread(server, room):
    assert requests.get(f"{server.url}/health").json()["async_mode"] == "gevent"
    clients, errors = [None] * CLIENTS, []

    def connect(i):
        try:
            clients[i] = gpu_client(server.url, room["donor_token"], f"many-{i}")
        except Exception as exc:  # reported below, not lost in a thread
            errors.append(repr(exc))
    starters = [threading.Thread(target=connect, args=(i,)) for i in range(CLIENTS)]
    for t in starters:
        t.start()
    for t in starters:
        t.join(60)
    try:
        assert errors == []
        # Every connection is a greenlet: the server's OS threads do not grow with them.
        assert os_threads(server.pid) < 8
        answers = [c.call("heartbeat", {"slots": [{"index": 0, "memory_free": 500 + i, "utilization": i}]},
                          namespace="/gpu", timeout=30) for i, c in enumerate(clients)]
        assert all(a == {"ok": True} for a in answers)
        seen = {c["id"]: c for c in ZWDX(server.url).get_room(room["token"])["clients"]}
        assert sum(c["status"] == "online" for c in seen.values()) == CLIENTS
        assert [seen[f"many-{i}"]["slots"][0]["memory_free"] for i in range(CLIENTS)] == \
            [500 + i for i in range(CLIENTS)]
    finally:
        for c in clients:
            if c is not None:
                c.disconnect()
    wait_until(lambda: all(c["status"] == "offline" for c in ZWDX(server.url).get_room(room["token"])["clients"]),
               30, what="every GPU client seen disconnected")
    assert "Invalid HTTP method" not in server.output()  # a finished websocket is not read as HTTP


def test_a_dashboard_upgrades_from_polling_to_a_websocket(server, room):
    ui = socketio.Client(reconnection=False)
    pushed = []
    ui.on("clients_update", pushed.append, namespace="/ui")
    ui.connect(server.url, namespaces=["/ui"], auth=connect_auth(room["token"]), wait_timeout=30)  # as a browser
    try:
        wait_until(lambda: ui.transport() == "websocket", 10, what="the upgrade to a websocket")
        wait_until(lambda: pushed, 10, what="the GPU-client list pushed on connect")
    finally:
        ui.disconnect()


@pytest.mark.slow  # starts its own servers
def test_threading_mode_on_request_and_when_gevent_is_missing(tmp_path):
    srv = Server(str(tmp_path / "threads"), extra=["--async-mode", "threading"])
    try:
        assert requests.get(f"{srv.url}/health").json()["async_mode"] == "threading"
    finally:
        srv.stop()
    no_gevent = tmp_path / "no-gevent" / "gevent"
    no_gevent.mkdir(parents=True)
    (no_gevent / "__init__.py").write_text("raise ImportError('gevent is hidden by the test')\n")
    path = os.pathsep.join(p for p in (str(no_gevent.parent), os.environ.get("PYTHONPATH")) if p)
    srv = Server(str(tmp_path / "fallback"), env={"PYTHONPATH": path})
    try:
        assert requests.get(f"{srv.url}/health").json()["async_mode"] == "threading"
        assert "gevent is not installed" in srv.output()
    finally:
        srv.stop()


def test_other_commands_are_not_monkey_patched(server):
    out = subprocess.run([sys.executable, "-c", (
        "import sys\n"
        "from zwdx import cli\n"
        f"assert cli.main(['room', 'create', '--server', {server.url!r}, '--json']) == 0\n"
        "print('gevent' in sys.modules)\n")], capture_output=True, text=True, check=True, timeout=60).stdout
    assert out.strip().splitlines()[-1] == "False"
