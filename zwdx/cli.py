"""The `zwdx` command: server, room create|tokens|show|clients, gpu-client, run (a torchrun script), jobs
(``jobs_cli.py``), data (a room's datasets, ``data_cli.py``).

Which token goes where: ``zwdx room create`` prints a submitter token (``zs_``: ``zwdx jobs``,
``zwdx room tokens``, the SDK, the dashboard) and a donor token (``zd_``: ``zwdx gpu-client``).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from . import data_cli, defaults, jobs_cli, sizes, tuning
from .errors import ZwdxError
from .token_source import token_from

log = logging.getLogger(__name__)

DEFAULT_SERVER = os.environ.get("ZWDX_SERVER_URL", f"http://localhost:{defaults.PORT}")
ASYNC_MODES = ("gevent", "threading")
#: ``zwdx gpu-client --isolation`` (``zwdx.protocol.Isolation``).
ISOLATIONS = ("docker", "user", "process")


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
    for name in ("max_request_bytes", "room_max_jobs", "room_max_artifact_bytes", "rate_limit_rooms",
                 "rate_limit_auth_failures", "artifact_retention", "sweep_interval", "start_timeout", "start_tries",
                 "donor_max_clients", "client_max_slots", "rate_limit_registers", "room_max_events",
                 "rate_limit_events", "max_series_points", "min_free_bytes", "client_retention"):
        if getattr(args, name) is not None:  # unset: the environment's ZWDX_<NAME>, else defaults.py
            config[name.upper()] = getattr(args, name)
    for name in ("header_timeout", "idle_timeout", "body_timeout", "max_connections_per_address",
                 "socket_sessions_per_address", "socket_auth_timeout", "proxy_hops"):
        if getattr(args, name) is not None:
            config[name.upper()] = getattr(args, name)
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


def _room_create(args) -> int:
    from .sdk import ZWDX
    if args.token_dir and all(os.path.exists(os.path.join(args.token_dir, f)) for f in TOKEN_FILES):
        print(f"a room was created already: its tokens are in {args.token_dir}")
        return 0
    room = ZWDX(args.server, remember=not args.token_dir, ca_file=args.ca_file).create_room(args.name or "")
    if args.token_dir:
        _save_tokens(args.token_dir, room)
        print(f"room {room['name']} ({room['id']}) created; its tokens are in {args.token_dir} "
              f"({', '.join(TOKEN_FILES)}, each 0600)")
    elif args.json:
        print(json.dumps(room))
    else:
        print(f"room {room['name']} ({room['id']}) created. Its tokens, shown only now (the server keeps "
              f"their hashes only):")
        print("submitter token: submits jobs, reads results, opens the dashboard, manages tokens (zwdx room tokens)")
        print(room["submitter_token"])
        print("donor token: for the GPU clients lent to the room (zwdx gpu-client), nothing else")
        print(room["donor_token"])
    return 0


#: What ``zwdx room create --token-dir DIR`` writes: each token in a file of its own.
TOKEN_FILES = ("submitter_token", "donor_token")


def _save_tokens(folder: str, room: dict) -> None:
    """Each token of ``room`` in its own file of ``folder``, readable by this user only."""
    os.makedirs(folder, exist_ok=True)
    for name in TOKEN_FILES:
        tmp = os.path.join(folder, f".{name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as fh:
            fh.write(room[name] + "\n")
        os.replace(tmp, os.path.join(folder, name))


def _room_tokens(args) -> int:
    tokens = _sdk(args).tokens
    if args.tokens_action == "list":
        shown = tokens.list()
    elif args.tokens_action == "create":
        shown = [tokens.create(args.role, args.name or "")]
    elif args.tokens_action == "revoke":
        shown = [tokens.revoke(args.token_id)]
    else:
        shown = tokens.rotate(args.token_id)
    if args.json:
        print(json.dumps(shown if args.tokens_action in ("list", "rotate") else shown[0]))
        return 0
    for token in shown:
        role = token["role"] + (" (legacy: also a donor token; rotate it)" if token.get("legacy") else "")
        state = "revoked" if token.get("revoked_at") else "active"
        print(f"{token['id']}  {role:<10} {state:<8} {token.get('name') or '-'}" + ("  (this one)" if token.get("own") else ""))
        if token.get("token"):
            print(f"  its secret, shown only now: {token['token']}")
    return 0


def _refresh_gpu_clients(work_dir: str | None) -> int:
    """``zwdx gpu-client --refresh``: SIGHUP to the agents running on the work dir, which read
    again what their ranks can import (a package installed since they started)."""
    from gpu_client.agent.workspace import default_root, running_agents
    root = os.path.abspath(work_dir or default_root())
    agents = running_agents(root)
    if not agents:
        print(f"zwdx gpu-client --refresh: no gpu client runs on the work dir {root} (--work-dir)", file=sys.stderr)
        return 1
    for name, pid in agents.items():
        os.kill(pid, signal.SIGHUP)
        print(f"gpu client {name} (pid {pid}): reading again what its ranks can import; it registers again if "
              f"that changed (its log says what it found)")
    return 0


def version_line() -> str:
    """What ``--version`` prints: zwdx's version, its protocol (docs/operations.md, Upgrades), its Python."""
    import platform

    from . import __version__
    from .protocol.base import PROTOCOL
    return f"zwdx {__version__} (protocol {PROTOCOL}, Python {platform.python_version()})"


