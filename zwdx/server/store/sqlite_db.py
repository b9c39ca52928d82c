"""The embedded store's database file: connections, transactions, tables, schema version.

Connections come from a small pool: a call takes one (or opens one when every pooled one is
in use), and gives it back when done; ``POOL_SIZE`` idle ones are kept. That serves OS threads
and gevent's greenlets alike (a greenlet never holds one across a switch: SQLite calls do not
yield to the hub), without a connection per thread or greenlet ever started.

Writes that must be atomic run inside ``BEGIN IMMEDIATE`` transactions (``Database.tx``),
which serialise writers across threads and processes that share the file. Whatever SQLite
raises inside one, the transaction is rolled back and the caller gets ``StoreError``. A
transaction that finds the file's write lock held (another process is writing) waits for it
in short sleeps, not inside SQLite: under gevent a wait inside SQLite holds every connection
of the process still (``bench/control_plane.py --stalls`` showed four processes on one file
spending their time so).
"""
from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from collections import deque
from contextlib import contextmanager
from typing import Callable

from ...errors import SchemaVersionError, StoreError
from ...protocol.base import exact
from . import base
from .migrations import job_1_to_2, job_2_to_3, legacy_credential, room_2_to_3

log = logging.getLogger(__name__)

#: Idle connections kept for the next call.
POOL_SIZE = 8
#: Seconds between the background checkpointer's passes (``Database.checkpoint_in_background``).
CHECKPOINT_INTERVAL = 1.0
#: Seconds a call waits for the file's write lock before it fails (``StoreError``).
BUSY_TIMEOUT = 30.0
_BUSY_WAIT = f"PRAGMA busy_timeout={int(BUSY_TIMEOUT * 1000)}"  # SQLite's own wait, for all but BEGIN

