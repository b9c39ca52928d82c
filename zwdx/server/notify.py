"""Push changes to dashboards over Socket.IO (namespace /ui, one Socket.IO room per zwdx room).

Job changes and job events go out at once, to dashboards and to the SDK polls held on the job
(``watching``). The GPU-client list of a room is coalesced, and
sent only while a dashboard watches the room (one that connects gets the list at once): a GPU
client that joined, left or was lost shows within ``CLIENTS_PUSH_INTERVAL`` seconds; fresh
heartbeat figures (free memory, utilisation, last seen) and slots taken or freed by jobs
(which ``job_update`` already told) within one heartbeat interval, the pace the figures change
at. A dashboard that connects gets the whole list; after that a room is sent only what changed
since its last push (``full: false``: the clients whose view changed, the ids ``removed``), so
a room of 10,000 GPU clients where ten moved sends ten, not 10,000. A view counts as changed
when anything but ``last_seen`` moved, or ``last_seen`` by ``LAST_SEEN_STEP`` (each heartbeat
moves it) since the view the dashboards were last sent: an idle client's "last seen" is at
most that old on a dashboard. In a busy room this is about one push per heartbeat interval, whatever the number
of GPU clients and jobs. Making one reads the room's clients, so a room's pushes are also paced
by what they cost:
one that took t to make and send is followed by the next no sooner than t x
(1 / ``CLIENTS_PUSH_SHARE`` - 1) later, which holds them to a tenth of the process in a room of
thousands of clients that join and leave all the time.

Each payload is a declared answer (``docs/events.md``): ``job_update`` a ``JobView``,
``job_events`` a ``JobEvents``, ``clients_update`` a ``ClientsUpdate``.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time

from pydantic import BaseModel
from socketio import PubSubManager

from ..protocol import EV_CLIENTS_UPDATE, EV_JOB_EVENTS, EV_JOB_UPDATE, UI_NAMESPACE
from ..protocol.job import Job as JobRecord
from ..protocol.rest import ClientsUpdate, JobEvents
from .extensions import Encoded, socketio
from .placement import room_totals
from .views import client_view, job_view

log = logging.getLogger(__name__)

#: Longest delay of a GPU client's change of state on its way to the dashboards, in seconds.
CLIENTS_PUSH_INTERVAL = 0.5
#: The largest share of a server process's time one room's GPU-client lists may take.
CLIENTS_PUSH_SHARE = 0.1
#: How far a client's ``last_seen`` moves (seconds) before a push carries it again by itself.
LAST_SEEN_STEP = 30.0

_lock = threading.Lock()


class ClientPushes:
    """One app's client lists waiting to go out, and the thread that sends them (``ctx.pushes``):
    a server process serves one app; a test process makes several, each with its own store."""

    def __init__(self):
        self.due: dict[str, float] = {}  # room id -> when its client list should go out
        self.earliest: dict[str, float] = {}  # room id -> when its next list may go out, by what the last one cost
        self.sent: dict[str, dict[str, dict]] = {}  # room id -> client id -> its view as last pushed
        self.sent_totals: dict[str, dict] = {}  # room id -> its totals as last pushed
        self.flusher: threading.Thread | None = None


def ui_room(room_id: str) -> str:
    return f"room:{room_id}"


def watched(room_id: str) -> bool:
    """Whether a dashboard may watch the room: one of this server process is connected to it;
    among several processes (a message queue), one of another process may be, unseen here."""
    if _queued():
        return True
    return next(iter(socketio.server.manager.get_participants(UI_NAMESPACE, ui_room(room_id))), None) is not None


_watchers: dict[str, set[threading.Event]] = {}  # job id -> the held polls of it (``watching``)


@contextlib.contextmanager
def watching(job_id: str):
    """An event set whenever this process changes the job or adds events to it, while the
    ``with`` lasts: what a held poll (``GET /jobs/<id>?wait=``) sleeps on. Changes made by
    another server process do not set it; the poll looks at the store now and then for those."""
    changed = threading.Event()
    with _lock:
        _watchers.setdefault(job_id, set()).add(changed)
    try:
        yield changed
    finally:
        with _lock:
            held = _watchers.get(job_id)
            if held is not None:
                held.discard(changed)
                if not held:
                    del _watchers[job_id]


def _wake(job_id: str) -> None:
    with _lock:
        held = list(_watchers.get(job_id, ()))
    for changed in held:
        changed.set()


def _queued() -> bool:
    """Whether this process's emits go through a message queue (several server processes)."""
    return isinstance(socketio.server.manager, PubSubManager)


def wire(model: BaseModel) -> Encoded | dict:
    """A model as ``socketio.emit`` takes it: its JSON text (``Encoded``), written once; through
    a message queue, which re-encodes what it carries, its JSON-ready dict."""
    return model.model_dump(mode="json") if _queued() else Encoded(model.model_dump_json())


