"""Rooms made before tokens had roles (issue 12, item 5: "migrate existing rooms"): a store
written by the previous zwdx (schema version 2: ``test/data/store_v2.json``, written by zwdx at
commit 8992f39, as its ``written_by`` says) opens migrated, over both stores. Its rooms' one ``zr_`` token keeps working in both roles, listed ``legacy``, until the
room's owner rotates it into a submitter and a donor token; then the old token opens nothing.
A GPU client registered before clients had secrets takes its first one; a job placed under the
old job-wide key keeps no trace of it.
"""
from __future__ import annotations

import json
import os
import platform

import pytest

from conftest import Api
from store_backends import *  # noqa: F401,F403  (fixtures: backend, mongo_uri, ...)
from store_backends import Backend
from zwdx.server.store import SCHEMA_VERSION
from wire_auth import connect_auth

V2 = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "store_v2.json")


@pytest.fixture
def v2():
    with open(V2) as fh:
        return json.load(fh)


@pytest.fixture
def old_store(backend, v2):
    """The backend, holding what the previous zwdx wrote."""
    assert v2["schema_version"] == 2 and SCHEMA_VERSION == 3
    backend.write_raw(v2["rooms"], v2["jobs"], schema_version=2, clients=v2["clients"], slots=v2["slots"])
    return backend


@pytest.fixture
def old_app(old_store, make_app, tmp_path):
    """An app of this zwdx over the old store (artifact bytes: none needed)."""
    if old_store.name == "sqlite":
        return make_app(DATA_DIR=old_store.where)
    return make_app(DATA_DIR=str(tmp_path / "mongo-app"), MONGO_URI=old_store.where)


@pytest.fixture
def sockets(old_app):
    """sockets(namespace, token) -> Flask-SocketIO's test client of the old store's app."""
    from zwdx.server import socketio
    made = []

    def connect(namespace: str, token: str):
        made.append((namespace, socketio.test_client(old_app, namespace=namespace, auth=connect_auth(token))))
        return made[-1][1]
    yield connect
    for namespace, sock in made:
        if sock.is_connected(namespace):
            sock.disconnect(namespace=namespace)


def test_the_old_store_opens_migrated_with_each_rooms_token_as_its_legacy_credential(old_store, v2):
    store = old_store.open()
    assert store.schema_version() == SCHEMA_VERSION
    for room in v2["rooms"]:
        credentials = store.list_credentials(room["id"])
        assert len(credentials) == 1, credentials
        legacy = credentials[0]
        assert (legacy["role"], legacy["legacy"], legacy["hash"], legacy["revoked_at"]) == \
            ("submitter", True, room["token_hash"], None)
        assert store.get_room(room["id"]) == {k: v for k, v in room.items() if k != "token_hash"}
    placed = next(j for j in v2["jobs"] if j["name"] == "placed")
    assert placed["job_key_hash"] and store.get_job(placed["id"]).rank_keys == {}
    store.close()
    again = old_store.open()  # opened again: nothing migrates twice
    assert [len(again.list_credentials(r["id"])) for r in v2["rooms"]] == [1, 1]


