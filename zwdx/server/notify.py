"""Push changes to dashboards over Socket.IO (namespace /ui, one Socket.IO room per zwdx room).

Job changes and job events go out at once. The GPU-client list of a room changes with every
heartbeat, so it is coalesced: a room marked changed is sent at most every
``CLIENTS_PUSH_INTERVAL`` seconds, whatever the number of GPU clients.
"""
from __future__ import annotations

import logging
import threading

from ..protocol import EV_CLIENTS_UPDATE, EV_JOB_EVENTS, EV_JOB_UPDATE, UI_NAMESPACE
from . import socketio
from .views import client_view, job_view

log = logging.getLogger(__name__)

#: Longest delay of a GPU-client change on its way to the dashboards, in seconds.
CLIENTS_PUSH_INTERVAL = 0.5

_dirty: set[str] = set()
_lock = threading.Lock()
_flusher: threading.Thread | None = None


def ui_room(room_id: str) -> str:
    return f"room:{room_id}"


def job_changed(job: dict) -> None:
    socketio.emit(EV_JOB_UPDATE, job_view(job), to=ui_room(job["room_id"]), namespace=UI_NAMESPACE)


def events_added(job: dict, events: list[dict]) -> None:
    if events:
        socketio.emit(EV_JOB_EVENTS, {"job_id": job["id"], "events": events},
                      to=ui_room(job["room_id"]), namespace=UI_NAMESPACE)


def clients_payload(ctx, room_id: str) -> dict:
    return {"clients": [client_view(c) for c in ctx.store.list_clients(room_id)]}


def clients_changed(ctx, room_id: str) -> None:
    """Mark the room's GPU-client list changed; the flusher sends it soon."""
    global _flusher
    with _lock:
        _dirty.add(room_id)
        if _flusher is None or not _flusher.is_alive():
            _flusher = threading.Thread(target=_flush_loop, args=(ctx,), name="zwdx-notify", daemon=True)
            _flusher.start()


def _flush_loop(ctx) -> None:
    while not ctx.stopping.wait(CLIENTS_PUSH_INTERVAL):
        with _lock:
            rooms = list(_dirty)
            _dirty.clear()
        for room_id in rooms:
            try:
                socketio.emit(EV_CLIENTS_UPDATE, clients_payload(ctx, room_id), to=ui_room(room_id),
                              namespace=UI_NAMESPACE)
            except Exception:
                log.exception("notify: clients of room %s not sent", room_id)
