"""Push changes to dashboards over Socket.IO (namespace /ui, one Socket.IO room per zwdx room)."""
from __future__ import annotations

from ..protocol import EV_CLIENTS_UPDATE, EV_JOB_EVENTS, EV_JOB_UPDATE, UI_NAMESPACE
from . import socketio
from .views import client_view, job_view


def ui_room(room_id: str) -> str:
    return f"room:{room_id}"


def job_changed(job: dict) -> None:
    socketio.emit(EV_JOB_UPDATE, job_view(job), to=ui_room(job["room_id"]), namespace=UI_NAMESPACE)


def events_added(job: dict, events: list[dict]) -> None:
    if events:
        socketio.emit(EV_JOB_EVENTS, {"job_id": job["id"], "events": events},
                      to=ui_room(job["room_id"]), namespace=UI_NAMESPACE)


def clients_changed(ctx, room_id: str) -> None:
    clients = [client_view(c) for c in ctx.store.list_clients(room_id)]
    socketio.emit(EV_CLIENTS_UPDATE, {"clients": clients}, to=ui_room(room_id), namespace=UI_NAMESPACE)