DDL = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS rooms (id TEXT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS credentials (id TEXT PRIMARY KEY, room_id TEXT NOT NULL, hash TEXT UNIQUE NOT NULL,
    doc TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS credentials_room ON credentials (room_id);
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
CREATE TABLE IF NOT EXISTS event_usage (room_id TEXT PRIMARY KEY, events INTEGER NOT NULL, bytes INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS artifacts (id TEXT PRIMARY KEY, job_id TEXT, kind TEXT, doc TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS artifacts_job ON artifacts (job_id, kind);
CREATE TABLE IF NOT EXISTS leases (name TEXT PRIMARY KEY, holder TEXT NOT NULL, expires_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS artifacts_room ON artifacts (json_extract(doc, '$.room_id'));
"""


def dump(doc) -> str:
    return json.dumps(doc, separators=(",", ":"))


def dump_exact(doc) -> str:
    """``dump`` for a document that holds a user's numbers (a job, an event): one with an
    integer past 64 bits is marked so that ``protocol.base.loads`` keeps it whole."""
    return exact(dump(doc))


def _jobs_1_to_2(db: sqlite3.Connection) -> None:
    for job_id, doc in db.execute("SELECT id, doc FROM jobs").fetchall():
        db.execute("UPDATE jobs SET doc=? WHERE id=?", (dump(job_1_to_2(json.loads(doc))), job_id))


def _credentials_2_to_3(db: sqlite3.Connection) -> None:
    """Each room's token becomes its legacy credential; the rooms table loses its token column
    (made again without it: SQLite drops no UNIQUE column); jobs lose their job key's hash."""
    columns = [row[1] for row in db.execute("PRAGMA table_info(rooms)")]
    if "token_hash" in columns:
        rooms = db.execute("SELECT id, token_hash, doc FROM rooms").fetchall()
        db.execute("CREATE TABLE rooms_3 (id TEXT PRIMARY KEY, doc TEXT NOT NULL)")
        for room_id, token_hash, doc in rooms:
            room = {**json.loads(doc), "token_hash": token_hash}
            credential = legacy_credential(room)
            if credential is not None:
                db.execute("INSERT OR IGNORE INTO credentials VALUES (?, ?, ?, ?)",
                           (credential["id"], room_id, credential["hash"], dump(credential)))
            db.execute("INSERT INTO rooms_3 VALUES (?, ?)", (room_id, dump(room_2_to_3(room))))
        db.execute("DROP TABLE rooms")
        db.execute("ALTER TABLE rooms_3 RENAME TO rooms")
    for job_id, doc in db.execute("SELECT id, doc FROM jobs WHERE doc LIKE '%job_key_hash%'").fetchall():
        db.execute("UPDATE jobs SET doc=? WHERE id=?", (dump(job_2_to_3(json.loads(doc))), job_id))


#: Migrations from version N to N+1: each a function of the connection, run inside the
#: transaction that records version N+1.
MIGRATIONS: dict[int, Callable[[sqlite3.Connection], None]] = {1: _jobs_1_to_2, 2: _credentials_2_to_3}


def _original(module: str, name: str):
    """``module.name`` as it was before gevent patched it, if it did."""
    try:
        from gevent import monkey
        return monkey.get_original(module, name)
    except ImportError:
        import importlib
        return getattr(importlib.import_module(module), name)


def _os_thread(target: Callable[[], None]) -> None:
    """Run ``target`` in an OS thread, not a greenlet, even in a gevent-patched process."""
    _original("_thread", "start_new_thread")(target, ())


def _private(path: str) -> None:
    """The database file readable by its owner only (0600), created so before SQLite opens it;
    SQLite gives its -wal and -shm files the database file's mode."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
        for name in (path, f"{path}-wal", f"{path}-shm"):
            if os.path.exists(name) and os.stat(name).st_mode & 0o077:
                os.chmod(name, 0o600)
    except OSError as exc:
        log.warning("store: cannot make %s private: %s", path, exc)


class Database:
    """One SQLite file: a pool of connections, transactions, and the layout's version."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
        _private(path)
        self._idle: deque[sqlite3.Connection] = deque()  # append and pop are atomic
        self._checkpointer = False  # a thread of its own checkpoints the log (checkpoint_in_background)
        self._closed = False
        with self.conn() as conn:
            try:
                conn.executescript(DDL)
            except sqlite3.Error as exc:
                raise StoreError(f"cannot prepare the embedded store at {path}: {exc}") from exc
        self._check_schema()

    def _open(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(_BUSY_WAIT)
            if self._checkpointer:
                conn.execute("PRAGMA wal_autocheckpoint=0")
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open the embedded store at {self.path}: {exc}") from exc
        return conn

    @contextmanager
    def conn(self):
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
    def tx(self):
        """A write transaction: committed when the block ends, rolled back when it raises;
        SQLite's errors (a constraint, a full disk, a broken file) come out as StoreError."""
        with self.conn() as conn:
            self._begin(conn)
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException as exc:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    pass  # SQLite rolled back already (a full disk, an I/O error)
                if isinstance(exc, sqlite3.Error):
                    raise StoreError(f"embedded store write failed, nothing changed: {exc}") from exc
                raise

    @staticmethod
    def _begin(conn: sqlite3.Connection) -> None:
        """``BEGIN IMMEDIATE``, asked without SQLite's own wait: while another process holds the
        write lock, sleep (1 ms, doubling up to 50 ms; a greenlet's sleep under gevent, which
        serves the process's other connections meanwhile) and ask again, for ``BUSY_TIMEOUT``."""
        deadline, pause = time.monotonic() + BUSY_TIMEOUT, 0.001
        conn.execute("PRAGMA busy_timeout=0")
        try:
            while True:
                try:
                    conn.execute("BEGIN IMMEDIATE")
                    return
                except sqlite3.OperationalError as exc:
                    if getattr(exc, "sqlite_errorcode", sqlite3.SQLITE_BUSY) != sqlite3.SQLITE_BUSY \
                            or time.monotonic() >= deadline:
                        raise StoreError(f"embedded store busy or broken: {exc}") from exc
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
        except sqlite3.Error as exc:
            raise StoreError(f"embedded store busy or broken: {exc}") from exc
        finally:
            conn.execute(_BUSY_WAIT)

    def query(self, sql: str, args: tuple = ()) -> list:
        with self.conn() as conn:
            try:
                return conn.execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                raise StoreError(f"embedded store query failed: {exc}") from exc

    def schema_version(self) -> int:
        return int(self.query("SELECT value FROM meta WHERE key='schema_version'")[0][0])

    def _check_schema(self) -> None:
        rows = self.query("SELECT value FROM meta WHERE key='schema_version'")
        if not rows:
            with self.tx() as db:
                db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(base.SCHEMA_VERSION),))
            return
        found = int(rows[0][0])
        if found > base.SCHEMA_VERSION:
            raise SchemaVersionError(
                f"the store at {self.path} has schema version {found}, newer than this zwdx "
                f"understands ({base.SCHEMA_VERSION}); upgrade zwdx", found=found, supported=base.SCHEMA_VERSION)
        while found < base.SCHEMA_VERSION:
            with self.tx() as db:
                step = MIGRATIONS.get(found)
                if step is not None:
                    step(db)
                found += 1
                db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(found),))
            log.info("store: migrated %s to schema version %d", self.path, found)

    def checkpoint_in_background(self) -> None:
        """Copy the write-ahead log into the database file from an OS thread of its own, every
        ``CHECKPOINT_INTERVAL`` s, instead of in whichever call's commit fills the log past 1,000
        pages. That copy ends in an fsync; under gevent a call that made it held every
        connection of the server still for as long as the disk took. SQLite releases the GIL
        while it works, so the thread holds up nothing. A PASSIVE
        checkpoint waits for no reader or writer. For a server process (``zwdx server``), not
        for every process that opens the store."""
        if self._checkpointer:
            return
        self._checkpointer = True
        for conn in list(self._idle):
            conn.execute("PRAGMA wal_autocheckpoint=0")
        _os_thread(self._checkpoint_loop)

    def _checkpoint_loop(self) -> None:
        sleep = _original("time", "sleep")
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        try:
            while not self._closed:
                sleep(CHECKPOINT_INTERVAL)
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                except sqlite3.Error as exc:
                    log.warning("store: checkpoint of %s failed (tried again): %s", self.path, exc)
        finally:
            conn.close()

    def close(self) -> None:
        self._closed = True
        while self._idle:
            try:
                self._idle.pop().close()
            except (IndexError, sqlite3.Error):
                pass
