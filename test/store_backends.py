"""Store backends for tests: the embedded SQLite file, and MongoDB over its wire protocol.

MongoDB is an ``nx-27017 --db memory`` server started once per test session on a free
127.0.0.1 port, or the real server that ``ZWDX_TEST_MONGO_URI`` names. Every test gets a
fresh database (dropped afterwards). Import the fixtures into a test module with
``from store_backends import *``.

    store             an open Store, once per backend ("sqlite", "mongo")
    backend           the Backend behind it: open() another Store on the same data, spec, ...
    artifact_store    an ArtifactBackend: files in a directory, or GridFS
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import needs  # noqa: E402
from procs import free_port, wait_until  # noqa: E402

__all__ = ["MONGO_ENV", "Backend", "ArtifactBackend", "open_spec", "mongo_server", "mongo_uri", "backend",
           "store", "artifact_store", "job_record"]

#: A MongoDB URI to run the store tests against instead of nx-27017.
MONGO_ENV = "ZWDX_TEST_MONGO_URI"
#: The backends a store test runs on. The MongoDB half starts nx-27017 (a process) and asks it
#: over the network: the slow lane runs it, the fast lane the SQLite half.
BACKENDS = ["sqlite", pytest.param("mongo", marks=pytest.mark.slow)]


def with_database(uri: str, name: str) -> str:
    """The URI with its database replaced by ``name`` (credentials keep authenticating
    against the database they named, or admin)."""
    scheme, rest = uri.split("://", 1)
    hosts, _, path_query = rest.partition("/")
    path, _, query = path_query.partition("?")
    options = [o for o in query.split("&") if o]
    if "@" in hosts and not any(o.lower().startswith("authsource=") for o in options):
        options.append(f"authSource={path or 'admin'}")
    return f"{scheme}://{hosts}/{name}" + (f"?{'&'.join(options)}" if options else "")


class MongoServer:
    """nx-27017 in memory, our child process; or the server ZWDX_TEST_MONGO_URI names."""

    def __init__(self, workdir: str):
        self.proc = None
        self.uri = os.environ.get(MONGO_ENV)
        if self.uri:
            return
        exe = needs.tool("nx-27017", "pip install nx-27017, a MongoDB wire-protocol server (./setup.sh --test)")
        port = free_port()
        self.log_path = os.path.join(workdir, "nx-27017.log")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([exe, "--db", "memory", "--host", "127.0.0.1", "-p", str(port),
                                      "--pid-file", os.path.join(workdir, "nx-27017.pid"),
                                      "--log-file", self.log_path],
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.uri = f"mongodb://127.0.0.1:{port}/"
        wait_until(self._answers, 30, 0.1, what=f"nx-27017 on port {port}")

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"nx-27017 exited with {self.proc.returncode}; log in {self.log_path}")
        from pymongo import MongoClient
        from pymongo.errors import PyMongoError
        client = MongoClient(self.uri, serverSelectionTimeoutMS=300)
        try:
            return client.admin.command("ping").get("ok") == 1
        except PyMongoError:
            return False
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self._log.close()


@pytest.fixture(scope="session")
def mongo_server(tmp_path_factory):
    """nx-27017 for the session (a process: a test that asks for it is slow; conftest marks it)."""
    server = MongoServer(str(tmp_path_factory.mktemp("mongo")))
    yield server
    server.stop()


@pytest.fixture
def mongo_uri(mongo_server):
    """A URI naming a database no other test uses; dropped after the test."""
    name = f"zwdx_test_{uuid.uuid4().hex[:12]}"
    uri = with_database(mongo_server.uri, name)
    yield uri
    from pymongo import MongoClient
    client = MongoClient(uri, serverSelectionTimeoutMS=2000)
    try:
        client.drop_database(name)
    except Exception:  # nx-27017 in memory forgets it anyway
        pass
    finally:
        client.close()


def open_spec(spec: tuple[str, str]):
    """Open the store a spec names: ("sqlite", data_dir) or ("mongo", uri). Picklable, so
    other processes open the same store."""
    from zwdx.server.store import open_store
    kind, where = spec
    return open_store(where, None) if kind == "sqlite" else open_store("", where)


def job_record(job_id: str, room_id: str = "r1", status: str = "queued", world_size: int | None = 2, **fields):
    """A job's record as the server submits it (``zwdx.protocol.job.Job``), with ``fields`` on top."""
    from zwdx.protocol.job import Job, JobSpec, TimelineEntry
    spec = JobSpec(world_size=world_size, versions={"python": "3.11"}, bundle_artifact=f"bundle-{job_id}",
                   bundle_sha256="ab" * 32)
    return Job(**{"id": job_id, "room_id": room_id, "status": status, "name": job_id, "created_at": 2.0, "spec": spec,
                  "timeline": [TimelineEntry(status=status, at=2.0)], **fields})