def job_changed(job: JobRecord) -> None:
    _wake(job.id)
    if watched(job.room_id):
        socketio.emit(EV_JOB_UPDATE, wire(job_view(job)), to=ui_room(job.room_id),
                      namespace=UI_NAMESPACE)


def events_added(job: JobRecord, events: list[dict]) -> None:
    if events:
        _wake(job.id)
        if watched(job.room_id):
            payload = JobEvents.model_validate({"job_id": job.id, "events": events})
            socketio.emit(EV_JOB_EVENTS, wire(payload), to=ui_room(job.room_id),
                          namespace=UI_NAMESPACE)


def clients_payload(ctx, room_id: str) -> Encoded | dict:
    """The room's GPU clients and what they offer in all (``room_totals``): a whole
    ``ClientsUpdate``, to emit (``wire``)."""
    clients = ctx.presence.overlay(ctx.store.list_clients(room_id))
    payload = ClientsUpdate.model_validate({"clients": [client_view(c) for c in clients],
                                            "totals": room_totals(clients)})
    return wire(payload)


def _moved(before: dict | None, view: dict) -> bool:
    if before is None:
        return True
    if abs((view.get("last_seen") or 0.0) - (before.get("last_seen") or 0.0)) >= LAST_SEEN_STEP:
        return True
    return any(view.get(k) != before.get(k) for k in view.keys() | before.keys() if k != "last_seen")


def clients_delta(sent: dict[str, dict], views: list[dict]) -> tuple[list[dict], list[str]]:
    """What a room's dashboards lack, given the views pushed last (``sent``): the views that
    changed or are new, and the ids of those gone."""
    now = {v["id"] for v in views}
    changed = [v for v in views if _moved(sent.get(v["id"]), v)]
    return changed, sorted(set(sent) - now)


def push_clients(ctx, room_id: str) -> bool:
    """Send the room's dashboards what changed in its GPU-client list since the last push (the
    whole list the first time); False when nothing had."""
    clients = ctx.presence.overlay(ctx.store.list_clients(room_id))
    views = [client_view(c) for c in clients]
    sent = ctx.pushes.sent.get(room_id)
    totals = room_totals(clients)
    if sent is None:
        payload = {"clients": views, "totals": totals}
        ctx.pushes.sent[room_id] = {v["id"]: v for v in views}
    else:
        changed, removed = clients_delta(sent, views)
        if not changed and not removed and totals == ctx.pushes.sent_totals.get(room_id):
            return False
        payload = {"clients": changed, "removed": removed, "totals": totals, "full": False}
        # What the dashboards hold: a view not sent keeps the one they have, so its last_seen
        # (and any slow drift) is measured from what they were last sent, not from the last push
        for gone in removed:
            sent.pop(gone, None)
        sent.update((v["id"], v) for v in changed)
    ctx.pushes.sent_totals[room_id] = totals
    socketio.emit(EV_CLIENTS_UPDATE, wire(ClientsUpdate.model_validate(payload)), to=ui_room(room_id),
                  namespace=UI_NAMESPACE)
    return True


def clients_changed(ctx, room_id: str, joined_or_left: bool = False) -> None:
    """Mark the room's GPU-client list changed; the flusher sends it within a heartbeat
    interval, or within ``CLIENTS_PUSH_INTERVAL`` when a client ``joined_or_left``."""
    pushes = ctx.pushes
    if joined_or_left:
        ctx.recent_clients.forget(room_id)
    elif room_id in pushes.due and pushes.flusher is not None and pushes.flusher.is_alive():
        return  # marked already, as soon or sooner (each heartbeat comes here: no lock for it)
    due = time.monotonic() + (0.0 if joined_or_left else ctx.settings.heartbeat_interval)
    with _lock:
        pushes.due[room_id] = min(due, pushes.due.get(room_id, due))
        if pushes.flusher is None or not pushes.flusher.is_alive():
            pushes.flusher = threading.Thread(target=_flush_loop, args=(ctx,), name="zwdx-notify", daemon=True)
            pushes.flusher.start()


def _flush_loop(ctx) -> None:
    pushes = ctx.pushes
    while not ctx.stopping.wait(CLIENTS_PUSH_INTERVAL):
        now = time.monotonic()
        with _lock:
            rooms = [room_id for room_id, due in pushes.due.items()
                     if due <= now and pushes.earliest.get(room_id, 0.0) <= now]
            for room_id in rooms:
                del pushes.due[room_id]
        for room_id in rooms:
            if not watched(room_id):
                pushes.sent.pop(room_id, None)  # the next dashboard to watch it starts from a whole list
                continue  # no dashboard open on this room: nothing to list
            started = time.monotonic()
            try:
                push_clients(ctx, room_id)
            except Exception:
                log.exception("notify: clients of room %s not sent", room_id)
            ended = time.monotonic()
            pushes.earliest[room_id] = ended + (ended - started) * (1.0 / CLIENTS_PUSH_SHARE - 1.0)
