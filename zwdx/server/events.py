"""Socket.IO: GPU clients on /gpu (register, heartbeat, ranks exited) and dashboards on /ui.

A GPU client connects to /gpu with a donor token of its room, a dashboard to /ui with a
submitter token (``auth.py``); any other connection is refused, saying which token it takes.
A GPU client then only ever touches its own room's slots and jobs: its first ``register`` of
a client id is answered with a client secret, which every later one must present (a register
without it changes nothing), and its ``ranks_exited`` speaks only for ranks placed on it.

Every /gpu payload is checked once, against its type in ``zwdx.protocol.gpu`` (``Register``,
``Heartbeat``, ``RanksExited``, ``Unreachable``), before its handler sees it: a wrong one is answered
``Ack(ok=False, error=...)`` naming the field and what was expected, and changes nothing. The
handlers receive typed messages and answer typed answers; none raises (an unexpected error is
logged and answered as a refusal). They sit at module level (Flask-SocketIO-Chat's habit);
``register(socketio)`` binds them.
"""
from __future__ import annotations

import functools
import hmac
import logging
import math
import time

from flask import current_app, request
from flask_socketio import ConnectionRefusedError, join_room
from pydantic import BaseModel

from .. import __version__, defaults
from ..errors import AuthError, BadRequest, Forbidden, RateLimited
from ..protocol import (EV_CLIENTS_UPDATE, EV_HEARTBEAT, EV_JOB_CANCEL, EV_RANKS_EXITED, EV_REGISTER,
                        EV_UNREACHABLE, GPU_NAMESPACE, UI_NAMESPACE, ClientStatus)
from ..protocol.base import PROTOCOL, incompatible, parse
from ..protocol.gpu import Ack, Heartbeat, HeartbeatAnswer, RanksExited, Register, RegisterAnswer, Unreachable
from ..protocol.tokens import CLIENT_SECRET_PREFIX
from . import addresses, donors, jobs, json_limits, limits, notify, reach
from .auth import Caller, donor, hash_secret, new_secret, submitter

log = logging.getLogger(__name__)

#: sid -> {"client_id", "room_id"} for connected GPU clients of this server process.
_sessions: dict[str, dict] = {}

#: Why a register is refused, for the agent (``RegisterAnswer.code``).
WRONG_SECRET = "client_secret"


def _ctx():
    return current_app.extensions["zwdx"]


def _socketio():
    return current_app.extensions["socketio"]


def _caller_from_auth(auth, namespace: str) -> Caller:
    """The token of a connection's ``auth``, which must be a donor's on /gpu and a submitter's on
    /ui; the connection is refused with the reason otherwise. It is noted in
    ``ServerContext.connections`` (revoking the token closes it)."""
    token = auth.get("token") if isinstance(auth, dict) else None
    try:
        limits.socket_auth()  # an address that failed too often is refused before its token is looked up
        caller = (donor if namespace == GPU_NAMESPACE else submitter)(token if isinstance(token, str) else None)
    except (AuthError, Forbidden) as err:
        limits.socket_auth(ok=False)
        raise ConnectionRefusedError(err.message)
    except RateLimited as err:
        raise ConnectionRefusedError(err.message)
    _ctx().connections[request.sid] = (namespace, caller.credential["id"], caller.credential.get("hash"))
    return caller


def checked(event: str, model: type[BaseModel]):
    """A /gpu handler that receives ``event``'s payload as ``model``, once it is one, and whose
    answer goes back as JSON. A payload that is not gets ``Ack(ok=False)`` with the field and
    what was expected; a handler that fails gets it too, with the error logged."""
    def decorate(handler):
        @functools.wraps(handler)
        def on_event(*args):
            return _answered(event, model, handler, args)
        return on_event
    return decorate


def _answered(event: str, model: type[BaseModel], handler, args: tuple) -> dict:
    """``checked``'s work: the payload as ``model`` to ``handler``, its answer (or why not) as JSON."""
    try:
        if len(args) != 1:
            raise BadRequest(f"{event}: send one JSON object, got {len(args)} argument(s)")
        json_limits.refuse_nul_key_in(args[0], event)
        message = parse(model, args[0], event)
    except BadRequest as err:
        return Ack(ok=False, error=err.message).model_dump(exclude_none=True)
    try:
        answer = handler(message)
    except Exception:
        log.exception("gpu-client event %s: handler failed", event)
        answer = Ack(ok=False, error=f"{event}: the server could not handle it (see its log)")
    return answer.model_dump(mode="json", exclude_none=True)