class _Refused(Exception):
    """What ``zwdx gpu-client`` cannot take from its flags: said, then exit 2."""


def _gpu_client(args) -> int:
    from gpu_client.agent.agent import serve
    if args.refresh:
        return _refresh_gpu_clients(args.work_dir)
    try:
        config = _agent_config(args)
    except _Refused as refused:
        print(f"zwdx gpu-client: {refused}", file=sys.stderr)
        return 2
    return serve(config)


def _agent_config(args):
    """The donor's ``AgentConfig`` from its flags; ``_Refused`` naming the first wrong one."""
    gpus = _offered_gpus(args)
    if args.modules_refresh < 0:
        raise _Refused(f"--modules-refresh must be 0 or more seconds, got {args.modules_refresh:g}")
    token = token_from(args.room_token, args.room_token_file, "zwdx gpu-client")
    if not token:
        raise _Refused("the room's donor token is required: --room-token-file FILE, or $ZWDX_ROOM_TOKEN")
    if args.cpu_slots is not None and args.cpu_slots < 1:
        raise _Refused(f"--cpu-slots must be at least 1, got {args.cpu_slots}")
    if not 0 < args.outage_tolerance <= 1e7:
        raise _Refused(f"--outage-tolerance (or $ZWDX_OUTAGE_TOLERANCE) must be seconds above 0, got "
                       f"{args.outage_tolerance:g}")
    uids, fetch_policy = _sandbox_terms(args)
    from gpu_client.agent.config import AgentConfig
    from gpu_client.sandbox.container import DEFAULT_IMAGE, Confinement
    return AgentConfig(
        server=args.server, room_token=token, gpus_only=gpus, cpu=args.cpu or bool(args.cpu_slots),
        cpu_slots=args.cpu_slots or 1, advertise_addr=args.advertise_addr, client_id=args.client_id,
        threads=args.threads, work_dir=args.work_dir, max_jobs=args.max_jobs, standby=not args.no_standby,
        isolation=args.isolation, rank_uids=uids, rank_dir=args.rank_dir, ca_file=args.ca_file,
        dataset_cache_bytes=args.dataset_cache_bytes, fetch_policy=fetch_policy,
        compile_cache=args.compile_cache, outage_tolerance=args.outage_tolerance,
        modules_refresh=args.modules_refresh, tuning=tuning.Tuning.from_arguments(args),
        confinement=Confinement(images=args.allow_image or [DEFAULT_IMAGE], memory=args.container_memory,
                                pids=args.container_pids, shm=args.container_shm))


