"""Fixtures: a fresh server process and data dir per test, rooms, and GPU client processes."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from procs import GpuClient, Server, wait_until  # noqa: E402


@pytest.fixture(autouse=True)
def config_dir(tmp_path, monkeypatch):
    """The SDK's credential store, in a temporary directory: tests never write the real home
    (the variable reaches the processes a test starts too)."""
    path = tmp_path / "zwdx-config"
    monkeypatch.setenv("ZWDX_CONFIG_DIR", str(path))
    return path


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
    """start_client(name) -> GpuClient process registered in the test room."""
    started = []

    def start(name: str = "", wait: bool = True, **kwargs) -> GpuClient:
        name = name or f"c{len(started)}"
        client = GpuClient(server.url, room["token"], str(tmp_path / name), client_id=f"client-{name}", **kwargs)
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
