"""The Socket.IO edge, before any token is looked at: what an anonymous peer can open and make
the server log.

- One address has at most ``SOCKET_SESSIONS_PER_ADDRESS`` Engine.IO sessions open (0: no cap;
  the client's address behind ``PROXY_HOPS`` proxies, as the rate limits see it; an IPv6 one
  by its /64): the next handshake is answered 429 and opens nothing.
- A session that has not connected to a namespace (/gpu with a donor token, /ui with a
  submitter token) within ``SOCKET_AUTH_TIMEOUT`` seconds is closed.
- A packet that is not Socket.IO (or nests deeper than ``json_limits.MAX_JSON_DEPTH``) closes
  its session and is logged as one WARNING line, at most one a minute with how many came since;
  Engine.IO's and Socket.IO's own errors and tracebacks are folded into such lines too (a
  traceback still goes to the DEBUG log).

    init_app(app, socketio, ctx)   # after socketio.init_app and the handlers' registration
"""
from __future__ import annotations

import json
import logging
import time

from flask import Flask

from ..errors import ZwdxError
from ..protocol import GPU_NAMESPACE, UI_NAMESPACE
from .connections import address_key

log = logging.getLogger(__name__)

#: Seconds between two looks for sessions that never authenticated.
SWEEP_EVERY = 1.0
#: Exceptions a packet that is not Socket.IO raises as it is decoded.
MALFORMED = (ValueError, TypeError, KeyError, IndexError, ZwdxError)


class Once:
    """A log line at most once per ``every`` seconds; the lines held back are counted in the next."""

    def __init__(self, every: float = 60.0):
        self.every, self.at, self.held = every, float("-inf"), 0

    def __call__(self, level: int, message: str, *args) -> None:
        now = time.monotonic()
        if now - self.at < self.every:
            self.held += 1
            return
        more = f" ({self.held} more since the last such line)" if self.held else ""
        log.log(level, message + more, *args)
        self.at, self.held = now, 0


class _FoldTracebacks(logging.Filter):
    """Engine.IO's and Socket.IO's loggers: a traceback a peer's packet caused becomes one
    rate-limited WARNING line (an unknown peer must not fill the log)."""

    def __init__(self, once: Once):
        super().__init__()
        self.once = once

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        error = record.exc_info[1] if record.exc_info else None
        self.once(logging.WARNING, "socket.io: a request or packet refused (%s: %s)",
                  type(error).__name__ if error else record.name, str(error or record.getMessage())[:200])
        if record.exc_info:  # kept for a server run with --verbose
            log.debug("socket.io: %s", record.getMessage(), exc_info=record.exc_info)
        return False


