"""The /gpu edge: what a GPU client sends is checked against its type before anything is stored.

A wrong payload (wrong types, missing fields, huge lists, a string as free memory,
``versions`` as a list, not an object at all) is answered ``{"ok": false, "error": ...}`` naming
the field and what was expected; it changes nothing stored, and the server and the connection
stay up. Unknown fields are ignored (a newer client's: docs/operations.md, Upgrades). A real server
process, and a raw Socket.IO client standing in for a GPU client.
"""
from __future__ import annotations

import copy
import time

import pytest
import requests
import socketio
import torch

from procs import Server, wait_until
import zwdx
from zwdx import defaults
from wire_auth import connect_auth

H = defaults.TOKEN_HEADER
SLOT = {"index": 0, "kind": "cpu", "name": "CPU", "memory_total": 1000, "memory_free": 1000}
HELLO = {"client_id": "edge", "hostname": "h", "versions": {"python": "3.11.7"}, "slots": [SLOT]}


@pytest.fixture
def server(tmp_path):
    """A server that gives a silent GPU client 10 minutes: this test's client sends no heartbeat
    while it sends wrong payloads, and must not be declared lost meanwhile."""
    srv = Server(str(tmp_path / "server"), extra=["--client-timeout", "600"])
    yield srv
    srv.stop()


@pytest.fixture
def gpu(server, room):
    sio = socketio.Client(reconnection=False)
    sio.connect(server.url, namespaces=["/gpu"], auth=connect_auth(room["donor_token"]), transports=["websocket"],
                wait_timeout=30)
    yield sio
    sio.disconnect()


def call(sio, event: str, payload):
    """The server's answer to ``event`` (a tuple ``payload``: that many arguments; None: none)."""
    return sio.call(event, payload, namespace="/gpu", timeout=30)


def room_clients(server, room) -> list[dict]:
    return requests.get(f"{server.url}/api/v1/room", headers={H: room["token"]}, timeout=10).json()["clients"]


def without(payload: dict, name: str) -> dict:
    return {k: v for k, v in payload.items() if k != name}


def assert_refused(answer, field: str) -> None:
    assert answer["ok"] is False and f"field '{field}'" in answer["error"], (field, answer)


def assert_up(server) -> None:
    assert server.alive() and requests.get(f"{server.url}/health", timeout=10).status_code == 200
    assert "handler failed" not in server.output()  # each was refused at the edge, none raised inside


REGISTER_WRONG = [
    (without(HELLO, "client_id"), "client_id"),                                 # missing
    ({**HELLO, "client_id": 7}, "client_id"),                                   # wrong type
    ({**HELLO, "client_id": "a b/../c"}, "client_id"),                           # not an id
    ({**without(HELLO, "client_id"), "clientid": "typo"}, "client_id"),        # a typo: unknown fields are
                                                                                # ignored (a newer client's), so it lacks client_id
    ({**HELLO, "versions": ["3.11.7"]}, "versions"),                            # a list for a dict
    ({**HELLO, "versions": {f"v{i}": "1" for i in range(500)}}, "versions"),    # huge
    ({**HELLO, "slots": {"index": 0}}, "slots"),
    ({**HELLO, "slots": [{**SLOT, "index": i} for i in range(5000)]}, "slots"),  # huge list
    ({**HELLO, "slots": [{**SLOT, "memory_free": "1000"}]}, "slots.0.memory_free"),  # a string as free memory
    ({**HELLO, "slots": [{**SLOT, "memory_total": 1.5}]}, "slots.0.memory_total"),
    ({**HELLO, "slots": [{**SLOT, "kind": "tpu"}]}, "slots.0.kind"),
    ({**HELLO, "slots": [{**SLOT, "index": True}]}, "slots.0.index"),
    ({**HELLO, "slots": [SLOT, SLOT]}, "slots"),                                # one index twice
    ({**HELLO, "running": [{"job_id": "j", "attempt": 0}] * 5000}, "running"),
    ({**HELLO, "running": [{"job_id": {"$ne": None}}]}, "running.0.job_id"),    # an operator as an id
    ({**HELLO, "host_id": ""}, "host_id"),
]