class Backend:
    """One store location of one backend; ``open()`` gives as many Store objects on it as
    a test wants (as several server processes would have)."""

    def __init__(self, name: str, where: str):
        self.name, self.where = name, where
        self.spec = (name, where)
        self._opened = []

    def open(self):
        store = open_spec(self.spec)
        self._opened.append(store)
        return store

    def close_all(self) -> None:
        for store in self._opened:
            store.close()

    @property
    def module(self):
        """The backend's database module: its ``MIGRATIONS``."""
        from zwdx.server.store import mongo_db, sqlite_db
        return sqlite_db if self.name == "sqlite" else mongo_db

    def write_raw(self, rooms: list[dict], jobs: list[dict], schema_version: int, clients: list[dict] = (),
                  slots: list[dict] = ()) -> None:
        """Write rooms, job documents (and GPU clients and their slots) as they are, in a store
        of that schema version, as an older zwdx left them (the tables and collections this zwdx
        creates, no migration; before layout 3, rooms with their token's hash, unique)."""
        if self.name == "sqlite":
            import json
            import sqlite3
            from zwdx.server.store.sqlite_db import DDL
            os.makedirs(self.where, exist_ok=True)
            conn = sqlite3.connect(os.path.join(self.where, "zwdx.sqlite3"))
            with conn:
                if schema_version < 3:
                    conn.execute("CREATE TABLE rooms (id TEXT PRIMARY KEY, token_hash TEXT UNIQUE NOT NULL, "
                                 "doc TEXT NOT NULL)")
                conn.executescript(DDL)
                conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(schema_version),))
                for room in rooms:
                    if schema_version < 3:
                        conn.execute("INSERT INTO rooms VALUES (?, ?, ?)",
                                     (room["id"], room["token_hash"], json.dumps(room)))
                    else:
                        conn.execute("INSERT INTO rooms VALUES (?, ?)", (room["id"], json.dumps(room)))
                for job in jobs:
                    conn.execute("INSERT INTO jobs (seq, id, room_id, status, doc) VALUES (?, ?, ?, ?, ?)",
                                 (job["seq"], job["id"], job["room_id"], job["status"], json.dumps(job)))
                for client in clients:
                    conn.execute("INSERT INTO clients VALUES (?, ?, ?)", (client["id"], client["room_id"],
                                                                         json.dumps(client)))
                for slot in slots:
                    doc = {k: v for k, v in slot.items() if k not in ("job_id", "rank")}
                    conn.execute("INSERT INTO slots VALUES (?, ?, ?, ?, ?, ?, ?)",
                                 (slot["id"], slot["client_id"], slot["room_id"], slot["index"], slot.get("job_id"),
                                  slot.get("rank"), json.dumps(doc)))
            conn.close()
        else:
            from pymongo import MongoClient
            client = MongoClient(self.where)
            db = client.get_default_database()
            db.meta.insert_one({"_id": "schema", "version": schema_version})
            if schema_version < 3:
                db.rooms.create_index("token_hash", unique=True)
            for room in rooms:
                db.rooms.insert_one({**room, "_id": room["id"]})
            for job in jobs:
                db.jobs.insert_one({**job, "_id": job["id"], "_rev": 0})
            for order, gpu in enumerate(clients):
                db.clients.insert_one({"_id": gpu["id"], "room_id": gpu["room_id"], "doc": gpu, "_order": order + 1})
            if clients:
                db.counters.insert_one({"_id": "clients", "n": len(clients)})
            for slot in slots:
                doc = {k: v for k, v in slot.items() if k not in ("job_id", "rank")}
                db.slots.insert_one({"_id": slot["id"], "client_id": slot["client_id"], "room_id": slot["room_id"],
                                     "index": slot["index"], "doc": doc, "job_id": slot.get("job_id"),
                                     "rank": slot.get("rank")})
            client.close()

    def set_schema_version(self, version: int) -> None:
        """Write a schema version into the store, as another zwdx would have."""
        if self.name == "sqlite":
            import sqlite3
            conn = sqlite3.connect(os.path.join(self.where, "zwdx.sqlite3"))
            with conn:
                conn.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(version),))
            conn.close()
        else:
            from pymongo import MongoClient
            client = MongoClient(self.where)
            client.get_default_database().meta.update_one({"_id": "schema"}, {"$set": {"version": version}})
            client.close()

    def indexes(self, table: str) -> dict[tuple[str, ...], bool]:
        """The table's (collection's) indexes: key columns -> unique."""
        if self.name == "sqlite":
            import sqlite3
            conn = sqlite3.connect(os.path.join(self.where, "zwdx.sqlite3"))
            try:
                return {tuple(c[2] for c in conn.execute(f"PRAGMA index_info('{name}')")): bool(unique)
                        for _, name, unique, *_ in conn.execute(f"PRAGMA index_list('{table}')")}
            finally:
                conn.close()
        from pymongo import MongoClient
        client = MongoClient(self.where)
        try:
            info = client.get_default_database()[table].index_information()
            return {tuple(k for k, _ in i["key"]): bool(i.get("unique")) for i in info.values()}
        finally:
            client.close()

    def migration_probe(self):
        """A migration step in this backend's form, and a check that it ran."""
        if self.name == "sqlite":
            def step(db):
                db.execute("INSERT INTO meta VALUES ('probe', 'migrated')")

            def ran():
                import sqlite3
                conn = sqlite3.connect(os.path.join(self.where, "zwdx.sqlite3"))
                try:
                    return conn.execute("SELECT value FROM meta WHERE key='probe'").fetchone() is not None
                finally:
                    conn.close()
        else:
            def step(db):
                db.meta.update_one({"_id": "probe"}, {"$set": {"value": "migrated"}}, upsert=True)

            def ran():
                from pymongo import MongoClient
                client = MongoClient(self.where)
                try:
                    return client.get_default_database().meta.find_one({"_id": "probe"}) is not None
                finally:
                    client.close()
        return step, ran


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path):
    if request.param == "sqlite":
        b = Backend("sqlite", str(tmp_path / "data"))
    else:
        b = Backend("mongo", request.getfixturevalue("mongo_uri"))
    yield b
    b.close_all()


