"""The zwdx server with the changes bench/README.md proposes for its owners, applied at start-up,
so that bench/control_plane.py --patched measures them before anyone edits the server.

    python bench/patched_server.py server --port 4461 --data-dir D      # same arguments as `zwdx server`

Each is applied only to a tree that lacks it ((1) landed in 7bea27f, (2) and (4) in 13390a2).
(1) Dashboards get a room's GPU client list at most once per CLIENTS_UPDATE_INTERVAL, coalesced,
and only when the room has one. (2) The embedded store closes the SQLite connection of a
finished thread (closing_sqlite_connections). (3) With ZWDX_BENCH_ASYNC_MODE=gevent: greenlets
instead of one OS thread per connection (async_mode). (4) The scheduler's plan() is linear in
the slots (linear_plan). (5) A queued job's position is counted, not listed
(counted_queue_position).
"""
from __future__ import annotations

import os

if os.environ.get("ZWDX_BENCH_ASYNC_MODE") == "gevent":  # before anything imports socket or threading
    from gevent import monkey
    monkey.patch_all()

import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: Seconds between two pushes of one room's GPU client list to its dashboards.
CLIENTS_UPDATE_INTERVAL = 1.0


def coalescing_clients_changed():
    from zwdx.protocol import EV_CLIENTS_UPDATE, UI_NAMESPACE
    from zwdx.server import notify, socketio
    from zwdx.server.views import client_view

    dirty: set[str] = set()
    lock = threading.Lock()
    started: list = []

    def watched(room_id: str) -> bool:
        return next(socketio.server.manager.get_participants(UI_NAMESPACE, notify.ui_room(room_id)), None) is not None

    def flush_loop(ctx) -> None:
        while not ctx.stopping.is_set():
            time.sleep(CLIENTS_UPDATE_INTERVAL)
            with lock:
                rooms = list(dirty)
                dirty.clear()
            for room_id in rooms:
                try:
                    if watched(room_id):
                        clients = [client_view(c) for c in ctx.store.list_clients(room_id)]
                        socketio.emit(EV_CLIENTS_UPDATE, {"clients": clients}, to=notify.ui_room(room_id),
                                      namespace=UI_NAMESPACE)
                except Exception:  # one room's failure must not stop the others' updates
                    notify_log.exception("notify: clients update of room %s failed", room_id)

    def clients_changed(ctx, room_id: str) -> None:
        with lock:
            dirty.add(room_id)
            if not started:
                started.append(threading.Thread(target=flush_loop, args=(ctx,), name="zwdx-clients-update",
                                                daemon=True))
                started[0].start()

    import logging
    notify_log = logging.getLogger("zwdx.server.notify")
    return clients_changed


def closing_sqlite_connections(force: bool = False) -> None:
    """SQLiteStore keeps every thread's connection in a list, so connections of finished threads
    (Werkzeug runs each HTTP connection in a new thread) are never closed: one file descriptor and
    ~120 KiB each, until "unable to open database file". Kept in a WeakSet instead, a finished
    thread's connection is closed and freed with its thread-local storage."""
    import inspect
    import sqlite3
    import weakref

    from zwdx.errors import StoreError
    from zwdx.server.store import sqlite as module
    if not force and "self._all.append(conn)" not in inspect.getsource(module.SQLiteStore._conn):
        return  # the tree closes them already (since 13390a2), with threading.enumerate(): not under gevent

    class Connection(sqlite3.Connection):
        """sqlite3.Connection with a weak reference slot."""

    def _conn(self):
        conn = getattr(self._local, "conn", None)
        if conn is None:
            try:
                conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False,
                                       factory=Connection)
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
                conn.execute("PRAGMA busy_timeout=30000")
            except sqlite3.Error as exc:
                raise StoreError(f"cannot open the embedded store at {self.path}: {exc}") from exc
            self._local.conn = conn
            with self._lock:
                if not isinstance(self._all, weakref.WeakSet):
                    self._all = weakref.WeakSet()
                self._all.add(conn)
        return conn

    def close(self) -> None:
        with self._lock:
            for conn in list(self._all):
                try:
                    conn.close()
                except sqlite3.Error:
                    pass
            self._all = weakref.WeakSet()
        self._local = threading.local()
    module.SQLiteStore._conn = _conn
    module.SQLiteStore.close = close


