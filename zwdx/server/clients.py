"""GPU clients over their lives: the packages a waiting job asks them to look for again, and
how long a room keeps the records of those that went away.

A job that waits for a package a GPU client lacks asks that client to look again at what it can
import (``ask_refresh``, from the scheduler's pass: a package installed since it registered); it
registers again if that changed. A GPU client keeps its id across restarts of one work dir
(``gpu_client/agent/workspace.py``), so a record left offline is one that did not come back: another
machine, a wiped work dir. The sweeper (every ``SWEEP_INTERVAL``) drops those offline for longer
than the room's ``client_retention`` (``PATCH /room``), else the server's ``CLIENT_RETENTION`` (a
day; 0: never); the room's owner drops them at once with ``POST /room/clients/prune`` (``zwdx room
clients prune``, the dashboard's button; both routes in ``api.py``). A client that runs ranks
(its slots hold a job) is never dropped; one that comes back registers again, as new.
"""
from __future__ import annotations

import logging
import time

from .. import defaults
from ..protocol import EV_REFRESH, GPU_NAMESPACE, ClientStatus
from ..protocol.gpu import Refresh
from . import notify
from .extensions import socketio
from .placement import missing_modules, online

log = logging.getLogger(__name__)

#: connection (sid) -> (the modules it was last asked to look for, when, how many times): asked
#: again for the same ones after ``MODULES_REFRESH`` seconds, twice that the next time, ... (at
#: most an hour): a package that never comes costs a probe an hour, not one a minute
_asked: dict[str, tuple[frozenset, float, int]] = {}
#: The longest wait before a GPU client is asked again for the same modules.
ASK_AGAIN_MAX = 3600.0


def ask_refresh(job_id: str, spec: dict, clients, now: float | None = None) -> int:
    """A job waits: ask each online GPU client that lacks modules it needs to look again at what
    it can import (a package installed since it registered); how many were asked."""
    now = time.time() if now is None else now
    asked = 0
    for client in clients:
        sid = client.get("sid")
        lacks = frozenset(missing_modules(spec, client)) if online(client) and sid else frozenset()
        if not lacks:
            continue
        before, at, times = _asked.get(sid, (frozenset(), 0.0, 0))
        same = lacks <= before
        if same and now - at < min(defaults.MODULES_REFRESH * 2 ** (times - 1), ASK_AGAIN_MAX):
            continue
        _asked[sid] = (lacks, now, times + 1 if same else 1)
        message = Refresh(modules=sorted(lacks), reason=f"job {job_id} waits for package(s) {', '.join(sorted(lacks))}")
        socketio.emit(EV_REFRESH, message.model_dump(), to=sid, namespace=GPU_NAMESPACE)
        asked += 1
    if len(_asked) > 10_000:  # connections long gone
        for sid in [s for s, (_, at, _n) in _asked.items() if now - at > ASK_AGAIN_MAX]:
            _asked.pop(sid, None)
    return asked


def retention(settings, room: dict | None) -> float:
    """Seconds the room keeps an offline GPU client (0: for ever): its own setting, else the server's."""
    own = (room or {}).get("client_retention")
    return settings.client_retention if own is None else float(own)


def drop(context, room_id: str, seen_before: float, why: str) -> list[str]:
    """Remove the room's idle GPU clients offline since before ``seen_before``; their ids."""
    gone = context.store.remove_clients(room_id, seen_before)
    if gone:
        log.info("room %s: %d offline gpu client(s) dropped (%s): %s", room_id, len(gone), why, ", ".join(gone))
        notify.clients_changed(context, room_id, joined_or_left=True)
    return gone


def drop_expired(context, now: float | None = None) -> int:
    """One pass of the sweeper: in every room with offline GPU clients, drop those past its retention."""
    now = time.time() if now is None else now
    rooms = {c["room_id"] for c in context.store.list_clients(None) if c.get("status") == ClientStatus.OFFLINE.value}
    dropped = 0
    for room_id in sorted(rooms):
        keep = retention(context.settings, context.store.get_room(room_id))
        if keep > 0:
            dropped += len(drop(context, room_id, now - keep, f"offline for more than {keep:g} s"))
    return dropped