def _offered_gpus(args) -> list[int] | None:
    """``--gpus 0,1`` as indices (None: every GPU), never with ``--cpu``/``--cpu-slots``."""
    if args.gpus and (args.cpu or args.cpu_slots is not None):
        raise _Refused(f"--gpus {args.gpus} offers GPUs, {'--cpu' if args.cpu else '--cpu-slots'} offers "
                       f"CPU slots instead: give one or the other")
    try:
        return [int(g) for g in args.gpus.split(",")] if args.gpus else None
    except ValueError:
        raise _Refused(f"--gpus takes GPU indices separated by commas (0,1), got {args.gpus!r}") from None


def _sandbox_terms(args):
    """The ranks' uids and what their datasets may reach, from the isolation flags."""
    from gpu_client.agent.fetch import FetchPolicy, parse_nets
    from gpu_client.sandbox.isolation import IsolationError, parse_uids
    try:
        if args.isolation not in (None, *ISOLATIONS):
            raise IsolationError(f"ZWDX_ISOLATION must be one of {', '.join(ISOLATIONS)}, got {args.isolation!r}")
        uids = parse_uids(args.rank_uids) if args.rank_uids else None
        fetch_policy = FetchPolicy(parse_nets(args.dataset_allow_net or os.environ.get("ZWDX_DATASET_ALLOW_NETS")),
                                   s3_credentials=args.dataset_s3_credentials)
        if args.isolation in ("user", "process") and (args.allow_image or args.container_memory):
            raise IsolationError("--allow-image and --container-memory apply to --isolation docker (a container per "
                                 "rank); pass it, or leave them out")
    except (IsolationError, ValueError) as err:
        raise _Refused(str(err)) from None
    return uids, fetch_policy


def _sdk(args):
    """The SDK, with the token the command was given (if any)."""
    from .sdk import ZWDX
    return ZWDX(args.server, room_token=token_from(args.room_token, args.room_token_file, f"zwdx {args.command}"),
                ca_file=args.ca_file)


def _run(fn, args) -> int:
    """A ``jobs_cli`` command with the SDK the arguments describe."""
    return fn(_sdk(args), args)


def _server_arguments(parser) -> None:
    parser.add_argument("--server", default=DEFAULT_SERVER, help="server URL (default: $ZWDX_SERVER_URL or %(default)s)")
    parser.add_argument("--ca-file", default=None, metavar="FILE",
                        help="the CA certificate (PEM) that signed the server's, for a private CA (default: "
                             "$ZWDX_CA_FILE, else the system's CAs)")


def _token_arguments(parser, what: str) -> None:
    parser.add_argument("--room-token-file", default=None, metavar="FILE",
                        help=f"a file holding {what} (default: $ZWDX_ROOM_TOKEN, else the file $ZWDX_ROOM_TOKEN_FILE "
                             f"names)")
    parser.add_argument("--room-token", "-rt", default=None,
                        help="the token itself: every user of the machine can read a command line, so this warns; "
                             "prefer --room-token-file or $ZWDX_ROOM_TOKEN")


#: argparse's type for sizes (``8GiB`` -> 8589934592).
byte_size = sizes.argument