@pytest.fixture
def store(backend):
    return backend.open()


class ArtifactBackend:
    """An ArtifactStore and a way to see what it holds, to check a failed upload left nothing."""

    def __init__(self, name: str, tmp_path, mongo_uri: str | None = None):
        from zwdx.server.artifacts import FileArtifactStore
        self.name = name
        if name == "files":
            self.root = str(tmp_path / "artifacts")
            self.store = FileArtifactStore(self.root)
        else:
            from zwdx.server.store.gridfs import GridFSArtifactStore
            self.uri = mongo_uri
            self.store = GridFSArtifactStore(mongo_uri)

    def reopen(self):
        """A new ArtifactStore on the same bytes (a restarted server)."""
        if self.name == "files":
            from zwdx.server.artifacts import FileArtifactStore
            return FileArtifactStore(self.root)
        from zwdx.server.store.gridfs import GridFSArtifactStore
        return GridFSArtifactStore(self.uri)

    def held(self) -> list[str]:
        """Everything kept: file names, or GridFS files and chunks' file ids."""
        if self.name == "files":
            return sorted(os.listdir(self.root))
        db = self.store.db
        bucket = self.store.BUCKET
        files = [str(d["_id"]) for d in db[f"{bucket}.files"].find({}, {"_id": 1})]
        chunks = {str(d["files_id"]) for d in db[f"{bucket}.chunks"].find({}, {"files_id": 1})}
        return sorted(set(files) | chunks)


@pytest.fixture(params=["files", pytest.param("gridfs", marks=pytest.mark.slow)])
def artifact_store(request, tmp_path):
    uri = request.getfixturevalue("mongo_uri") if request.param == "gridfs" else None
    backend = ArtifactBackend(request.param, tmp_path, uri)
    yield backend
    if request.param == "gridfs":
        backend.store.close()
