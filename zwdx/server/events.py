"""Socket.IO: GPU clients on /gpu (register, heartbeat, ranks exited) and dashboards on /ui.

Both namespaces refuse a connection whose ``auth`` lacks a valid room token; a GPU client
then only ever touches its own room's slots and jobs.
"""
from __future__ import annotations

import logging
import time

from flask import current_app, request
from flask_socketio import ConnectionRefusedError, join_room

from .. import defaults
from ..errors import AuthError
from ..protocol import (ACTIVE, EV_CLIENTS_UPDATE, EV_HEARTBEAT, EV_JOB_CANCEL, EV_RANKS_EXITED, EV_REGISTER, GPU_NAMESPACE,
                        UI_NAMESPACE, ClientStatus)
from . import lifecycle, notify
from .auth import room_for_token

log = logging.getLogger(__name__)

#: sid -> {"client_id", "room_id"} for connected GPU clients of this server process.
_sessions: dict[str, dict] = {}


def _ctx():
    return current_app.extensions["zwdx"]


def _room_from_auth(auth) -> dict:
    token = auth.get("token") if isinstance(auth, dict) else None
    try:
        return room_for_token(token)
    except AuthError as err:
        raise ConnectionRefusedError(err.message)


def _host_fields_wrong(data: dict) -> str | None:
    """What is wrong with a register payload's ``host_id`` and ``modules`` (both optional: a
    client without them is its own host and is not checked for packages), or None."""
    host_id = data.get("host_id")
    if host_id is not None and not (isinstance(host_id, str) and 0 < len(host_id) <= 64):
        return "field 'host_id' must be a string of 1 to 64 characters"
    modules = data.get("modules")
    if modules is not None and not (
            isinstance(modules, list) and len(modules) <= defaults.MAX_CLIENT_MODULES
            and all(isinstance(m, str) and len(m) <= defaults.MAX_MODULE_NAME and m.isidentifier() for m in modules)):
        return (f"field 'modules' must be a list of at most {defaults.MAX_CLIENT_MODULES} top-level module names "
                f"(Python identifiers)")
    return None


