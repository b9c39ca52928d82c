"""The embedded store: one SQLite database file in the data dir, no setup.

Documents are kept as JSON next to the columns the server filters on. Writes that must be
atomic run inside ``BEGIN IMMEDIATE`` transactions, which serialise writers across threads
and processes that share the file.

Connections come from a small pool: a call takes one (or opens one when every pooled one is
in use), and gives it back when done; ``POOL_SIZE`` idle ones are kept. That serves OS threads
and gevent's greenlets alike (a greenlet never holds one across a switch: SQLite calls do not
yield to the hub), without a connection per thread or greenlet ever started.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import sqlite3
from collections import deque
from contextlib import contextmanager
from typing import Iterable

from ...errors import SchemaVersionError, StoreError
from .base import SCHEMA_VERSION, SLOT_STATS, Store

log = logging.getLogger(__name__)

#: Idle connections kept for the next call.
POOL_SIZE = 8

_DDL = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS rooms (id TEXT PRIMARY KEY, token_hash TEXT UNIQUE NOT NULL, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS clients (id TEXT PRIMARY KEY, room_id TEXT NOT NULL, doc TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS clients_room ON clients (room_id);
CREATE TABLE IF NOT EXISTS slots (id TEXT PRIMARY KEY, client_id TEXT NOT NULL, room_id TEXT NOT NULL,
    idx INTEGER NOT NULL, job_id TEXT, rank INTEGER, doc TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS slots_room ON slots (room_id, client_id, idx);
CREATE INDEX IF NOT EXISTS slots_job ON slots (job_id);
CREATE TABLE IF NOT EXISTS jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL,
    room_id TEXT NOT NULL, status TEXT NOT NULL, doc TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS jobs_room_status ON jobs (room_id, status, seq);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs (status, seq);
CREATE TABLE IF NOT EXISTS events (job_id TEXT NOT NULL, seq INTEGER NOT NULL, kind TEXT NOT NULL,
    rank INTEGER, key TEXT, doc TEXT NOT NULL, PRIMARY KEY (job_id, seq));
CREATE UNIQUE INDEX IF NOT EXISTS events_dedup ON events (job_id, rank, key);
CREATE INDEX IF NOT EXISTS events_kind ON events (job_id, kind, seq);
CREATE TABLE IF NOT EXISTS artifacts (id TEXT PRIMARY KEY, job_id TEXT, kind TEXT, doc TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS artifacts_job ON artifacts (job_id, kind);
"""

#: Migrations from version N to N+1, each a list of SQL statements.
MIGRATIONS: dict[int, list[str]] = {}



def _set_path(doc: dict, dotted: str, value) -> None:
    """Set ``doc["a"]["b"] = value`` for ``"a.b"``, creating dicts on the way (as MongoDB's $set)."""
    *parents, last = dotted.split(".")
    for part in parents:
        doc = doc.setdefault(part, {})
    doc[last] = value


def _dump(doc: dict) -> str:
    return json.dumps(doc, separators=(",", ":"))


def _json_set(fields: dict) -> tuple[str, tuple]:
    """SQL that sets top-level fields of the ``doc`` column in place (SQLite's json_set, no
    decoding in Python), and its arguments."""
    return _json_set_sql(tuple(fields)), tuple(_dump(value) for value in fields.values())


@functools.lru_cache(maxsize=64)
def _json_set_sql(keys: tuple[str, ...]) -> str:
    if not keys:
        return "doc"
    for key in keys:
        if not key.isidentifier():
            raise ValueError(f"cannot set field {key!r} in place")
    return "json_set(doc, " + ", ".join(f"'$.{key}', json(?)" for key in keys) + ")"