def _session() -> dict | None:
    """The registered GPU client on this connection, or None."""
    sess = _sessions.get(request.sid)
    return sess if sess and sess["client_id"] else None


# -- GPU clients -------------------------------------------------------------------------------
def on_gpu_connect(auth=None):
    said = auth if isinstance(auth, dict) else {}
    mismatch = incompatible(said.get("protocol"), "GPU client", "server", said.get("zwdx"), __version__)
    if mismatch:  # before its token: a client of another major is told so, whatever token it holds
        log.warning("gpu-client connection refused: %s", mismatch)
        raise ConnectionRefusedError(mismatch)
    caller = _caller_from_auth(auth, GPU_NAMESPACE)
    _sessions[request.sid] = {"room_id": caller.room["id"], "client_id": None, "token_id": caller.credential["id"]}


def _client_secret(hello: Register, existing: dict | None, sess: dict) -> tuple[str | None, str | None, str | None]:
    """``(secret_hash, new_secret, refusal)`` for this register: the hash the client keeps, the
    secret to hand out (its first register, or one of a client registered before secrets), or
    why it is refused. A connection that registered this id already needs no secret again."""
    held = (existing or {}).get("secret_hash")
    if held:
        proven = sess["client_id"] == hello.client_id
        if not proven and not (hello.client_secret and hmac.compare_digest(hash_secret(hello.client_secret), held)):
            return None, None, (f"gpu client id {hello.client_id} is registered already, and this register does "
                                f"not carry its client secret: an agent that lost its secret registers under a "
                                f"new id")
        return held, None, None
    secret = new_secret(CLIENT_SECRET_PREFIX)
    return hash_secret(secret), secret, None


@checked(EV_REGISTER, Register)
def on_register(hello: Register) -> RegisterAnswer:
    sess = _sessions.get(request.sid)
    if sess is None:
        return RegisterAnswer(ok=False, error="register needs a connect with a donor token first")
    ctx, now, client_id = _ctx(), time.time(), hello.client_id
    existing = ctx.store.get_client(client_id)
    if existing and existing["room_id"] != sess["room_id"]:
        return RegisterAnswer(ok=False, error=f"gpu client id {client_id} belongs to another room")
    secret_hash, secret, refusal = _client_secret(hello, existing, sess)
    if refusal is not None:
        log.warning("gpu-client %s: register refused in room %s: no right client secret", client_id, sess["room_id"])
        return RegisterAnswer(ok=False, error=refusal, code=WRONG_SECRET)
    refusal = donors.refusal(ctx, sess["room_id"], sess.get("token_id"), hello, existing)
    if refusal is not None:
        log.warning("gpu-client %s: register refused in room %s: %s", client_id, sess["room_id"], refusal)
        return RegisterAnswer(ok=False, error=refusal)
    pace = heartbeat_pace(ctx)
    slots = [{"id": f"{client_id}:{s.index}", "client_id": client_id, "room_id": sess["room_id"], "index": s.index,
              "kind": s.kind.value, "name": s.name, "memory_total": s.memory_total, "memory_free": s.memory_free,
              "utilization": s.utilization, "isolation": s.isolation and s.isolation.value,
              "terms": s.terms and s.terms.model_dump(mode="json")} for s in hello.slots]
    client = {"id": client_id, "room_id": sess["room_id"], "hostname": hello.hostname, "host_id": hello.host_id,
              # one string: cheap to read
              "modules": None if hello.modules is None else " ".join(sorted(set(hello.modules))),
              "versions": hello.versions, "advertise_addr": hello.advertise_addr, "reach_port": hello.reach_port,
              "seen_addr": addresses.seen_address(request.remote_addr),  # addresses.egress_addresses: not its word
              # its link as measured now, else as last measured (a client measures every LINK_REFRESH s)
              "link": hello.link.model_dump() if hello.link else (existing or {}).get("link"),
              "unreachable": (existing or {}).get("unreachable") or [],  # reach.py: kept across registers
              "running_jobs": running_jobs(hello.running),
              "status": ClientStatus.ONLINE.value, "sid": request.sid, "last_seen": now, "server": ctx.presence.server,
              # held by this process (presence.py): none in the store, unless the store keeps deadlines
              "lost_after": now + pace[1] if ctx.presence.deadlines_in_store else None, "disconnected_at": None,
              "connected_at": now, "registered_at": (existing or {}).get("registered_at", now),
              "secret_hash": secret_hash, "token_id": sess.get("token_id")}
    if not ctx.store.upsert_client(client, slots):  # registered meanwhile, by another connection
        return RegisterAnswer(ok=False, error=f"gpu client id {client_id} was registered by another connection "
                                              f"just now: register under a new id", code=WRONG_SECRET)
    sess["client_id"], sess["interval"] = client_id, pace[0]
    ctx.presence.joined(client_id, sess["room_id"], request.sid, now, now + pace[1], slots, client["running_jobs"])
    running = {r.job_id: r.attempt for r in hello.running}  # the jobs it still runs ranks of
    jobs.forget_ranks_gone(ctx, sess["room_id"], client_id, running)
    for cancel in jobs.not_wanted(ctx, client_id, running):
        _socketio().emit(EV_JOB_CANCEL, cancel.model_dump(), to=request.sid, namespace=GPU_NAMESPACE)
    log.info("gpu-client %s: registered in room %s with %d slot(s) from %s", client_id, sess["room_id"],
             len(slots), client["hostname"])
    notify.clients_changed(ctx, sess["room_id"], joined_or_left=True)
    ctx.scheduler.kick()
    return RegisterAnswer(ok=True, room_id=sess["room_id"], heartbeat_interval=pace[0], client_secret=secret,
                          protocol=PROTOCOL, zwdx=__version__)