def test_a_legacy_token_opens_both_roles_until_rotated_into_a_pair(old_app, v2, sockets):
    room = v2["rooms"][0]
    old = Api(old_app.test_client(), v2["tokens"][room["id"]])
    assert old.token.startswith("zr_")

    # Both roles: the room, a submit, the dashboard, a GPU client.
    assert old.get("/room").json["name"] == "v2"
    assert old.submit(world_size=1).status_code == 201
    assert sockets("/ui", old.token).is_connected("/ui")
    gpu = sockets("/gpu", old.token)
    assert gpu.is_connected("/gpu")
    tokens = old.get("/room/tokens").json["tokens"]
    assert [(t["role"], t["legacy"], t["own"], t["name"]) for t in tokens] == [("submitter", True, True, "room token")]

    # The GPU client registered before clients had secrets takes its first one.
    hello = {"client_id": "v2-gpu", "hostname": "vm", "versions": {"python": platform.python_version()},
             "slots": [{"index": 0, "kind": "cpu", "memory_total": 1 << 30, "memory_free": 1 << 30}]}
    answer = gpu.emit("register", hello, namespace="/gpu", callback=True)
    assert answer["ok"] and answer["client_secret"].startswith("zc_"), answer
    stranger = sockets("/gpu", old.token)
    refused = stranger.emit("register", hello, namespace="/gpu", callback=True)
    assert refused["ok"] is False and refused["code"] == "client_secret", refused

    # A job placed under the old job-wide key: that key opens nothing now.
    placed = next(j for j in v2["jobs"] if j["name"] == "placed")
    resp = old.as_(None).post(f"/jobs/{placed['id']}/events", json={"events": []},
                              headers={"X-Zwdx-Job-Key": "jk_v2-placed"})
    assert resp.status_code == 401, resp.text

    # Rotated: the same credential becomes a plain submitter token, and the room gets a donor token.
    rotated = old.post(f"/room/tokens/{tokens[0]['id']}/rotate").json["tokens"]
    assert [(t["role"], t["legacy"], t["own"], t["token"][:3]) for t in rotated] == \
        [("submitter", False, True, "zs_"), ("donor", False, False, "zd_")]
    submitter, donor = rotated[0]["token"], rotated[1]["token"]
    assert rotated[0]["id"] == tokens[0]["id"]
    for path in ("/room", "/jobs", "/room/tokens"):
        resp = old.get(path)
        assert resp.status_code == 401 and "not recognised" in resp.json["error"]["message"], (path, resp.text)
    assert not sockets("/gpu", old.token).is_connected("/gpu")
    assert not sockets("/ui", old.token).is_connected("/ui")
    new = old.as_(submitter)
    assert len(new.jobs()) == 3 and new.get("/room").json["id"] == room["id"]  # the two old ones and ours
    assert old.as_(donor).get("/room").status_code == 403
    assert sockets("/gpu", donor).is_connected("/gpu") and not sockets("/gpu", submitter).is_connected("/gpu")
    assert [(t["role"], t["legacy"]) for t in new.get("/room/tokens").json["tokens"]] == \
        [("submitter", False), ("donor", False)]

    # The other old room is untouched: its own legacy token still opens it alone.
    other = v2["rooms"][1]
    other_api = old.as_(v2["tokens"][other["id"]])
    assert other_api.get("/room").json["name"] == "v2-other" and other_api.jobs() == []
    assert other_api.get("/room/tokens").json["tokens"][0]["legacy"] is True


@pytest.mark.slow
def test_the_sdk_and_cli_rotate_a_legacy_token_and_keep_the_new_secret(v2, tmp_path):
    """A server process on the old store; the SDK's rotate keeps the token it holds in step (its
    default token and the credential store's copy take the new secret); ``zwdx room tokens``
    lists and makes tokens."""
    import subprocess
    import sys

    from procs import Server
    from zwdx import ZWDX
    from zwdx.credentials import CredentialStore
    old_store = Backend("sqlite", str(tmp_path / "server"))
    old_store.write_raw(v2["rooms"], v2["jobs"], schema_version=2, clients=v2["clients"], slots=v2["slots"])
    server = Server(old_store.where)
    try:
        room = v2["rooms"][0]
        old_token = v2["tokens"][room["id"]]
        sdk = ZWDX(server.url, room_token=old_token)
        sdk.credentials.remember_room(sdk.server_url, room["id"], old_token)
        legacy = sdk.tokens.list()[0]
        rotated = sdk.tokens.rotate(legacy["id"])
        assert sdk.room_token == rotated[0]["token"] != old_token
        assert CredentialStore().tokens(sdk.server_url) == {room["id"]: rotated[0]["token"]}
        assert sdk.get_room()["id"] == room["id"]  # the next call works

        cli = [sys.executable, "-m", "zwdx.cli", "room", "tokens"]
        env = {**os.environ, "ZWDX_ROOM_TOKEN": sdk.room_token}
        out = subprocess.run([*cli, "create", "--role", "donor", "--name", "lab-3", "--server", server.url],
                             capture_output=True, text=True, env=env, check=True).stdout
        assert "donor" in out and "lab-3" in out and "its secret, shown only now: zd_" in out, out
        listed = json.loads(subprocess.run([*cli, "list", "--json", "--server", server.url], capture_output=True,
                                           text=True, env=env, check=True).stdout)
        assert [(t["role"], t["name"], t["own"]) for t in listed] == [
            ("submitter", "room token", True), ("donor", "rotated from the room token", False),
            ("donor", "lab-3", False)]
        assert all("token" not in t and "hash" not in t for t in listed)
        out = subprocess.run([*cli, "revoke", listed[0]["id"], "--server", server.url], capture_output=True,
                             text=True, env=env)
        assert out.returncode == 1 and "last submitter token" in out.stderr, out
    finally:
        server.stop()


def test_a_revoked_legacy_token_opens_nothing(old_app, v2):
    room = v2["rooms"][0]
    old = Api(old_app.test_client(), v2["tokens"][room["id"]])
    made = old.post("/room/tokens", json={"role": "submitter", "name": "new owner"}).json
    legacy = old.get("/room/tokens").json["tokens"][0]
    assert old.request("DELETE", f"/room/tokens/{legacy['id']}").json["revoked_at"] is not None
    resp = old.get("/room")
    assert resp.status_code == 401 and "revoked" in resp.json["error"]["message"]
    assert old.as_(made["token"]).get("/room").status_code == 200