class SQLiteStore(Store):
    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._idle: deque[sqlite3.Connection] = deque()  # append and pop are atomic
        with self._conn() as conn:
            conn.executescript(_DDL)
        self._check_schema()

    # -- plumbing ----------------------------------------------------------------------------
    def _open(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA busy_timeout=30000")
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the embedded store at {self.path}: {exc}") from exc
        return conn

    @contextmanager
    def _conn(self):
        """A connection of the pool for the length of one call."""
        try:
            conn = self._idle.pop()
        except IndexError:
            conn = self._open()
        try:
            yield conn
        finally:
            if len(self._idle) < POOL_SIZE:
                self._idle.append(conn)
            else:
                conn.close()

    @contextmanager
    def _tx(self):
        with self._conn() as conn:
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise StoreError(f"embedded store busy or broken: {exc}") from exc
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            else:
                conn.execute("COMMIT")

    def _check_schema(self) -> None:
        rows = self._q("SELECT value FROM meta WHERE key='schema_version'")
        if not rows:
            with self._tx() as db:
                db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            return
        found = int(rows[0][0])
        if found > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"the store at {self.path} has schema version {found}, newer than this zwdx "
                f"understands ({SCHEMA_VERSION}); upgrade zwdx", found=found, supported=SCHEMA_VERSION)
        while found < SCHEMA_VERSION:
            with self._tx() as db:
                for stmt in MIGRATIONS.get(found, []):
                    db.execute(stmt)
                found += 1
                db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(found),))
            log.info("store: migrated %s to schema version %d", self.path, found)

    def _q(self, sql: str, args: tuple = ()) -> list:
        with self._conn() as conn:
            try:
                return conn.execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                raise StoreError(f"embedded store query failed: {exc}") from exc

    # -- lifecycle -------------------------------------------------------------------------
    def ping(self) -> bool:
        try:
            self._q("SELECT 1")
            return True
        except StoreError:
            return False

    def schema_version(self) -> int:
        return int(self._q("SELECT value FROM meta WHERE key='schema_version'")[0][0])

    def close(self) -> None:
        while self._idle:
            try:
                self._idle.pop().close()
            except (IndexError, sqlite3.Error):
                pass

    # -- rooms -----------------------------------------------------------------------------
    def create_room(self, room: dict) -> dict:
        try:
            with self._tx() as db:
                db.execute("INSERT INTO rooms VALUES (?, ?, ?)", (room["id"], room["token_hash"], _dump(room)))
        except sqlite3.IntegrityError as exc:
            raise StoreError(f"room {room['id']} already exists: {exc}") from exc
        return room

    def get_room(self, room_id: str) -> dict | None:
        rows = self._q("SELECT doc FROM rooms WHERE id=?", (room_id,))
        return json.loads(rows[0][0]) if rows else None

    def find_room_by_token_hash(self, token_hash: str) -> dict | None:
        rows = self._q("SELECT doc FROM rooms WHERE token_hash=?", (token_hash,))
        return json.loads(rows[0][0]) if rows else None

    # -- GPU clients and slots --------------------------------------------------------------
    def upsert_client(self, client: dict, slots: list[dict]) -> None:
        with self._tx() as db:
            db.execute("INSERT INTO clients VALUES (?, ?, ?) ON CONFLICT(id) DO UPDATE SET "
                       "room_id=excluded.room_id, doc=excluded.doc",
                       (client["id"], client["room_id"], _dump(client)))
            keep = [s["id"] for s in slots]
            db.execute(f"DELETE FROM slots WHERE client_id=? AND job_id IS NULL AND id NOT IN "
                       f"({','.join('?' * len(keep))})", (client["id"], *keep))
            for slot in slots:
                db.execute("INSERT INTO slots (id, client_id, room_id, idx, doc) VALUES (?, ?, ?, ?, ?) "
                           "ON CONFLICT(id) DO UPDATE SET doc=excluded.doc, room_id=excluded.room_id",
                           (slot["id"], client["id"], client["room_id"], slot["index"], _dump(slot)))

    def get_client(self, client_id: str) -> dict | None:
        rows = self._q("SELECT doc FROM clients WHERE id=?", (client_id,))
        return json.loads(rows[0][0]) if rows else None

    def list_clients(self, room_id: str | None, lost_before: float | None = None) -> list[dict]:
        where, args = "WHERE 1=1", ()
        if room_id is not None:
            where, args = where + " AND room_id=?", args + (room_id,)
        if lost_before is not None:  # json_extract in SQLite: no client decoded that is not asked for
            where, args = where + " AND json_extract(doc, '$.lost_after') < ?", args + (float(lost_before),)
        clients = [json.loads(r[0]) for r in self._q(f"SELECT doc FROM clients {where} ORDER BY rowid", args)]
        return self._with_slots(clients, room_id, every=lost_before is None)

    def update_client(self, client_id: str, changes: dict) -> None:
        with self._tx() as db:
            row = db.execute("SELECT doc FROM clients WHERE id=?", (client_id,)).fetchone()
            if row is None:
                return
            doc = json.loads(row[0])
            doc.update(changes)
            db.execute("UPDATE clients SET doc=? WHERE id=?", (_dump(doc), client_id))

    def touch_client(self, client_id: str, changes: dict, stats: list[dict],
                     expect_status: str | None = None) -> bool:
        set_client, args = _json_set(changes)
        where = "id=?" + (" AND json_extract(doc, '$.status')=?" if expect_status is not None else "")
        args += (client_id,) + ((expect_status,) if expect_status is not None else ())
        with self._tx() as db:
            if db.execute(f"UPDATE clients SET doc={set_client} WHERE {where}", args).rowcount != 1:
                return False
            for stat in stats:
                fields = {k: stat[k] for k in SLOT_STATS if k in stat}
                if fields:
                    set_slot, slot_args = _json_set(fields)
                    db.execute(f"UPDATE slots SET doc={set_slot} WHERE client_id=? AND idx=?",
                               (*slot_args, client_id, stat["index"]))
        return True

    def list_slots(self, room_id: str | None, client_id: str | None = None) -> list[dict]:
        out = []
        where, args = "WHERE 1=1", ()
        if room_id is not None:
            where, args = where + " AND room_id=?", args + (room_id,)
        if client_id is not None:
            where, args = where + " AND client_id=?", args + (client_id,)
        for doc, job_id, rank in self._q(
                f"SELECT doc, job_id, rank FROM slots {where} ORDER BY client_id, idx", args):
            slot = json.loads(doc)
            slot["job_id"], slot["rank"] = job_id, rank
            out.append(slot)
        return out

    def reserve_slots(self, job_id: str, assignments: list[tuple[str, int]], changes: dict) -> bool:
        try:
            return self._reserve(job_id, assignments, changes)
        except _Abort:
            return False

    def _reserve(self, job_id, assignments, changes) -> bool:
        with self._tx() as db:
            row = db.execute("SELECT status, doc FROM jobs WHERE id=?", (job_id,)).fetchone()
            if row is None or row[0] not in ("queued", "resuming"):
                return False
            for slot_id, rank in assignments:
                cur = db.execute("UPDATE slots SET job_id=?, rank=? WHERE id=? AND job_id IS NULL",
                                 (job_id, rank, slot_id))
                if cur.rowcount != 1:
                    raise _Abort()
            doc = json.loads(row[1])
            doc.update(changes)
            db.execute("UPDATE jobs SET status=?, doc=? WHERE id=?", (doc["status"], _dump(doc), job_id))
        return True

    def release_slots(self, job_id: str, client_id: str | None = None) -> int:
        with self._tx() as db:
            if client_id is None:
                cur = db.execute("UPDATE slots SET job_id=NULL, rank=NULL WHERE job_id=?", (job_id,))
            else:
                cur = db.execute("UPDATE slots SET job_id=NULL, rank=NULL WHERE job_id=? AND client_id=?",
                                 (job_id, client_id))
            return cur.rowcount

    # -- jobs ------------------------------------------------------------------------------
    def create_job(self, job: dict) -> dict:
        with self._tx() as db:
            cur = db.execute("INSERT INTO jobs (id, room_id, status, doc) VALUES (?, ?, ?, ?)",
                             (job["id"], job["room_id"], job["status"], "{}"))
            job = {**job, "seq": cur.lastrowid}
            db.execute("UPDATE jobs SET doc=? WHERE id=?", (_dump(job), job["id"]))
        return job

    def get_job(self, job_id: str) -> dict | None:
        rows = self._q("SELECT doc FROM jobs WHERE id=?", (job_id,))
        return json.loads(rows[0][0]) if rows else None

    def count_jobs(self, room_id: str, statuses: Iterable[str], before_seq: int | None = None) -> int:
        statuses = [str(getattr(s, "value", s)) for s in statuses]
        sql = f"SELECT COUNT(*) FROM jobs WHERE room_id=? AND status IN ({','.join('?' * len(statuses))})"
        args = [room_id, *statuses]
        if before_seq is not None:
            sql += " AND seq<?"
            args.append(int(before_seq))
        return int(self._q(sql, tuple(args))[0][0])

    def list_jobs(self, room_id=None, statuses=None, limit=None) -> list[dict]:
        sql, args = "SELECT doc FROM jobs WHERE 1=1", []
        if room_id is not None:
            sql += " AND room_id=?"
            args.append(room_id)
        if statuses is not None:
            statuses = [str(getattr(s, "value", s)) for s in statuses]
            sql += f" AND status IN ({','.join('?' * len(statuses))})"
            args += statuses
        sql += " ORDER BY seq"
        if limit:
            sql += f" LIMIT {int(limit)}"
        return [json.loads(r[0]) for r in self._q(sql, tuple(args))]

    def update_job(self, job_id, changes, expect_status=None, push=None) -> dict | None:
        with self._tx() as db:
            row = db.execute("SELECT status, doc FROM jobs WHERE id=?", (job_id,)).fetchone()
            if row is None:
                return None
            if expect_status is not None and row[0] not in {str(getattr(s, "value", s)) for s in expect_status}:
                return None
            doc = json.loads(row[1])
            for key, value in changes.items():
                _set_path(doc, key, value)
            for key, value in (push or {}).items():
                doc.setdefault(key, []).append(value)
            db.execute("UPDATE jobs SET status=?, doc=? WHERE id=?", (doc["status"], _dump(doc), job_id))
            return doc

    # -- events ----------------------------------------------------------------------------
    def add_events(self, job_id: str, events: list[dict]) -> list[dict]:
        stored = []
        with self._tx() as db:
            (last,) = db.execute("SELECT COALESCE(MAX(seq), 0) FROM events WHERE job_id=?", (job_id,)).fetchone()
            for ev in events:
                ev = {**ev, "seq": last + 1}
                if ev.get("rank") is None and db.execute(  # NULLs are distinct in a UNIQUE index
                        "SELECT 1 FROM events WHERE job_id=? AND rank IS NULL AND key=?",
                        (job_id, ev.get("key"))).fetchone():
                    continue
                cur = db.execute("INSERT OR IGNORE INTO events VALUES (?, ?, ?, ?, ?, ?)",
                                 (job_id, ev["seq"], ev["kind"], ev.get("rank"), ev.get("key"), _dump(ev)))
                if cur.rowcount == 1:
                    last += 1
                    stored.append(ev)
        return stored

    def get_events(self, job_id, after=0, kind=None, limit=None) -> list[dict]:
        sql, args = "SELECT doc FROM events WHERE job_id=? AND seq>?", [job_id, after]
        if kind:
            sql += " AND kind=?"
            args.append(kind)
        sql += " ORDER BY seq"
        if limit:
            sql += f" LIMIT {int(limit)}"
        return [json.loads(r[0]) for r in self._q(sql, tuple(args))]

    # -- artifacts -------------------------------------------------------------------------
    def add_artifact(self, artifact: dict) -> dict:
        with self._tx() as db:
            db.execute("INSERT INTO artifacts VALUES (?, ?, ?, ?)",
                       (artifact["id"], artifact.get("job_id"), artifact["kind"], _dump(artifact)))
        return artifact

    def get_artifact(self, artifact_id: str) -> dict | None:
        rows = self._q("SELECT doc FROM artifacts WHERE id=?", (artifact_id,))
        return json.loads(rows[0][0]) if rows else None

    def update_artifact(self, artifact_id: str, changes: dict) -> None:
        with self._tx() as db:
            row = db.execute("SELECT doc FROM artifacts WHERE id=?", (artifact_id,)).fetchone()
            if row is None:
                return
            doc = {**json.loads(row[0]), **changes}
            db.execute("UPDATE artifacts SET job_id=?, kind=?, doc=? WHERE id=?",
                       (doc.get("job_id"), doc["kind"], _dump(doc), artifact_id))

    def list_artifacts(self, job_id: str, kind: str | None = None) -> list[dict]:
        sql, args = "SELECT doc FROM artifacts WHERE job_id=?", [job_id]
        if kind:
            sql += " AND kind=?"
            args.append(kind)
        return [json.loads(r[0]) for r in self._q(sql + " ORDER BY rowid", tuple(args))]

    def delete_artifact(self, artifact_id: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM artifacts WHERE id=?", (artifact_id,))


class _Abort(Exception):
    """Rolls back a reservation whose slot was taken meanwhile."""
