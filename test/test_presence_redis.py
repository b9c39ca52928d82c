"""Presence across server processes (``zwdx/server/presence.py``), with a real ``redis-server``:
two server processes on one data dir, a GPU client on each (raw Socket.IO clients). What one
process's client says in its heartbeats shows through the other process (from Redis: such
figures are not written to the store); when the process holding a client is SIGKILLed, the
process that leads finds it silent and gives its clients ``CLIENT_TIMEOUT`` to come back, and
one that registers again through the other process is online there."""
from __future__ import annotations

import signal
import time

import pytest
import requests
import socketio

import needs
from procs import SLACK, Server, wait_until
from zwdx import defaults
from zwdx.server.presence import PRESENCE_TTL
from zwdx.testing import RedisProc
from wire_auth import connect_auth

pytestmark = pytest.mark.slow
H = defaults.TOKEN_HEADER
LEASE_TTL = 3.0
SLOT = {"index": 0, "kind": "cpu", "name": "CPU", "memory_total": 64_000, "memory_free": 64_000}


def gpu(url: str, token: str, client_id: str, secret: str | None = None) -> tuple[socketio.Client, dict]:
    sio = socketio.Client(reconnection=False)
    sio.connect(url, namespaces=["/gpu"], auth=connect_auth(token), transports=["websocket"], wait_timeout=30)
    hello = {"client_id": client_id, "hostname": client_id, "versions": {"python": "3.11.7"}, "slots": [SLOT],
             **({"client_secret": secret} if secret else {})}
    answer = sio.call("register", hello, namespace="/gpu", timeout=30)
    assert answer["ok"], answer
    return sio, answer


def clients(url: str, room: dict) -> dict[str, dict]:
    got = requests.get(f"{url}/api/v1/room", headers={H: room["submitter_token"]}, timeout=10).json()
    return {c["id"]: c for c in got["clients"]}


def leads(url: str) -> bool:
    return "zwdx_scheduler_leader 1" in requests.get(f"{url}/metrics", timeout=10).text


def test_presence_shows_across_processes_and_a_dead_process_clients_are_released(tmp_path):
    needs.tool("redis-server", "apt-get install redis-server (./setup.sh --test installs it)")
    needs.module("redis")
    redis = RedisProc(str(tmp_path))
    env = {"ZWDX_MESSAGE_QUEUE": redis.url, "ZWDX_SCHEDULER_LEASE_TTL": str(LEASE_TTL)}
    started, socks = [redis], []
    try:
        data = str(tmp_path / "data")  # one SQLite file for both
        s1 = Server(data, extra=["--client-timeout", "60"], env=env)
        started.append(s1)
        wait_until(lambda: leads(s1.url), 30, what="the first server leading")
        s2 = Server(data, extra=["--client-timeout", "60"], env=env)
        started.append(s2)
        room = requests.post(f"{s1.url}/api/v1/rooms", json={"name": "presence"}, timeout=10).json()
        one, hello = gpu(s1.url, room["donor_token"], "on-s1")
        two, _ = gpu(s2.url, room["donor_token"], "on-s2")
        socks += [one, two]
        beat = {"slots": [{"index": 0, "memory_free": 63_900, "utilization": 77}]}
        assert one.call("heartbeat", beat, namespace="/gpu", timeout=30)["ok"]
        wait_until(lambda: clients(s2.url, room)["on-s1"]["slots"][0]["utilization"] == 77, 10 + SLACK,
                   what="s1's client's heartbeat figures seen through s2 (Redis)")
        assert clients(s1.url, room)["on-s2"]["status"] == "online"

        s1.kill(signal.SIGKILL)
        killed = time.time()
        wait_until(lambda: clients(s2.url, room)["on-s1"]["status"] == "offline",
                   LEASE_TTL * 2 + PRESENCE_TTL + 2 + SLACK, what="s1's client released by s2 once s1 was found dead")
        noticed = time.time() - killed
        assert clients(s2.url, room)["on-s2"]["status"] == "online"
        assert "silent for" in s2.output()
        again, _ = gpu(s2.url, room["donor_token"], "on-s1", hello["client_secret"])  # it reconnects to s2
        socks.append(again)
        assert clients(s2.url, room)["on-s1"]["status"] == "online"
        print(f"s1's client offline {noticed:.1f} s after s1 was killed")
    finally:
        for sock in socks:
            if sock.connected:
                sock.disconnect()
        for proc in reversed(started):
            proc.stop()
