"""``zwdx server``: serve the API, Socket.IO and the dashboard; ``zwdx server backup|restore``."""
from __future__ import annotations

import logging
import os
import signal
import sys

from . import defaults, server_limits, sizes
from .cli_common import byte_size, version_line

log = logging.getLogger(__name__)

ASYNC_MODES = ("gevent", "threading")


def _patch_for_gevent() -> bool:
    """Give sockets, threads, locks and sleeps to gevent, before anything imports them, so that
    the server serves every connection from a greenlet of one OS thread. False (nothing
    patched) when gevent is not installed."""
    try:
        from gevent import monkey
    except ImportError:
        return False
    monkey.patch_all()
    return True


def _server(args) -> int:
    from .server import create_app, serve, socketio
    config = {"DATA_DIR": os.path.abspath(args.data_dir), "ASYNC_MODE": args.async_mode}
    if args.mongo_uri:
        config["MONGO_URI"] = args.mongo_uri
    if args.message_queue:
        config["MESSAGE_QUEUE"] = args.message_queue
    if args.max_artifact_bytes:
        config["MAX_ARTIFACT_BYTES"] = args.max_artifact_bytes
    if args.client_timeout:
        config["CLIENT_TIMEOUT"] = args.client_timeout
    if args.heartbeat_rate is not None:
        config["HEARTBEAT_RATE"] = args.heartbeat_rate
    if args.ui_dir:
        config["UI_DIR"] = args.ui_dir
    config.update(server_limits.flag_values(args))  # unset: the environment's ZWDX_<NAME>, else defaults.py
    if args.metrics_token_file:
        with open(args.metrics_token_file, encoding="utf-8") as f:
            config["METRICS_TOKEN"] = f.read().strip()
    if bool(args.tls_cert) != bool(args.tls_key):
        print("zwdx server: --tls-cert and --tls-key go together (the certificate chain and its private key)",
              file=sys.stderr)
        return 2
    context = None
    if args.tls_cert:
        from .tls import server_context
        try:
            context = server_context(args.tls_cert, args.tls_key)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            print(f"zwdx server: cannot use the TLS certificate {args.tls_cert} and key {args.tls_key}: {exc}",
                  file=sys.stderr)
            return 2
    elif args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("server: serving plain HTTP on %s: tokens and bundles cross the network unencrypted; pass "
                    "--tls-cert/--tls-key, or put a reverse proxy with TLS in front (docs/deploy-tls.md)", args.host)
    app = create_app(config)
    lease = app.extensions["zwdx"].lease
    if lease.shared:  # one of several: SIGTERM gives the scheduler's lease up, for another to take at once

        def _terminate(*_):
            lease.release()
            raise SystemExit(0)
        signal.signal(signal.SIGTERM, _terminate)
    print(f"zwdx server on {'https' if context else 'http'}://{args.host}:{args.port} (data in "
          f"{config['DATA_DIR']}, {socketio.async_mode})", flush=True)
    serve(app, args.host, args.port, context)
    return 0


def _server_backup(args) -> int:
    from .server import backup
    return backup.command(args)


def add_parser(sub) -> None:
    """The ``server`` subcommand and its ``backup``/``restore``."""
    p = sub.add_parser("server", help="run the zwdx server (API, Socket.IO, dashboard)")
    p.add_argument("--version", action="version", version=version_line(),
                   help="print zwdx's version and protocol, and exit")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0 for every one; "
                                                        "default %(default)s)")
    p.add_argument("--port", type=int, default=defaults.PORT, help="default %(default)s")
    p.add_argument("--data-dir", default=os.environ.get("ZWDX_DATA_DIR", "zwdx-data"),
                   help="embedded store and artifacts live here (default: $ZWDX_DATA_DIR, else zwdx-data)")
    p.add_argument("--mongo-uri", default=os.environ.get("ZWDX_MONGO_URI"),
                   help="use MongoDB instead of the embedded store")
    p.add_argument("--message-queue", default=os.environ.get("ZWDX_MESSAGE_QUEUE"), metavar="URL",
                   help="Socket.IO's message queue (redis://host:6379/0) shared by several server processes on one "
                        "store, behind a load balancer: docs/deploy-scale.md (default: $ZWDX_MESSAGE_QUEUE)")
    p.add_argument("--max-artifact-bytes", type=byte_size, default=None, metavar="SIZE",
                   help=f"largest artifact (bundle, checkpoint, weights; 100GiB, 512MB) "
                        f"(default: $ZWDX_MAX_ARTIFACT_BYTES, else {sizes.human(defaults.MAX_ARTIFACT_BYTES)})")
    p.add_argument("--client-timeout", type=float, default=None, help="seconds of silence before a GPU client is lost")
    p.add_argument("--heartbeat-rate", type=float, default=None,
                   help=f"heartbeats/s past which this process asks its GPU clients to beat less often, and waits "
                        f"longer before calling one lost (default {defaults.HEARTBEAT_RATE:g}; 0: never)")
    p.add_argument("--async-mode", choices=ASYNC_MODES, default=os.environ.get("ZWDX_ASYNC_MODE", "gevent"),
                   help="gevent: every connection a greenlet (default); threading: an OS thread per "
                        "connection (default: $ZWDX_ASYNC_MODE or %(default)s)")
    p.add_argument("--ui-dir", default=os.environ.get("ZWDX_UI_DIR"),
                   help="serve the dashboard from this build folder (default: $ZWDX_UI_DIR, else the one "
                        "installed with zwdx)")
    p.add_argument("--tls-cert", default=os.environ.get("ZWDX_TLS_CERT"), metavar="FILE",
                   help="serve HTTPS and WSS with this certificate chain (PEM; default: $ZWDX_TLS_CERT)")
    p.add_argument("--tls-key", default=os.environ.get("ZWDX_TLS_KEY"), metavar="FILE",
                   help="the private key of --tls-cert (PEM; default: $ZWDX_TLS_KEY)")
    server_limits.add_arguments(p)  # --room-max-jobs, --header-timeout, ...: declared with their settings
    p.add_argument("--metrics-token-file", default=None,
                   help="GET /metrics then answers 'Authorization: Bearer <the file's token>' from anywhere "
                        "(also $ZWDX_METRICS_TOKEN); without one it answers this machine only")
    p.set_defaults(func=_server)
    saves = p.add_subparsers(dest="server_action", metavar="{backup,restore}", help="(none: serve)")
    for action, what, path in (("backup", "copy the embedded store and its artifacts into the new folder DEST, "
                                "while the server runs (MongoDB: mongodump, docs/store.md)", "DEST"),
                               ("restore", "make --data-dir the backup SRC (stop the server first)", "SRC")):
        s = saves.add_parser(action, help=what)
        s.add_argument("path", metavar=path)
        s.add_argument("--data-dir", dest="backup_data_dir", default=None, metavar="DIR",
                       help="the server's data dir (default: $ZWDX_DATA_DIR, else zwdx-data)")
        if action == "restore":
            s.add_argument("--force", action="store_true", help="move a store already there aside (into "
                                                                 "DATA_DIR/before-restore-<time>) instead of refusing")
        s.set_defaults(func=_server_backup)
