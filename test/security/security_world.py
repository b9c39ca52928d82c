"""A small world of strangers for the security tests: two rooms on one in-process app, over
either store, with every kind of credential the server hands out.

    room A   submitter token, donor token, a legacy (zr_) token; GPU clients a1 and a2 (two CPU
             slots each, registered over Socket.IO, their client secrets known); jobs:
               live    world size 2, attempt 1 (rank 0 on a1, rank 1 on a2); the rank keys of
                       attempt 1 and rank 0's key of attempt 0 (an old attempt) are known; a
                       DILOCO job (its ranks have rounds too)
               ended   cancelled (its rank 0's key known)
               done    completed by rank 0 with uploaded weights
    room A   also a revoked submitter token
    room B   submitter token, donor token; GPU client b1

Jobs are placed as the scheduler places them (``zwdx.server.jobs.Job.start``, which stores only
the hashes of the keys) under keys the test made, and move by the server's own ``Job`` moves
and REST routes. ``snapshot(world)`` is everything stored (every table or collection, and the
artifact bytes), to check that a refused request changed nothing.

    from security_world import *   # fixtures: world, shared_world (and backend, mongo_uri, ...)

``world`` is a fresh World per test (over the ``backend`` fixture); ``shared_world`` one per
backend for a module whose tests only add to it (new rooms, jobs, tokens, artifacts, events)
and never end its live job or change its clients: building a World takes a second or two,
which the authorization matrix would otherwise pay 60 times.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sqlite3
import uuid
from dataclasses import dataclass, field

import pytest

from store_backends import *  # noqa: F401,F403  (fixtures: backend, mongo_uri, ...)
from store_backends import BACKENDS, Backend, with_database
from zwdx import defaults
from wire_auth import connect_auth

__all__ = ["World", "world", "shared_world", "snapshot", "HELLO", "backend", "mongo_server", "mongo_uri"]

#: A GPU client's register, less its id and secret.
HELLO = {"hostname": "h", "versions": {"python": platform.python_version()},
         "slots": [{"index": i, "kind": "cpu", "memory_total": 1 << 30, "memory_free": 1 << 30} for i in range(2)]}


@dataclass
class World:
    app: object
    backend: object
    client: object                          # Flask's test client
    rooms: dict = field(default_factory=dict)       # "A"/"B" -> the answer that made it
    tokens: dict = field(default_factory=dict)      # "submitter", "donor", "legacy", "other_submitter", ...
    secrets: dict = field(default_factory=dict)     # client id -> its client secret
    sockets: dict = field(default_factory=dict)     # client id -> its /gpu test client
    jobs: dict = field(default_factory=dict)        # "live", "ended", "done" -> job id
    keys: dict = field(default_factory=dict)        # "rank0", "rank1", "old_attempt", "ended" -> a rank key
    bundle: str = ""                                # the live job's bundle (room A)
    weights: str = ""                               # the done job's weights (room A)
    dataset: dict = field(default_factory=dict)     # room A's dataset "tiny", which the live job uses: version, chunk
    _mongo: object = None                           # the snapshot's MongoDB client, kept

    @property
    def store(self):
        return self.app.extensions["zwdx"].store

    def request(self, method: str, path: str, headers: dict | None = None, **kwargs):
        """A REST call: ``path`` under /api/v1 (a path outside it: ``url=``)."""
        url = kwargs.pop("url", None) or f"{defaults.API_PREFIX}{path}"
        return self.client.open(url, method=method, headers=headers or {}, **kwargs)

    def as_submitter(self, room: str = "A") -> dict:
        return {defaults.TOKEN_HEADER: self.rooms[room]["submitter_token"]}

    def as_rank(self, key: str) -> dict:
        return {defaults.RANK_KEY_HEADER: self.keys[key]}

    def submit(self, room: str = "A", **fields) -> dict:
        """A queued job of the room (its own bundle)."""
        headers = self.as_submitter(room)
        bundle = self.request("POST", "/artifacts", headers, data=f"bundle {uuid.uuid4().hex}".encode()).json
        resp = self.request("POST", "/jobs", headers, json={
            "bundle_artifact": bundle["id"], "versions": {"python": platform.python_version()}, **fields})
        assert resp.status_code == 201, resp.text
        return resp.json

    def push_dataset(self, name: str, data: bytes | None = None) -> dict:
        """A dataset of room A of one file, one chunk: ``{"version", "chunk", "data"}``."""
        import hashlib
        data = data or f"a dataset {uuid.uuid4().hex}".encode()
        chunk = hashlib.sha256(data).hexdigest()
        resp = self.request("PUT", f"/datasets/chunks/{chunk}", self.as_submitter(), data=data)
        assert resp.status_code in (200, 201), resp.text
        resp = self.request("POST", "/datasets", self.as_submitter(), json={
            "name": name, "chunk_bytes": 1024, "files": [{"path": "x", "size": len(data), "sha256": chunk,
                                                          "chunks": [chunk]}]})
        assert resp.status_code == 201, resp.text
        return {"version": resp.json["latest"]["version"], "chunk": chunk, "data": data}

    def place(self, job_id: str, ranks: dict[int, str], keys: dict[int, str]) -> None:
        """Place the job as the scheduler does: rank -> slot id, under these rank keys."""
        from zwdx.protocol import SlotKind
        from zwdx.protocol.job import PlacementEntry
        from zwdx.server.auth import hash_secret
        from zwdx.server.jobs import Job
        placement = [PlacementEntry(rank=rank, client_id=slot.split(":")[0], gpu_index=int(slot.split(":")[1]),
                                    kind=SlotKind.CPU) for rank, slot in sorted(ranks.items())]
        job = Job.load(self.store, job_id)
        assert job.start(placement, [ranks[r] for r in sorted(ranks)], {r: hash_secret(k) for r, k in keys.items()})

    def register(self, client_id: str, token: str):
        from zwdx.server import socketio
        sock = socketio.test_client(self.app, namespace="/gpu", auth=connect_auth(token))
        answer = sock.emit("register", {"client_id": client_id, **HELLO}, namespace="/gpu", callback=True)
        assert answer["ok"], answer
        self.secrets[client_id], self.sockets[client_id] = answer["client_secret"], sock
        return sock


def _room(client, name: str) -> dict:
    """A new room: the answer, with its two tokens."""
    resp = client.post(f"{defaults.API_PREFIX}/rooms", json={"name": name})
    assert resp.status_code == 201, resp.text
    return resp.json


def build(app, backend: Backend) -> World:
    """The world (see the module's docstring) on a fresh app over ``backend``."""
    from zwdx.server.auth import hash_secret
    from zwdx.server.jobs import Job
    w = World(app=app, backend=backend, client=app.test_client())
    w.rooms = {"A": _room(w.client, "A"), "B": _room(w.client, "B")}
    legacy = f"zr_{uuid.uuid4().hex}{uuid.uuid4().hex}"
    w.store.add_credential({"id": "a-legacy", "room_id": w.rooms["A"]["id"], "role": "submitter", "name": "old",
                            "hash": hash_secret(legacy), "created_at": 1.0, "rotated_at": None, "revoked_at": None,
                            "legacy": True})
    revoked = w.request("POST", "/room/tokens", w.as_submitter(), json={"role": "submitter", "name": "gone"}).json
    assert w.request("DELETE", f"/room/tokens/{revoked['id']}", w.as_submitter()).status_code == 200
    w.tokens = {"submitter": w.rooms["A"]["submitter_token"], "donor": w.rooms["A"]["donor_token"], "legacy": legacy,
                "revoked": revoked["token"], "other_submitter": w.rooms["B"]["submitter_token"],
                "other_donor": w.rooms["B"]["donor_token"]}
    for client_id, room in (("a1", "A"), ("a2", "A"), ("b1", "B")):
        w.register(client_id, w.rooms[room]["donor_token"])

    w.dataset = w.push_dataset("tiny")
    live = w.submit(world_size=2, parallelism="DILOCO", datasets=["tiny"])
    w.jobs["live"], w.bundle = live["id"], live["spec"]["code"]["bundle_artifact"]
    w.keys["old_attempt"], old_rank1 = f"rk_old0_{uuid.uuid4().hex}", f"rk_old1_{uuid.uuid4().hex}"
    w.place(live["id"], {0: "a1:0", 1: "a2:0"}, {0: w.keys["old_attempt"], 1: old_rank1})
    assert Job.load(w.store, live["id"]).interrupt("gpu client a2 lost (staged)") is not None  # -> resuming
    w.store.release_slots(live["id"])
    w.keys["rank0"], w.keys["rank1"] = f"rk_live0_{uuid.uuid4().hex}", f"rk_live1_{uuid.uuid4().hex}"
    w.place(live["id"], {0: "a1:0", 1: "a2:0"}, {0: w.keys["rank0"], 1: w.keys["rank1"]})
    assert w.store.get_job(live["id"]).attempt == 1

    ended = w.submit(world_size=1)
    w.jobs["ended"], w.keys["ended"] = ended["id"], f"rk_ended_{uuid.uuid4().hex}"
    w.place(ended["id"], {0: "a2:1"}, {0: w.keys["ended"]})
    assert Job.load(w.store, ended["id"]).cancel("cancelled by the submitter (staged)")
    w.store.release_slots(ended["id"])

    done = w.submit(world_size=1)
    w.jobs["done"], done_key = done["id"], f"rk_done_{uuid.uuid4().hex}"
    w.place(done["id"], {0: "a1:1"}, {0: done_key})
    rank = {defaults.RANK_KEY_HEADER: done_key}
    weights = w.request("PUT", f"/jobs/{done['id']}/weights", rank, data=b"trained weights").json
    w.weights = weights["id"]
    resp = w.request("POST", f"/jobs/{done['id']}/ranks/0", rank, json={"status": "completed", "final_loss": 0.25,
                                                                       "weights_artifact": weights["id"]})
    assert resp.json == {"ok": True}, resp.text
    assert w.store.get_job(done["id"]).status == "completed"
    return w


def _leave(w: World) -> None:
    for sock in w.sockets.values():
        if sock.is_connected("/gpu"):
            sock.disconnect(namespace="/gpu")
    if w._mongo is not None:
        w._mongo.close()


@pytest.fixture
def world(backend, make_app, tmp_path) -> World:
    if backend.name == "sqlite":
        app = make_app(DATA_DIR=backend.where)
    else:
        app = make_app(DATA_DIR=str(tmp_path / "mongo-app"), MONGO_URI=backend.where)
    w = build(app, backend)
    yield w
    _leave(w)


@pytest.fixture(scope="module", params=BACKENDS)
def shared_world(request, tmp_path_factory) -> World:
    from zwdx.server import create_app
    base = tmp_path_factory.mktemp("world")
    if request.param == "sqlite":
        backend = Backend("sqlite", str(base / "data"))
        config = {"DATA_DIR": backend.where}
    else:
        name = f"zwdx_test_{uuid.uuid4().hex[:12]}"
        backend = Backend("mongo", with_database(request.getfixturevalue("mongo_server").uri, name))
        config = {"DATA_DIR": str(base / "mongo-app"), "MONGO_URI": backend.where}
    # Its tests ask with hundreds of wrong credentials from one address: not rate-limited here.
    app = create_app({"MONGO_URI": None, "SCHEDULER": False, "TESTING": True,
                      "RATE_LIMIT_AUTH_FAILURES": "100000 per minute", "RATE_LIMIT_LINK": "100000 per minute",
                      **config})
    try:
        w = build(app, backend)
        yield w
        _leave(w)
    finally:
        app.extensions["zwdx"].close()
        if request.param == "mongo":
            from pymongo import MongoClient
            with MongoClient(backend.where, serverSelectionTimeoutMS=2000) as client:
                client.drop_database(name)


def snapshot(w: World) -> dict:
    """Everything the world's store and artifact store hold, as comparable JSON: every table or
    collection (on MongoDB, GridFS's chunks hold the artifact bytes), and on files the artifact
    directory's names (partial uploads too) and each artifact's bytes (their sha256)."""
    if w.backend.name == "mongo":
        return _collections(w)
    conn = sqlite3.connect(os.path.join(w.backend.where, "zwdx.sqlite3"))
    try:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        held = {t: sorted(json.dumps(row, default=str) for row in conn.execute(f"SELECT * FROM {t}"))
                for t in tables}
    finally:
        conn.close()
    folder = os.path.join(w.backend.where, "artifacts")
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    held["artifact files"] = names
    held["artifact bytes"] = {}
    for name in names:
        with open(os.path.join(folder, name), "rb") as fh:
            held["artifact bytes"][name] = hashlib.sha256(fh.read()).hexdigest()
    return held


def _collections(w: World) -> dict:
    """Every collection of the database, each document as JSON. nx-27017 lists a GridFS
    bucket's files collection by the table behind it (``artifacts_files``), and a find on that
    name never answers (the socket waits for a reply that does not come): it is read by its
    GridFS name, ``artifacts.files``. The socket timeout turns any other such wait into a failure."""
    if w._mongo is None:
        from pymongo import MongoClient
        w._mongo = MongoClient(w.backend.where, socketTimeoutMS=20_000, serverSelectionTimeoutMS=5_000)
    db = w._mongo.get_default_database()
    names = set(db.list_collection_names())
    buckets = {n[:-len("_files")] for n in names if n.endswith("_files") and n[:-len("_files")] + "_chunks" in names}
    names = {f"{n[:-len('_files')]}.files" if n[:-len("_files")] in buckets else n for n in names}
    return {name: sorted(json.dumps(doc, default=str, sort_keys=True) for doc in db[name].find({}))
            for name in sorted(names)}