def test_a_wrong_register_is_refused_with_its_field_and_stores_no_client(server, room, gpu):
    for payload, field in REGISTER_WRONG:
        assert_refused(call(gpu, "register", payload), field)
    for not_an_object in ("edge", [HELLO], 42):
        answer = call(gpu, "register", not_an_object)
        assert answer["ok"] is False and "must be a JSON object" in answer["error"], answer
    for arguments in (None, (HELLO, HELLO)):
        answer = call(gpu, "register", arguments)
        assert answer["ok"] is False and "send one JSON object" in answer["error"], answer
    assert room_clients(server, room) == []
    assert call(gpu, "heartbeat", {"slots": []}) == {"ok": False, "error": "heartbeat before register"}
    assert_up(server)
    answer = call(gpu, "register", HELLO)  # the same connection goes on
    assert answer["ok"] is True and answer["room_id"] == room["id"], answer
    assert [c["id"] for c in room_clients(server, room)] == ["edge"]


HEARTBEAT_WRONG = [
    ({"slots": [{"index": 0, "memory_free": "12 GiB"}]}, "slots.0.memory_free"),  # a string as free memory
    ({"slots": [{"index": 0, "memory_free": -1}]}, "slots.0.memory_free"),
    ({"slots": [{"index": 0, "memory_free": 2 ** 70}]}, "slots.0.memory_free"),
    ({"slots": [{"index": 0, "memory_free": 5, "utilization": 101}]}, "slots.0.utilization"),
    ({"slots": [{"index": "0", "memory_free": 5}]}, "slots.0.index"),
    ({"slots": [{"memory_free": 5}]}, "slots.0.index"),
    ({"slots": {"0": 5}}, "slots"),
    ({"slots": [{"index": 0, "memory_free": 5}] * 5000}, "slots"),
    ({"running": "job-1"}, "running"),
    ({"running": [{"job_id": "j", "attempt": "1"}]}, "running.0.attempt"),
]


def test_a_wrong_heartbeat_is_refused_and_changes_nothing_a_right_one_does(server, room, gpu):
    assert call(gpu, "register", HELLO)["ok"]
    before = room_clients(server, room)
    for payload, field in HEARTBEAT_WRONG:
        assert_refused(call(gpu, "heartbeat", payload), field)
    assert call(gpu, "heartbeat", "slots")["ok"] is False
    assert room_clients(server, room) == before  # not even its last_seen
    assert_up(server)
    assert call(gpu, "heartbeat", {"slots": [{"index": 0, "memory_free": 321, "utilization": None}]}) == {"ok": True}
    after = room_clients(server, room)[0]
    assert after["slots"][0]["memory_free"] == 321 and after["last_seen"] > before[0]["last_seen"]


def test_a_wrong_ranks_exited_is_refused_and_leaves_the_job_as_it_was(server, room, sdk, gpu):
    assert call(gpu, "register", HELLO)["ok"]
    job_id = sdk.submit_job(torch.nn.Linear(2, 2), loader, train, resources=zwdx.Resources(world_size=2),
                            run=zwdx.Run(room_token=room["token"]),
                            wait=False)  # one slot in the room: it waits
    job = wait_until(lambda: (j := sdk.get_job(job_id)).get("waiting_reason") and j, 30, what="the job waiting")
    wrong = [
        ({"exits": {"0": 0}}, "job_id"),
        ({"job_id": job_id, "exits": [0]}, "exits"),
        ({"job_id": job_id, "exits": {"0": "1"}}, "exits.0"),
        ({"job_id": job_id, "exits": {"0": 1.5}}, "exits.0"),
        ({"job_id": job_id, "exits": {"0": 1000}}, "exits.0"),
        ({"job_id": job_id, "exits": {"zero": 1}}, "exits.zero"),
        ({"job_id": job_id, "exits": {}}, "exits"),
        ({"job_id": job_id, "exits": {str(i): 0 for i in range(5000)}}, "exits"),
        ({"job_id": job_id, "attempt": -1, "exits": {"0": 0}}, "attempt"),
        ({"job_id": {"$ne": None}, "exits": {"0": 0}}, "job_id"),
    ]
    for payload, field in wrong:
        assert_refused(call(gpu, "ranks_exited", payload), field)
    assert sdk.get_job(job_id) == job
    answer = call(gpu, "ranks_exited", {"job_id": "no-such-job", "exits": {"0": 0}})
    assert answer == {"ok": False, "error": "no such job in this room"}
    assert_up(server)