def linear_plan() -> None:
    """(4) The scheduler's plan() ranks eligible slots by how many its GPU client has with a count
    per slot over all slots: O(N^2) per placement (16% of the server's time at 1,000 clients).
    Counted once instead; applied to the current source, so it follows edits of plan()."""
    import collections
    import inspect

    from zwdx.server import scheduler
    src = inspect.getsource(scheduler.plan)
    if "sum(1 for c in chosen" not in src:
        return  # linear already (since 13390a2)
    old = ('order = sorted(chosen, key=lambda s: (-sum(1 for c in chosen if c["client_id"] == s["client_id"]),')
    new = ('per_client = Counter(c["client_id"] for c in chosen)\n'
           '            order = sorted(chosen, key=lambda s: (-per_client[s["client_id"]],')
    if old not in src:
        print("patched_server: scheduler.plan changed; its patch is not applied", file=sys.stderr, flush=True)
        return
    scheduler.__dict__.setdefault("Counter", collections.Counter)
    exec(compile(src.replace(old, new), scheduler.__file__, "exec"), scheduler.__dict__)


def counted_queue_position() -> None:
    """(5) GET /jobs/<id> of a queued job lists every queued job of the room to find its place:
    O(queued) per SDK poll, and polls are most of the REST traffic. The embedded store counts."""
    from flask import jsonify

    import zwdx.server as server
    from zwdx.protocol import JobStatus
    from zwdx.server import api
    from zwdx.server.auth import job_in_room, request_room
    from zwdx.server.views import job_view
    create_app = server.create_app

    def get_job(job_id: str):
        job = job_in_room(job_id, request_room())
        if job["status"] == JobStatus.QUEUED.value:
            store = api.ctx().store
            if hasattr(store, "_q") and "seq" in job:
                job["queue_position"] = store._q(
                    "SELECT COUNT(*) FROM jobs WHERE room_id=? AND status=? AND seq<=?",
                    (job["room_id"], JobStatus.QUEUED.value, job["seq"]))[0][0]
            else:
                queued = store.list_jobs(job["room_id"], [JobStatus.QUEUED.value])
                position = next((i for i, j in enumerate(queued) if j["id"] == job_id), None)
                if position is not None:
                    job["queue_position"] = position + 1
        return jsonify(job_view(job))

    def patched(config=None):
        app = create_app(config)
        app.view_functions["api.get_job"] = get_job
        return app
    server.create_app = patched


def async_mode(mode: str) -> None:
    """(3) Serve Socket.IO and HTTP from greenlets (gevent, with simple-websocket) instead of one
    OS thread per connection, by overriding the async_mode create_app passes."""
    from flask_socketio import SocketIO
    init_app = SocketIO.init_app

    def patched(self, app, **kwargs):
        kwargs["async_mode"] = mode
        return init_app(self, app, **kwargs)
    SocketIO.init_app = patched


def main() -> int:
    from zwdx import cli
    from zwdx.server import notify
    if not hasattr(notify, "CLIENTS_PUSH_INTERVAL"):  # the tree coalesces already since 7bea27f
        notify.clients_changed = coalescing_clients_changed()
    # greenlets are not in threading.enumerate(): under gevent the tree's pruning closes live ones
    closing_sqlite_connections(force=bool(os.environ.get("ZWDX_BENCH_ASYNC_MODE")))
    linear_plan()
    counted_queue_position()
    if os.environ.get("ZWDX_BENCH_ASYNC_MODE"):
        async_mode(os.environ["ZWDX_BENCH_ASYNC_MODE"])
    return cli.main()


if __name__ == "__main__":
    sys.exit(main())