def register(socketio) -> None:
    # -- GPU clients -------------------------------------------------------------------------
    @socketio.on("connect", namespace=GPU_NAMESPACE)
    def gpu_connect(auth=None):
        room = _room_from_auth(auth)
        _sessions[request.sid] = {"room_id": room["id"], "client_id": None}

    @socketio.on(EV_REGISTER, namespace=GPU_NAMESPACE)
    def gpu_register(data):
        sess = _sessions.get(request.sid)
        if sess is None or not isinstance(data, dict) or not isinstance(data.get("client_id"), str):
            return {"ok": False, "error": "register needs a client_id after a connect with a room token"}
        ctx, now = _ctx(), time.time()
        client_id = data["client_id"]
        wrong = _host_fields_wrong(data)
        if wrong:
            return {"ok": False, "error": f"register: {wrong}"}
        existing = ctx.store.get_client(client_id)
        if existing and existing["room_id"] != sess["room_id"]:
            return {"ok": False, "error": f"gpu client id {client_id} belongs to another room"}
        sess["client_id"] = client_id
        slots = []
        for s in data.get("slots") or []:
            slots.append({"id": f"{client_id}:{int(s['index'])}", "client_id": client_id,
                          "room_id": sess["room_id"], "index": int(s["index"]), "kind": s.get("kind", "cuda"),
                          "name": str(s.get("name", "")), "memory_total": int(s.get("memory_total") or 0),
                          "memory_free": int(s.get("memory_free") or 0), "utilization": s.get("utilization")})
        modules = data.get("modules")
        client = {"id": client_id, "room_id": sess["room_id"], "hostname": str(data.get("hostname", "")),
                  "host_id": data.get("host_id"),
                  "modules": None if modules is None else " ".join(sorted(set(modules))),  # one string: cheap to read
                  "versions": data.get("versions") or {}, "advertise_addr": data.get("advertise_addr"),
                  "status": ClientStatus.ONLINE.value, "sid": request.sid, "last_seen": now,
                  "lost_after": now + float(current_app.config["CLIENT_TIMEOUT"]), "disconnected_at": None,
                  "connected_at": now, "registered_at": (existing or {}).get("registered_at", now)}
        ctx.store.upsert_client(client, slots)
        running = {}  # job id -> attempt this client still runs ranks of
        for item in data.get("running") or []:
            if isinstance(item, dict):
                running[str(item.get("job_id"))] = int(item.get("attempt") or 0)
        # Slots the store thinks are busy with jobs this client no longer runs: those ranks are gone.
        for slot in ctx.store.list_slots(sess["room_id"], client_id):
            if slot["job_id"] and slot["job_id"] not in running:
                job = ctx.store.get_job(slot["job_id"])
                lifecycle.ranks_exited(ctx, client_id, slot["job_id"], {str(slot["rank"]): -1},
                                       job.attempt if job else 0)
        # Ranks it still runs of jobs that went on without it (or ended): stop them.
        for job_id, attempt in running.items():
            job = ctx.store.get_job(job_id)
            mine = job and job.status in ACTIVE and job.attempt == attempt and \
                any(p.client_id == client_id for p in job.placement or [])
            if not mine:
                socketio.emit(EV_JOB_CANCEL, {"job_id": job_id, "attempt": attempt,
                                              "reason": "the job went on without this gpu client"},
                              to=request.sid, namespace=GPU_NAMESPACE)
        log.info("gpu-client %s: registered in room %s with %d slot(s) from %s", client_id, sess["room_id"],
                 len(slots), client["hostname"])
        notify.clients_changed(ctx, sess["room_id"], joined_or_left=True)
        ctx.scheduler.kick()
        return {"ok": True, "room_id": sess["room_id"],
                "heartbeat_interval": current_app.config["HEARTBEAT_INTERVAL"]}

    @socketio.on(EV_HEARTBEAT, namespace=GPU_NAMESPACE)
    def gpu_heartbeat(data):
        sess = _sessions.get(request.sid)
        if not sess or not sess["client_id"]:
            return {"ok": False, "error": "heartbeat before register"}
        ctx, now = _ctx(), time.time()
        stats = data.get("slots") if isinstance(data, dict) else None
        stats = [s for s in stats if isinstance(s, dict) and isinstance(s.get("index"), int)] \
            if isinstance(stats, list) else []
        # One store write: the client's deadline and its slots' stats, if it is still online.
        if not ctx.store.touch_client(sess["client_id"], {
                "last_seen": now, "lost_after": now + float(current_app.config["CLIENT_TIMEOUT"])}, stats,
                expect_status=ClientStatus.ONLINE.value):
            return {"ok": False, "error": "unknown or lost gpu client: register again"}
        notify.clients_changed(ctx, sess["room_id"])
        return {"ok": True}

    @socketio.on(EV_RANKS_EXITED, namespace=GPU_NAMESPACE)
    def gpu_ranks_exited(data):
        sess = _sessions.get(request.sid)
        if not sess or not sess["client_id"] or not isinstance(data, dict):
            return {"ok": False}
        ctx = _ctx()
        job = ctx.store.get_job(str(data.get("job_id")))
        if job is None or job.room_id != sess["room_id"]:
            return {"ok": False, "error": "no such job in this room"}
        exits = {str(k): int(v) for k, v in (data.get("exits") or {}).items()}
        lifecycle.ranks_exited(ctx, sess["client_id"], job.id, exits, int(data.get("attempt") or 0))
        return {"ok": True}

    @socketio.on("disconnect", namespace=GPU_NAMESPACE)
    def gpu_disconnect(*_):
        sess = _sessions.pop(request.sid, None)
        if not sess or not sess["client_id"]:
            return
        ctx = _ctx()
        client = ctx.store.get_client(sess["client_id"])
        if client and client.get("sid") == request.sid:
            # Not lost yet: a client that comes back within the timeout keeps its ranks.
            now = time.time()
            ctx.store.update_client(sess["client_id"], {"status": ClientStatus.OFFLINE.value, "sid": None,
                                                        "disconnected_at": now,
                                                        "lost_after": now + defaults.DISCONNECT_GRACE})
            log.info("gpu-client %s: disconnected", sess["client_id"])
            notify.clients_changed(ctx, sess["room_id"], joined_or_left=True)

    # -- dashboards --------------------------------------------------------------------------
    @socketio.on("connect", namespace=UI_NAMESPACE)
    def ui_connect(auth=None):
        room = _room_from_auth(auth)
        join_room(notify.ui_room(room["id"]))
        socketio.emit(EV_CLIENTS_UPDATE, notify.clients_payload(_ctx(), room["id"]), to=request.sid,
                      namespace=UI_NAMESPACE)
