"""The server's disk: a floor of free space below which new data is refused, and a full disk
answered 507 ``insufficient_storage``, never 500.

- ``MIN_FREE_BYTES`` (``zwdx server --min-free-bytes``, ``ZWDX_MIN_FREE_BYTES``): while the data
  dir's file system has less free than that (what an unprivileged process may use), the routes
  that store new data (``WRITES``: uploads, events, new jobs) answer 507 and store nothing.
  What is stored stays readable, and what lets a job end (a rank's status, a cancel) still goes
  through: those writes are small. The check comes before the caller's token is: a 507 says
  nothing but that no data is taken (how much is free goes to the server's log only).
- A write that meets a full disk anyway (``ENOSPC``, ``EDQUOT``; SQLite's ``SQLITE_FULL``)
  answers 507 too: an artifact's partial file is removed (``artifacts.py``), a store
  transaction rolled back (``sqlite_db.py``).

With MongoDB the floor watches the data dir only; the database's own disk is its operator's.
"""
from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import os
import sqlite3
import time

from flask import Flask, current_app, jsonify

from ..errors import InsufficientStorage, StoreError

log = logging.getLogger(__name__)

#: The routes that store new data: refused below the floor.
WRITES = ("api.upload_bundle", "api.create_job", "api.post_events", "api.put_weights",
          "checkpoints.put_checkpoint_file", "datasets.put_chunk", "datasets.create_version", "diloco.put_state",
          "scripts.put_workdir", "scripts.put_outputs")

_FULL = (errno.ENOSPC, errno.EDQUOT)
#: Seconds between two log lines about the floor.
WARN_EVERY = 60.0
_warned = -WARN_EVERY


def free_bytes(path: str) -> int:
    """Bytes an unprivileged process may still write on ``path``'s file system (that of its
    nearest folder that exists: with MongoDB, the data dir may never be made)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_floor() -> None:
    """``InsufficientStorage`` while the data dir's disk has less free than ``MIN_FREE_BYTES``."""
    floor = current_app.extensions["zwdx"].settings.min_free_bytes
    if floor and (free := free_bytes(current_app.extensions["zwdx"].settings.data_dir)) < floor:
        global _warned
        if time.monotonic() - _warned > WARN_EVERY:  # one line a minute, however many are refused
            _warned = time.monotonic()
            log.warning("server: %d bytes free on the data dir's disk, under the floor of %d: new data refused",
                        free, floor)
        # the figures stay in the server's log: a caller is told only that no data is taken
        raise InsufficientStorage("the server's disk is below the free space it keeps: it takes no new data until "
                                  "its operator makes room (what is stored stays readable)")


def disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it) is a write that found the disk full."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in _FULL:
            return True
        if isinstance(exc, sqlite3.Error) and getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _full(exc: BaseException) -> InsufficientStorage:
    log.error("server: a write found the disk full (%s); nothing of the request was kept", exc)
    return InsufficientStorage("the server's disk is full: nothing of the request was stored (what was stored "
                               "before stays readable); retry once its operator made room")


def init_app(app: Flask) -> None:
    """Check the floor before each of ``WRITES`` (507 declared in their OpenAPI errors), and
    answer a full disk 507. Call after the blueprints and ``api.register_error_handlers``."""
    for endpoint in WRITES:
        view = app.view_functions[endpoint]

        @functools.wraps(view)
        def checked(*args, _view=view, **kwargs):
            check_floor()
            return _view(*args, **kwargs)
        checked.operation = dataclasses.replace(view.operation, errors=tuple(sorted({*view.operation.errors, 507})))
        app.view_functions[endpoint] = checked
    unexpected = app.error_handler_spec[None][None][Exception]

    @app.errorhandler(OSError)
    def _os_error(exc: OSError):
        return _answer(_full(exc)) if disk_full(exc) else unexpected(exc)

    @app.errorhandler(StoreError)
    def _store_error(exc: StoreError):
        return _answer(_full(exc) if disk_full(exc) else exc)


def _answer(err):
    return jsonify(err.to_dict()), err.http_status