def _run_script(args) -> int:
    """``zwdx run``: a torchrun script on the room's GPUs; the job's exit status is this one's."""
    from .errors import JobFailed
    from .sdk import ZWDX
    env = {}
    for pair in args.env:
        name, eq, value = pair.partition("=")
        if not eq:
            raise ZwdxError(f"--env {pair!r}: expected NAME=VALUE")
        env[name] = value
    script_args = args.args[1:] if args.args[:1] == ["--"] else args.args
    sdk = ZWDX(args.server, room_token=token_from(args.room_token, args.room_token_file, "zwdx run"),
               ca_file=args.ca_file)
    if sdk.room_token is None and sdk.credentials is not None:
        known = sdk.credentials.tokens(sdk.server_url)
        sdk.room_token = next(iter(known.values())) if len(known) == 1 else None
    if sdk.room_token is None:
        raise ZwdxError(f"zwdx run needs a submitter token of the room (zs_...): --room-token-file FILE or "
                        f"ZWDX_ROOM_TOKEN (none, or more than one, is remembered for {sdk.server_url})")
    try:
        result = sdk.submit_script(args.script, script_args, nproc=args.nproc, working_dir=args.working_dir,
                                   gpus_per_client=args.gpus_per_client, memory_required=args.memory, name=args.name,
                                   env=env, max_restarts=args.max_restarts, max_workdir_bytes=args.max_workdir_bytes,
                                   datasets=args.dataset, wait=not args.detach, include=args.include,
                                   outputs_from=args.outputs_from)
    except JobFailed as err:
        result = err.result
        for rank in result["failure_order"]:
            print(f"zwdx: rank {rank} failed:\n{result['failures'][rank]}", file=sys.stderr)
        print(f"zwdx: job {result['job_id']} failed: {result['reason']}", file=sys.stderr)
    if args.detach:
        print(result)
        return 0
    if args.outputs:
        dest = sdk.download_outputs(result["job_id"], os.path.join(args.outputs, result["job_id"]))
        if dest:
            print(f"zwdx: job {result['job_id']}: outputs in {dest}", file=sys.stderr)
        elif result["complete"] or result.get("outputs_note"):
            print(f"zwdx: job {result['job_id']}: no outputs came back"
                  + (f": {result['outputs_note'][len('no outputs: '):]}" if result.get("outputs_note") else ""),
                  file=sys.stderr)
    return 0 if result["complete"] else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zwdx", description="Pool lent GPUs and train PyTorch models on them.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=version_line(),
                        help="print zwdx's version and protocol, and exit")
    sub = parser.add_subparsers(dest="command", required=True)

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
    limits = p.add_argument_group("limits", "each also ZWDX_<NAME> in the environment (ZWDX_ROOM_MAX_JOBS=...)")
    limits.add_argument("--max-request-bytes", type=byte_size, default=None, metavar="SIZE",
                        help=f"largest request body but an artifact's "
                             f"(default {sizes.human(defaults.MAX_REQUEST_BYTES)})")
    limits.add_argument("--room-max-jobs", type=int, default=None,
                        help=f"jobs a room may have waiting or running, 0: no limit (default {defaults.ROOM_MAX_JOBS})")
    limits.add_argument("--room-max-artifact-bytes", type=byte_size, default=None, metavar="SIZE",
                        help=f"bytes of artifacts a room may keep, 0: no limit "
                             f"(default {sizes.human(defaults.ROOM_MAX_ARTIFACT_BYTES)})")
    limits.add_argument("--room-max-events", type=int, default=None,
                        help=f"metric and log events a room may keep (their bytes count in --room-max-artifact-bytes), "
                             f"0: no limit (default {defaults.ROOM_MAX_EVENTS})")
    limits.add_argument("--rate-limit-events", default=None,
                        help=f"event posts one rank of a job may make (default '{defaults.RATE_LIMIT_EVENTS}')")
    limits.add_argument("--max-series-points", type=int, default=None,
                        help=f"points a job's metric series shows at most; a longer one is thinned, keeping its first "
                             f"and last (default {defaults.MAX_SERIES_POINTS})")
    limits.add_argument("--min-free-bytes", type=byte_size, default=None, metavar="SIZE",
                        help=f"free bytes kept on the data dir's disk: below, uploads, events and jobs are refused "
                             f"(507), 0: no floor (default {defaults.MIN_FREE_BYTES})")
    limits.add_argument("--rate-limit-rooms", default=None,
                        help=f"rooms one address may create (default '{defaults.RATE_LIMIT_ROOMS}')")
    limits.add_argument("--rate-limit-auth-failures", default=None,
                        help=f"wrong tokens one address may send before it is refused "
                             f"(default '{defaults.RATE_LIMIT_AUTH_FAILURES}')")
    limits.add_argument("--start-timeout", type=float, default=None,
                        help=f"seconds a placed job's ranks get to report running before the job is placed again on "
                             f"other GPU clients, 0: never (default {defaults.START_TIMEOUT:g})")
    limits.add_argument("--start-tries", type=int, default=None,
                        help=f"placements that did not start after which a job fails (default {defaults.START_TRIES})")
    limits.add_argument("--donor-max-clients", type=int, default=None,
                        help=f"GPU clients one donor token may have online at once, 0: no limit "
                             f"(default {defaults.DONOR_MAX_CLIENTS})")
    limits.add_argument("--client-max-slots", type=int, default=None,
                        help=f"slots one GPU client may offer, 0: no limit (default {defaults.CLIENT_MAX_SLOTS})")
    limits.add_argument("--rate-limit-registers", default=None,
                        help=f"registers one donor token may make (default '{defaults.RATE_LIMIT_REGISTERS}')")
    limits.add_argument("--client-retention", type=float, default=None,
                        help=f"seconds a GPU client may stay offline before it is dropped from its room's list, unless "
                             f"the room sets its own (zwdx room settings), 0: never "
                             f"(default {defaults.CLIENT_RETENTION:g})")
    limits.add_argument("--artifact-retention", type=float, default=None,
                        help="seconds a finished job keeps its artifacts, 0: for ever (default 0)")
    limits.add_argument("--sweep-interval", type=float, default=None,
                        help=f"seconds between sweeps of unreferenced artifacts, 0: never (default {defaults.SWEEP_INTERVAL:g})")
    edge = p.add_argument_group("connections", "each also ZWDX_<NAME> in the environment (ZWDX_HEADER_TIMEOUT=...)")
    edge.add_argument("--header-timeout", type=float, default=None,
                      help=f"seconds a connection has to send a request's line and headers, 0: no limit "
                           f"(default {defaults.HEADER_TIMEOUT:g})")
    edge.add_argument("--idle-timeout", type=float, default=None,
                      help=f"seconds a kept-alive connection may wait for its next request, 0: no limit "
                           f"(default {defaults.IDLE_TIMEOUT:g})")
    edge.add_argument("--body-timeout", type=float, default=None,
                      help=f"seconds a JSON body has to arrive once its headers are in, 0: no limit "
                           f"(default {defaults.BODY_TIMEOUT:g})")
    edge.add_argument("--max-connections-per-address", type=int, default=None,
                      help=f"connections one address may hold at once, 0: no cap; not applied behind "
                           f"ZWDX_PROXY_HOPS proxies (default {defaults.MAX_CONNECTIONS_PER_ADDRESS})")
    edge.add_argument("--socket-sessions-per-address", type=int, default=None,
                      help=f"Socket.IO sessions one address may have open, 0: no cap "
                           f"(default {defaults.SOCKET_SESSIONS_PER_ADDRESS})")
    edge.add_argument("--socket-auth-timeout", type=float, default=None,
                      help=f"seconds a Socket.IO session has to connect with its token before it is closed, 0: no "
                           f"limit (default {defaults.SOCKET_AUTH_TIMEOUT:g})")
    edge.add_argument("--proxy-hops", type=int, default=None,
                      help="reverse proxies in front (nginx, HAProxy) whose X-Forwarded-For and -Proto to believe, so "
                           "that rate limits and /metrics see the client's address (default: $ZWDX_PROXY_HOPS, else 0)")
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

    p = sub.add_parser("room", help="rooms")
    rsub = p.add_subparsers(dest="action", required=True)
    c = rsub.add_parser("create", help="create a room and print its submitter and donor tokens (shown once)")
    _server_arguments(c)
    c.add_argument("--name", default="", help="a name for the room")
    c.add_argument("--json", action="store_true", help="print a JSON object")
    c.add_argument("--token-dir", default=None,
                   help="write the tokens to DIR/submitter_token and DIR/donor_token (0600) instead of printing "
                        "them; if both are there already, create nothing")
    c.set_defaults(func=_room_create)
    t = rsub.add_parser("tokens", help="list, make, revoke or rotate the room's tokens (with a submitter token)")
    tsub = t.add_subparsers(dest="tokens_action", required=True)
    for action, what in (("list", "every token of the room by name and role"),
                         ("create", "make a token (its secret is shown once)"),
                         ("revoke", "revoke a token: it opens nothing from now on"),
                         ("rotate", "give a token a new secret (a legacy token becomes a submitter and a donor token)")):
        a = tsub.add_parser(action, help=what)
        if action in ("revoke", "rotate"):
            a.add_argument("token_id", help="the token's id (zwdx room tokens list)")
        if action == "create":
            a.add_argument("--role", choices=["submitter", "donor"], required=True)
            a.add_argument("--name", default="", help="what the token is for (\"lab-3 GPUs\")")
        _server_arguments(a)
        _token_arguments(a, "a submitter token of the room")
        a.add_argument("--json", action="store_true", help="print JSON")
        a.set_defaults(func=_room_tokens)
    jobs_cli.add_room_parsers(rsub, _server_arguments, _token_arguments, _run)

    p = sub.add_parser("gpu-client", help="lend this machine's GPUs to a room")
    p.add_argument("--version", action="version", version=version_line(),
                   help="print zwdx's version and protocol, and exit")
    _server_arguments(p)
    _token_arguments(p, "the room's donor token, zd_...")
    p.add_argument("--gpus", default=None, help="comma-separated GPU indices to offer (default: all)")
    p.add_argument("--cpu", action="store_true", help="offer one CPU slot instead of GPUs")
    p.add_argument("--cpu-slots", type=int, default=None, metavar="N",
                   help="offer N CPU slots instead of GPUs (their ranks share this machine's cores and RAM)")
    p.add_argument("--advertise-addr", default=None,
                   help="address other GPU clients reach this one at (default: the interface that reaches the server)")
    p.add_argument("--client-id", default=None,
                   help="its id in the room (default: the id an earlier start on this work dir took, which no "
                        "running client holds, else a new one: a restart is the same GPU client to the server)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per CPU rank")
    p.add_argument("--work-dir", default=None, help="its files: client secret, caches, job logs "
                                                    "(default: ~/.zwdx/gpu_client)")
    p.add_argument("--refresh", action="store_true",
                   help="tell the GPU clients running on --work-dir to read again what their ranks can import (a "
                        "package installed since they started; the same as kill -HUP), and exit")
    p.add_argument("--modules-refresh", type=float, metavar="SECONDS",  # argparse converts a string default too
                   default=os.environ.get("ZWDX_MODULES_REFRESH") or str(defaults.MODULES_REFRESH),
                   help="least seconds between two looks at what its ranks can import when the server says a "
                        "waiting job needs a package it lacks (default: $ZWDX_MODULES_REFRESH, else "
                        f"{defaults.MODULES_REFRESH:g})")
    p.add_argument("--max-jobs", type=int, default=None, help="exit after this many jobs")
    p.add_argument("--dataset-cache-bytes", type=byte_size, default=defaults.DATASET_CACHE_BYTES, metavar="SIZE",
                   help="most bytes of datasets kept for later jobs (50GiB, 500MB); the least recently used go "
                        "first, and the cache never fills the disk (default: 50GiB)")
    p.add_argument("--dataset-allow-net", action="append", default=None, metavar="NET",
                   help="a network (10.0.0.0/8, 127.0.0.1) a job's dataset URL may reach from this machine besides "
                        "public addresses (repeat for more; default: $ZWDX_DATASET_ALLOW_NETS, comma-separated, else "
                        "none: private, loopback, link-local and other non-public addresses are refused)")
    p.add_argument("--dataset-s3-credentials", action="store_true",
                   default=os.environ.get("ZWDX_DATASET_S3_CREDENTIALS", "") not in ("", "0", "false", "no"),
                   help="s3:// dataset URLs are read with this machine's own AWS credentials (default: "
                        "$ZWDX_DATASET_S3_CREDENTIALS=1, else anonymously: public buckets only)")
    p.add_argument("--compile-cache", default=os.environ.get("ZWDX_COMPILE_CACHE") or None, metavar="DIR",
                   help="keep torch.compile's caches (Inductor, Triton, C++ extensions) between jobs of the same room, "
                        "in a folder per room under DIR, lent to one job at a time; no job reads another room's "
                        "(default: $ZWDX_COMPILE_CACHE, else none: each job compiles in its own sandbox; not with "
                        "--isolation docker)")
    p.add_argument("--outage-tolerance", type=float, metavar="SECONDS",
                   default=os.environ.get("ZWDX_OUTAGE_TOLERANCE") or defaults.OUTAGE_TOLERANCE,
                   help="how long running jobs wait for a server that is away (a restart, an upgrade): their "
                        "checkpoints, metrics and results are sent once it is back, and training goes on meanwhile "
                        f"(default: $ZWDX_OUTAGE_TOLERANCE, else {defaults.OUTAGE_TOLERANCE:g})")
    p.add_argument("--no-standby", action="store_true",
                   help="do not keep a rank process (torch imported, CUDA context made) ready per slot")
    iso = p.add_argument_group("isolation", "how job code is kept from this GPU client and from other jobs")
    iso.add_argument("--isolation", choices=ISOLATIONS, default=os.environ.get("ZWDX_ISOLATION") or None,
                     help="docker: each rank in a fresh locked-down container (docs/docker.md); user: each job's ranks "
                          "run as an unprivileged user of their own (needs root); process: as this client's user "
                          "(default: $ZWDX_ISOLATION, else docker where an engine answers, the image is here and this "
                          "client does not run in a container itself, else user as root and process otherwise)")
    iso.add_argument("--rank-uids", default=os.environ.get("ZWDX_RANK_UIDS"), metavar="START-END",
                     help="uids (and gids) per-job users are taken from; uids with a passwd or group entry are "
                          "skipped (default: $ZWDX_RANK_UIDS, else 2000000000-2000065535)")
    iso.add_argument("--rank-dir", default=os.environ.get("ZWDX_RANK_DIR"),
                     help="where each job gets its private directory (default: $ZWDX_RANK_DIR, else "
                          "/var/lib/zwdx/ranks with --isolation user, WORK_DIR/ranks otherwise)")
    iso.add_argument("--allow-image", action="append", default=None, metavar="IMAGE",
                     help="--isolation docker: an image ranks may run in (repeat for more); the first is the one "
                          "they run in (default: zwdx-gpu-client)")
    iso.add_argument("--container-memory", type=byte_size, default=None, metavar="SIZE",
                     help="--isolation docker: memory of a rank container, e.g. 16g (default: RAM shared out over "
                          "the slots)")
    iso.add_argument("--container-pids", type=int, default=4096, help="--isolation docker: processes and threads of "
                                                                       "a rank container")
    iso.add_argument("--container-shm", type=byte_size, default=2 * 1024**3, metavar="SIZE",
                     help="--isolation docker: /dev/shm of a rank container (default 2g)")
    tuning.add_arguments(p)
    p.set_defaults(func=_gpu_client)

    p = sub.add_parser("run", help="run a torchrun script unchanged on the room's GPUs",
                       usage="zwdx run [options] --nproc N script.py [-- script arguments]",
                       description="Packs the working dir (what git would commit, or what its .gitignore files "
                                   "leave), uploads it unless the room has it, runs `python script.py ARGS` on N "
                                   "ranks with torchrun's environment, prints their lines as they come, downloads "
                                   "what rank 0 wrote under $ZWDX_OUTPUT_DIR, and exits with 0 if the job completed. "
                                   "'$ZWDX_OUTPUT_DIR' and '$ZWDX_DATA_DIR' in the script's arguments (quoted, so "
                                   "that this shell leaves them) are the rank's folders on the GPU client.")
    _server_arguments(p)
    _token_arguments(p, "a submitter token of the room, zs_... (else the one token remembered for the server)")
    p.add_argument("--nproc", type=int, required=True, help="ranks in all (torchrun's nnodes x nproc-per-node)")
    p.add_argument("--gpus-per-client", type=int, default=None,
                   help="ranks on each GPU client (torchrun's --nproc-per-node; default: as slots come)")
    p.add_argument("--memory", type=byte_size, default=0, help="free memory every rank's GPU needs (8GiB, 512MB)")
    p.add_argument("--name", default="", help="the job's name (default: the script's file name)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for the script (repeat it)")
    p.add_argument("--working-dir", default=".", help="the folder to pack and run in (default: here)")
    p.add_argument("--include", action="append", default=[], metavar="PATTERN",
                   help="pack files a .gitignore ignores that match PATTERN (git's syntax: '*.bin', 'data/'; repeat "
                        "it; default: none, and what was left out is said)")
    p.add_argument("--outputs-from", action="append", default=[], metavar="DIR",
                   help="a folder of the working dir the script writes (relative to its cwd, e.g. out): rank 0's "
                        "files there come back with the outputs, in DIR/ (repeat it; default: $ZWDX_OUTPUT_DIR only)")
    p.add_argument("--dataset", action="append", default=[], metavar="NAME|URL",
                   help="a dataset of the room (zwdx data push) or a URL the GPU clients fetch, in "
                        "$ZWDX_DATA_DIR/<name> before the script starts (repeat it)")
    p.add_argument("--max-workdir-bytes", type=byte_size, default=None,
                   help="largest working dir (default: $ZWDX_MAX_WORKDIR_BYTES, else 256MiB)")
    p.add_argument("--max-restarts", type=int, default=defaults.MAX_RESTARTS,
                   help="restarts after a lost GPU client (default %(default)s)")
    p.add_argument("--outputs", default="zwdx-output", metavar="DIR",
                   help="where the outputs go, in DIR/<job id> (default %(default)s; '' for nowhere)")
    p.add_argument("--detach", action="store_true", help="print the job id and return at once")
    p.add_argument("script", help="the script, in the working dir")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments (after --)")
    p.set_defaults(func=_run_script)

    jobs_cli.add_jobs_parser(sub, _server_arguments, _token_arguments, _run)
    data_cli.add_data_parser(sub, _server_arguments, _token_arguments, _run)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    serving = args.command == "server" and not args.server_action
    if serving and args.async_mode not in ASYNC_MODES:
        parser.error(f"ZWDX_ASYNC_MODE must be one of {', '.join(ASYNC_MODES)}, got {args.async_mode!r}")
    no_gevent = serving and args.async_mode == "gevent" and not _patch_for_gevent()
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if no_gevent:
        log.warning("server: gevent is not installed (pip install gevent); serving with one OS thread "
                    "per connection instead (--async-mode threading)")
        args.async_mode = "threading"
    try:
        return args.func(args)
    except ZwdxError as err:
        print(f"zwdx: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # what it stopped has said so (the SDK cancels a job it follows)
        print("zwdx: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `zwdx jobs list | head`: the reader has gone, as a shell's tools go
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor fail flushing at exit
        return 141


if __name__ == "__main__":
    sys.exit(main())
