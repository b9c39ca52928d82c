"""The zwdx server: a Flask app (REST API under /api/v1, the dashboard) plus Flask-SocketIO
(GPU clients on /gpu, browsers on /ui).

    create_app(config) -> app          # app.extensions["zwdx"] is the ServerContext
    serve(app, host, port)             # what `zwdx server` does

``ASYNC_MODE`` picks how connections are served. ``gevent`` (what ``zwdx server`` runs): every
HTTP request, Socket.IO connection and background loop is a greenlet of one OS thread, in a
process that gevent monkey-patched before anything imported socket or threading (the CLI
does that first). ``threading`` (create_app's default, for tests that build an app in their
own process): Werkzeug's server with one OS thread per connection. The server code is the
same for both: it uses threading's primitives, which gevent patches into greenlet ones, and
store calls that either block the hub only briefly (SQLite) or yield to it (pymongo).
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import types

from flask import Flask
from flask.json.provider import DefaultJSONProvider
from socketio import packet as socketio_packet

from .. import defaults
from ..protocol.base import loads
from ..protocol.report import to_wire
from . import (api, checkpoints, collector, connections, dashboard_api, datasets, diloco, disk, events, json_limits,
               limits, links, notify, openapi, prometheus, proxies, scripts, socket_edge, tokens, ui, versions)
from .artifacts import FileArtifactStore
from .auth import CredentialCache
from .batches import EventWriter
from .extensions import Encoded, socketio
from .lease import NAME as SCHEDULER_LEASE, Lease
from .placement import RecentClients
from .presence import Presence
from .roomview import RoomViews, observe
from .scheduler import Scheduler
from .settings import ServerConfig
from .store import open_store
from .sweeper import Sweeper

__all__ = ["create_app", "serve", "socketio", "ServerContext"]

log = logging.getLogger(__name__)

ASYNC_MODES = ("gevent", "threading")


def gevent_patched() -> bool:
    """True in a process that gevent monkey-patched (``zwdx server`` in gevent mode)."""
    monkey = sys.modules.get("gevent.monkey")
    return bool(monkey and monkey.is_module_patched("socket"))


#: Sent with every response. The dashboard's build loads its scripts and styles from this
#: server only and talks to it alone (REST and Socket.IO); no page may be framed.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
                               "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; "
                               "form-action 'self'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def _security_headers(response):
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)  # a page with inline parts (the API's docs) sets its own CSP
    return response


class WireJSON(DefaultJSONProvider):
    """JSON as zwdx answers it: a NaN or infinite number (a diverged loss, in a record an older
    zwdx stored) goes out as the string "NaN", "Infinity" or "-Infinity", never as a bare token
    that browsers cannot parse. The models write them so already; this is the net under them."""

    def dumps(self, obj, **kwargs):
        return wire_dumps(obj, **{"default": self.default, "ensure_ascii": self.ensure_ascii,
                                  "sort_keys": self.sort_keys, **kwargs})


def wire_dumps(obj, **kwargs) -> str:
    """``json.dumps`` that writes non-finite numbers as strings (also Socket.IO's encoder: a
    packet's ``[event, data]`` whose data is ``Encoded`` JSON takes it as it is)."""
    if type(obj) is list and any(type(item) is Encoded for item in obj):
        return "[" + ",".join(item if type(item) is Encoded else wire_dumps(item, **kwargs) for item in obj) + "]"
    try:
        return json.dumps(obj, allow_nan=False, **kwargs)
    except ValueError:
        return json.dumps(to_wire(obj), allow_nan=False, **kwargs)


def wire_loads(text, **kwargs):
    """``json.loads`` through orjson (``protocol.base.loads``): every Socket.IO packet a GPU client
    sends is read with it, once its nesting is within ``json_limits.MAX_JSON_DEPTH`` (a packet
    nested deeper is malformed: ``socket_edge``)."""
    json_limits.check_text(text)
    return json.loads(text, **kwargs) if kwargs else loads(text)


#: What Socket.IO encodes and reads its packets with.
SOCKET_JSON = types.SimpleNamespace(dumps=wire_dumps, loads=wire_loads)


class JsonPacket(socketio_packet.Packet):
    """The Socket.IO packets the server sends: JSON, never with binary attachments (every
    message is a JSON model; bytes travel over HTTP). Otherwise python-socketio walks each
    payload it sends, element by element, for bytes to split off: a dashboard's list of 1,000
    GPU clients at every push. Packets that come in are read as before."""
    uses_binary_events = False


def private_dir(path: str) -> str:
    """Create ``path`` (0700), or make it private if it is not: the data dir holds the store and
    every artifact."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    if os.stat(path).st_mode & 0o077:
        os.chmod(path, 0o700)
        log.info("server: data dir %s made private (0700)", path)
    return path


class ServerContext:
    """What every part of the server shares: config, store, artifact bytes, scheduler, sweeper,
    rate limiter."""

    def __init__(self, app: Flask, settings: ServerConfig):
        #: the settings, checked once (``settings.py``); ``config`` is Flask's mirror of them
        self.settings = settings
        self.config = app.config
        if not settings.mongo_uri:
            private_dir(settings.data_dir)
        self.store = open_store(settings.data_dir, settings.mongo_uri)
        if settings.mongo_uri:
            from .store.gridfs import GridFSArtifactStore  # pymongo, imported only when used
            self.artifacts = GridFSArtifactStore(settings.mongo_uri)
        else:
            self.artifacts = FileArtifactStore(os.path.join(settings.data_dir, "artifacts"))
        #: whether this process leads (runs the scheduler and the sweeper): always alone, the
        #: lease's holder among processes that share a store and a message queue (``lease.py``)
        self.lease = Lease(self.store, shared=bool(settings.message_queue),
                           ttl=settings.scheduler_lease_ttl or defaults.SCHEDULER_LEASE_TTL)
        self.scheduler = Scheduler(self)
        #: the GPU clients this process holds, alive in memory (``presence.py``)
        self.presence = Presence(self, settings.message_queue)
        #: each room's GPU clients as placement reads them, kept by the store's writes (``roomview.py``)
        self.views = RoomViews(self.store, settings.message_queue)
        observe(self.store, self.views)
        #: ranks' events, written in batches (``batches.py``)
        self.events = EventWriter(self.store)
        #: each room's GPU clients as read lately, for the submit-time hint (``placement.RecentClients``)
        self.recent_clients = RecentClients(self.store, views=self.views)
        self.sweeper = Sweeper(self)
        self.limiter = None  # limits.init_app, once the routes are registered
        self.stopping = threading.Event()
        #: token hash -> its credential and room, as read lately (``auth.CredentialCache``)
        self.credentials = CredentialCache()
        #: Socket.IO sid -> (namespace, credential id, its hash then) of the connections to this process
        self.connections: dict[str, tuple[str, str, str | None]] = {}
        #: the rooms' GPU-client lists waiting to go to the dashboards (``notify.clients_changed``)
        self.pushes = notify.ClientPushes()

    def reconfigure(self, **changes) -> ServerConfig:
        """Change settings while the app runs (a test's ``START_TIMEOUT=0.3``), checked as at start;
        what was built from the old ones at start (the limiter's storage, the sockets) stays."""
        self.settings = self.settings.replace(**changes)
        self.config.update(self.settings.as_config())
        return self.settings

    def close(self) -> None:
        """Stop the background loops and release the store (an app in a test, at its end)."""
        self.stopping.set()
        self.scheduler.stop()
        self.sweeper.stop()
        self.presence.stop()
        self.lease.release()
        self.store.close()
        close = getattr(self.artifacts, "close", None)
        if close:
            close()


def create_app(config: dict | None = None) -> Flask:
    app = Flask(__name__, static_folder=None)
    # defaults < ZWDX_<KEY> < config, checked once (settings.py); app.config mirrors them for Flask
    settings = ServerConfig.from_sources(config, os.environ)
    app.config.from_prefixed_env("ZWDX")  # a key not (yet) in ServerConfig still reads from ZWDX_<KEY>
    app.config.update(config or {})
    app.json = WireJSON(app)
    if settings.async_mode == "gevent" and not gevent_patched():
        log.warning("server: ASYNC_MODE gevent needs a process gevent monkey-patched first (as `zwdx server` "
                    "does); serving with threads instead")
        settings = settings.replace(async_mode="threading")
    settings = settings.replace(ui_dir=ui.find_dashboard(settings.ui_dir))
    app.config.update(settings.as_config())
    # Every body but an artifact's (those stream within their own limit, ``http.save_artifact``).
    app.config["MAX_CONTENT_LENGTH"] = settings.max_request_bytes
    mode = settings.async_mode
    ctx = ServerContext(app, settings)
    app.extensions["zwdx"] = ctx

    app.register_blueprint(api.bp)
    app.register_blueprint(checkpoints.bp)
    app.register_blueprint(dashboard_api.bp)
    app.register_blueprint(datasets.bp)
    app.register_blueprint(diloco.bp)
    app.register_blueprint(links.bp)
    app.register_blueprint(openapi.bp)
    app.register_blueprint(prometheus.bp)
    app.register_blueprint(scripts.bp)
    app.register_blueprint(tokens.bp)
    app.register_blueprint(ui.bp)
    api.register_error_handlers(app)
    app.after_request(_security_headers)
    versions.init_app(app)
    prometheus.observe_requests(app)
    ctx.limiter = limits.init_app(app)
    disk.init_app(app)
    queue = {"message_queue": settings.message_queue} if settings.message_queue else {}
    # No Flask session is used: its copy per event is saved. A client's events are handled on its
    # connection's own reader, in order, not each in a new thread (greenlet) that then waits its
    # turn again: no handler waits on anything but the store (events.py).
    socketio.init_app(app, async_mode=mode, max_http_buffer_size=1024 * 1024, json=SOCKET_JSON, serializer=JsonPacket,
                      manage_session=False, async_handlers=False, cors_allowed_origins=proxies.OriginCheck(), **queue)
    events.register(socketio, ctx)
    ctx.socket_edge = socket_edge.init_app(app, socketio, ctx)
    if ctx.lease.shared:  # a token revoked through another process closes this one's connections too
        ctx.lease.every_try.append(lambda: tokens.close_revoked(ctx))
    proxies.install(app)  # the client's address behind PROXY_HOPS proxies, for rate limits and /metrics
    ctx.scheduler.start(app)
    ctx.presence.start(app)
    ctx.views.start(ctx.stopping)
    ctx.sweeper.start()
    ctx.lease.start(ctx.stopping)
    log.info("server: store %s, data dir %s, async mode %s, dashboard from %s", type(ctx.store).__name__,
             settings.data_dir, mode, settings.ui_dir)
    if not ctx.lease.shared and ctx.store.lease_holder(SCHEDULER_LEASE):
        log.warning("server: another server process on this store runs with a message queue (it holds the "
                    "scheduler's lease), and this one without: this one schedules too and cannot reach that one's GPU "
                    "clients. Start every server process with the same ZWDX_MESSAGE_QUEUE (docs/deploy-scale.md)")
    if ctx.lease.shared:
        log.info("server: one of several processes (message queue %s); this one is %s", _without_password(
            settings.message_queue), ctx.lease.holder)
    return app


def _without_password(url: str) -> str:
    """The URL as a log may show it: a password in it replaced by ``***``."""
    from urllib.parse import urlsplit
    parts = urlsplit(url)
    if parts.password:
        return url.replace(f":{parts.password}@", ":***@", 1)
    return url


def serve(app: Flask, host: str, port: int, ssl_context=None) -> None:
    """Serve the app until the process ends: gevent's WSGI server in gevent mode (websockets
    through simple-websocket), Werkzeug's threaded one otherwise. With ``ssl_context``
    (``zwdx.tls.server_context``, ``zwdx server --tls-cert/--tls-key``) both serve HTTPS and WSS
    only."""
    open_files = _raise_open_files_limit()
    ctx = app.extensions["zwdx"]
    ctx.store.serving()
    if not ctx.settings.mongo_uri:  # held until the process ends: `zwdx server restore` refuses meanwhile
        from .backup import serving
        ctx.serving_lock = serving(ctx.settings.data_dir)
    collector.keep_pauses_short(ctx.stopping)
    tls = {"ssl_context": ssl_context} if ssl_context is not None else {}
    if socketio.async_mode == "gevent":
        from gevent.pool import Pool
        holds = connections.capacity(open_files)
        log.info("server: holds up to %d connections at once (open files %d; past that they wait to be accepted); "
                 "headers within %gs, idle connections closed after %gs, %s connections per address", holds,
                 open_files, ctx.settings.header_timeout, ctx.settings.idle_timeout,
                 ctx.settings.max_connections_per_address or "any")
        if ssl_context is not None:  # the handshake on the first read, within the header timeout
            tls["do_handshake_on_connect"] = False
        socketio.run(app, host=host, port=port, log_output=False, handler_class=connections.handler_class(ctx.settings),
                     spawn=Pool(holds), **tls)
    else:
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        socketio.run(app, host=host, port=port, allow_unsafe_werkzeug=True, log_output=False, **tls)


def _raise_open_files_limit() -> int:
    """Lift the soft limit on open files to the hard one: every GPU client and dashboard holds a
    connection (two descriptors under gevent, where simple-websocket works on a duplicate of
    the socket), and the usual soft limit of 1,024 ends near 500 GPU clients."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    except (ImportError, ValueError, OSError) as exc:
        log.warning("server: cannot raise the open files limit: %s", exc)
        return 1024
    return soft