def running_jobs(running) -> list[str]:
    """What a client says it runs, as kept on its record ("job:attempt"): a placement that does not
    start is then held against the clients that never said so (``jobs.not_started``)."""
    return [f"{r.job_id}:{r.attempt}" for r in running]


def heartbeat_pace(ctx) -> tuple[float, float]:
    """(the heartbeat interval this process asks of its GPU clients, the silence after which one
    is lost). ``HEARTBEAT_INTERVAL`` and ``CLIENT_TIMEOUT``, both stretched once the process's
    connections would beat more than ``HEARTBEAT_RATE`` times a second together at that interval:
    in 0.5 s steps, at most ``HEARTBEAT_MAX_STRETCH`` times. A heartbeat costs a server process
    about a millisecond, so 250 a second is a quarter of it; past that, figures a few seconds
    staler and a slower verdict on a silent client buy room for everything else (see
    docs/deploy-scale.md)."""
    base, timeout = ctx.settings.heartbeat_interval, ctx.settings.client_timeout
    rate = ctx.settings.heartbeat_rate
    if rate <= 0:
        return base, timeout
    wanted = math.ceil(2.0 * len(_sessions) / rate) / 2.0
    interval = min(max(base, wanted), base * defaults.HEARTBEAT_MAX_STRETCH)
    return interval, timeout * interval / base


def heartbeat(ctx, sid: str, beat: Heartbeat) -> HeartbeatAnswer:
    """A registered client's heartbeat. Bound on python-socketio's own server (``register``), not
    through Flask-SocketIO: the most frequent event needs only its connection and the server's
    context, not the Flask request context Flask-SocketIO makes for every event (8% of a
    server's time at 1,000 clients)."""
    sess = _sessions.get(sid)
    if sess is None or not sess["client_id"]:
        return HeartbeatAnswer(ok=False, error="heartbeat before register")
    now = time.time()
    # only the figures it sent; a null says nothing (stored, it would break every read of the room)
    stats = [s.model_dump(exclude_unset=True, exclude_none=True) for s in beat.slots]
    interval, timeout = heartbeat_pace(ctx)
    told = sess.get("interval") or interval
    # In this process's memory, not the store (presence.py). Until it hears of a new pace it beats
    # at the one it was told: the deadline allows for the longer.
    if not ctx.presence.beat(sess["client_id"], sid, now, now + timeout * max(interval, told) / interval, stats,
                             running_jobs(beat.running)):
        return HeartbeatAnswer(ok=False, error="unknown or lost gpu client: register again")
    notify.clients_changed(ctx, sess["room_id"])
    if interval != told:
        sess["interval"] = interval
        return HeartbeatAnswer(ok=True, heartbeat_interval=interval)
    return HeartbeatAnswer(ok=True)