def test_a_wrong_payload_from_a_client_that_never_registered_is_refused_too(server, room, gpu):
    payload = copy.deepcopy(HELLO)
    payload["slots"][0]["memory_free"] = "lots"
    assert_refused(call(gpu, "register", payload), "slots.0.memory_free")
    answer = call(gpu, "ranks_exited", {"job_id": "j", "exits": {"0": 0}})
    assert answer == {"ok": False, "error": "ranks_exited before register"}
    assert room_clients(server, room) == []
    assert_up(server)


def loader(rank, world_size):
    return [(torch.zeros(1, 2), torch.zeros(1, 2))]


def train(model, loader):
    return {"loss": 0.0}


@pytest.mark.slow  # a server process
def test_a_server_with_many_gpu_clients_asks_them_to_beat_less_often_and_waits_longer(tmp_path):
    """``--heartbeat-rate``: past that many heartbeats a second at the usual interval, a server
    process stretches the interval it asks for (register answer, then any heartbeat answer when
    it changes) and the silence after which a client is lost alike; fewer clients, back again."""
    # one beat a second: 2 clients at 2 s; silent for 2 s (stretched alike): lost
    server = Server(str(tmp_path / "server"), extra=["--heartbeat-rate", "1", "--client-timeout", "2"])
    try:
        from zwdx import ZWDX
        room = ZWDX(server.url).create_room("paced")
        socks = []

        def join(n: int):
            sio = socketio.Client(reconnection=False)
            sio.connect(server.url, namespaces=["/gpu"], auth=connect_auth(room["donor_token"]),
                        transports=["websocket"], wait_timeout=30)
            socks.append(sio)
            return call(sio, "register", {**HELLO, "client_id": f"paced-{n}"})

        first = join(0)
        assert first["ok"] and first["heartbeat_interval"] == defaults.HEARTBEAT_INTERVAL
        assert call(socks[0], "heartbeat", {"slots": []}) == {"ok": True}  # nothing changed: nothing said
        for n in (1, 2, 3):
            join(n)
        # five connections at one beat a second together: every 5 s, and lost after 5 s of silence
        assert join(4)["heartbeat_interval"] == 5.0
        assert call(socks[0], "heartbeat", {"slots": []}) == {"ok": True, "heartbeat_interval": 5.0}
        assert call(socks[0], "heartbeat", {"slots": []}) == {"ok": True}  # told once
        # the silence is what is tested: past the 2 s timeout, within the 5 s it is stretched to
        time.sleep(3.0)
        assert {c["id"]: c["status"] for c in room_clients(server, room)}["paced-0"] == "online"
        wait_until(lambda: {c["id"]: c["status"] for c in room_clients(server, room)}["paced-0"] == "offline", 15,
                   what="paced-0 lost once silent past its stretched timeout")
        assert not call(socks[0], "heartbeat", {"slots": []})["ok"]
        assert call(socks[0], "register", {**HELLO, "client_id": "paced-0"})["ok"]
        for sio in socks[1:]:
            sio.disconnect()
        wait_until(lambda: call(socks[0], "heartbeat", {"slots": []}).get("heartbeat_interval") == 2.0, 30,
                   what="the usual interval again, once the others left")
    finally:
        for sio in socks:
            sio.disconnect()
        server.stop()