class SocketEdge:
    """The Engine.IO sessions of this process by address, and which have authenticated."""

    def __init__(self, app: Flask, server, ctx):
        cfg = ctx.settings
        self.server, self.ctx = server, ctx
        self.cap = cfg.socket_sessions_per_address
        self.auth_timeout = cfg.socket_auth_timeout
        self.by_address: dict[str, set[str]] = {}
        self.sessions: dict[str, tuple[str, float]] = {}  # eio sid -> (address key, opened at)
        self.waiting: set[str] = set()  # eio sids not yet in a namespace
        self.sweeping = False
        self.malformed = Once()
        self.refused = Once()
        handlers = server.eio.handlers
        self._connect, self._disconnect, self._message = (handlers["connect"], handlers["disconnect"],
                                                          handlers["message"])
        server.eio.on("connect", self.on_connect)
        server.eio.on("disconnect", self.on_disconnect)
        server.eio.on("message", self.on_message)

    def full(self, environ) -> bool:
        """Whether the address of this handshake holds its cap of sessions already."""
        return bool(self.cap) and len(self.by_address.get(_key(environ), ())) >= self.cap

    def on_connect(self, eio_sid, environ):
        key = _key(environ)
        self.sessions[eio_sid] = (key, time.monotonic())
        self.by_address.setdefault(key, set()).add(eio_sid)
        if self.auth_timeout:
            self.waiting.add(eio_sid)
            if not self.sweeping:
                self.sweeping = True
                self.server.start_background_task(self._sweep)
        return self._connect(eio_sid, environ)

    def on_disconnect(self, eio_sid, *reason):
        key, _ = self.sessions.pop(eio_sid, (None, 0))
        self.waiting.discard(eio_sid)
        held = self.by_address.get(key)
        if held is not None:
            held.discard(eio_sid)
            if not held:
                del self.by_address[key]
        return self._disconnect(eio_sid, *reason)

    def on_message(self, eio_sid, data):
        try:
            return self._message(eio_sid, data)
        except MALFORMED as exc:
            key = self.sessions.get(eio_sid, ("?", 0))[0]
            self.malformed(logging.WARNING, "socket.io: a packet from %s that is not Socket.IO (%s: %s); its session "
                           "is closed", key, type(exc).__name__, str(getattr(exc, "message", exc))[:200])
            self.close(eio_sid)

    def close(self, eio_sid: str) -> None:
        """Close the session now, without waiting for its peer to poll for the close packet
        (``eio.disconnect`` waits: an anonymous peer that never polls again held it)."""
        sock = self.server.eio.sockets.pop(eio_sid, None)
        if sock is not None:
            sock.close(wait=False, abort=True)
        else:
            self.on_disconnect(eio_sid, "closed")

    def _authenticated(self, eio_sid: str) -> bool:
        manager = self.server.manager
        return any(manager.sid_from_eio_sid(eio_sid, ns) for ns in (GPU_NAMESPACE, UI_NAMESPACE))

    def _sweep(self) -> None:
        """Close the sessions that have not authenticated in time (one look a second)."""
        while not self.ctx.stopping.wait(SWEEP_EVERY):
            now = time.monotonic()
            for eio_sid in list(self.waiting):
                if self._authenticated(eio_sid):
                    self.waiting.discard(eio_sid)
                elif now - self.sessions.get(eio_sid, ("", now))[1] > self.auth_timeout:
                    self.waiting.discard(eio_sid)
                    log.info("socket.io: session from %s closed: no namespace connected within %gs",
                             self.sessions.get(eio_sid, ("?",))[0], self.auth_timeout)
                    self.close(eio_sid)


def _key(environ) -> str:
    return address_key(environ.get("REMOTE_ADDR") or "?")  # behind PROXY_HOPS proxies, the client's (ProxyFix)


def init_app(app: Flask, socketio, ctx) -> SocketEdge:
    """Put the edge in front of the app's Socket.IO server (the module's docstring): inside
    ProxyFix, so that it sees the client's address."""
    edge = SocketEdge(app, socketio.server, ctx)
    path = "/socket.io"  # Flask-SocketIO's, which zwdx keeps
    inner = app.wsgi_app

    def refuse_excess(environ, start_response):
        if environ.get("PATH_INFO", "").startswith(path) and "sid=" not in environ.get("QUERY_STRING", "") \
                and edge.full(environ):
            edge.refused(logging.WARNING, "socket.io: refused a session from %s: it has %d open already",
                         _key(environ), edge.cap)
            body = json.dumps({"error": {"code": "too_many_requests", "message":
                               f"too many Socket.IO sessions from this address (at most {edge.cap}); close some "
                               f"and retry"}}).encode()
            start_response("429 Too Many Requests", [("Content-Type", "application/json"),
                                                     ("Content-Length", str(len(body)))])
            return [body]
        if not environ.get("PATH_INFO", "").startswith(path):
            return inner(environ, start_response)
        try:
            return inner(environ, start_response)
        except KeyError as exc:  # Engine.IO's for a request to a session it has just closed
            edge.malformed(logging.WARNING, "socket.io: a request for a session that is gone (%s)", exc)
            body = b'{"error": {"code": "bad_request", "message": "no such Socket.IO session"}}'
            start_response("400 Bad Request", [("Content-Type", "application/json"),
                                               ("Content-Length", str(len(body)))])
            return [body]

    app.wsgi_app = refuse_excess
    fold = _FoldTracebacks(edge.malformed)
    for name in ("engineio.server", "socketio.server"):
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, _FoldTracebacks)]:
            logger.removeFilter(old)  # an earlier app's, in a test process
        logger.addFilter(fold)
    return edge