@checked(EV_RANKS_EXITED, RanksExited)
def on_ranks_exited(report: RanksExited) -> Ack:
    sess = _session()
    if sess is None:
        return Ack(ok=False, error="ranks_exited before register")
    ctx = _ctx()
    job = ctx.store.get_job(report.job_id)
    if job is None or job.room_id != sess["room_id"]:
        return Ack(ok=False, error="no such job in this room")
    exits = {str(int(rank)): code for rank, code in report.exits.items()}
    if report.attempt == job.attempt:  # an older attempt's exits change nothing (jobs.ranks_exited ignores them)
        placed = {str(p.rank): p.client_id for p in job.placement or []}
        foreign = sorted((r for r in exits if placed.get(r) != sess["client_id"]), key=int)
        if foreign:
            log.warning("gpu-client %s: ranks_exited for rank(s) %s of job %s refused: not placed on it",
                        sess["client_id"], ", ".join(foreign), job.id)
            return Ack(ok=False, error=f"rank(s) {', '.join(foreign)} of job {job.id} (attempt {job.attempt}) are "
                                       f"not placed on this gpu client")
    jobs.ranks_exited(ctx, sess["client_id"], job.id, exits, report.attempt)
    return Ack(ok=True)


@checked(EV_UNREACHABLE, Unreachable)
def on_unreachable(report: Unreachable) -> Ack:
    sess = _session()
    if sess is None:
        return Ack(ok=False, error="unreachable before register")
    return reach.reported(_ctx(), sess["room_id"], sess["client_id"], report)


def on_gpu_disconnect(*_):
    _ctx().connections.pop(request.sid, None)
    sess = _sessions.pop(request.sid, None)
    if not sess or not sess["client_id"]:
        return
    ctx = _ctx()
    live = ctx.presence.left(sess["client_id"], request.sid)
    try:
        client = ctx.store.get_client(sess["client_id"])
        if client and client.get("sid") == request.sid:
            # Not lost yet: a client that comes back within the timeout keeps its ranks.
            now = time.time()
            seen = {"last_seen": live.last_seen} if live else {}
            ctx.store.update_client(sess["client_id"], {**seen, "status": ClientStatus.OFFLINE.value, "sid": None,
                                                        "disconnected_at": now,
                                                        "lost_after": now + defaults.DISCONNECT_GRACE})
            log.info("gpu-client %s: disconnected", sess["client_id"])
            notify.clients_changed(ctx, sess["room_id"], joined_or_left=True)
    except Exception:  # the reaper declares it lost on the clock anyway
        log.exception("gpu-client %s: disconnect not recorded", sess["client_id"])


# -- dashboards --------------------------------------------------------------------------------
def on_ui_connect(auth=None):
    room = _caller_from_auth(auth, UI_NAMESPACE).room
    join_room(notify.ui_room(room["id"]))
    _socketio().emit(EV_CLIENTS_UPDATE, notify.clients_payload(_ctx(), room["id"]), to=request.sid,
                     namespace=UI_NAMESPACE)


def on_ui_disconnect(*_):
    _ctx().connections.pop(request.sid, None)


def register(socketio, ctx) -> None:
    """Bind the handlers to ``socketio`` (the app's Flask-SocketIO, after its ``init_app``; ``ctx``
    the app's ``ServerContext``)."""
    for event, handler in (("connect", on_gpu_connect), (EV_REGISTER, on_register),
                           (EV_RANKS_EXITED, on_ranks_exited), (EV_UNREACHABLE, on_unreachable),
                           ("disconnect", on_gpu_disconnect)):
        socketio.on_event(event, handler, namespace=GPU_NAMESPACE)
    socketio.server.on(EV_HEARTBEAT, lambda sid, *args: _answered(
        EV_HEARTBEAT, Heartbeat, functools.partial(heartbeat, ctx, sid), args), namespace=GPU_NAMESPACE)
    socketio.on_event("connect", on_ui_connect, namespace=UI_NAMESPACE)
    socketio.on_event("disconnect", on_ui_disconnect, namespace=UI_NAMESPACE)
