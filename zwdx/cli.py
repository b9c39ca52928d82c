"""The `zwdx` command: server, room create, room tokens, gpu-client, job status/logs/cancel.

Which token goes where: ``zwdx room create`` prints a submitter token (``zs_``: ``zwdx job``,
``zwdx room tokens``, the SDK, the dashboard) and a donor token (``zd_``: ``zwdx gpu-client``).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from . import defaults
from .errors import ZwdxError

log = logging.getLogger(__name__)

DEFAULT_SERVER = os.environ.get("ZWDX_SERVER_URL", f"http://localhost:{defaults.PORT}")
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
    if args.max_artifact_bytes:
        config["MAX_ARTIFACT_BYTES"] = args.max_artifact_bytes
    if args.client_timeout:
        config["CLIENT_TIMEOUT"] = args.client_timeout
    if args.ui_dir:
        config["UI_DIR"] = args.ui_dir
    for name in ("max_request_bytes", "room_max_jobs", "room_max_artifact_bytes", "rate_limit_rooms",
                 "rate_limit_auth_failures", "artifact_retention", "sweep_interval"):
        if getattr(args, name) is not None:  # unset: the environment's ZWDX_<NAME>, else defaults.py
            config[name.upper()] = getattr(args, name)
    app = create_app(config)
    print(f"zwdx server on http://{args.host}:{args.port} (data in {config['DATA_DIR']}, "
          f"{socketio.async_mode})", flush=True)
    serve(app, args.host, args.port)
    return 0


def _room_create(args) -> int:
    from .sdk import ZWDX
    if args.token_dir and all(os.path.exists(os.path.join(args.token_dir, f)) for f in TOKEN_FILES):
        print(f"a room was created already: its tokens are in {args.token_dir}")
        return 0
    room = ZWDX(args.server, remember=not args.token_dir).create_room(args.name or "")
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
    from .sdk import ZWDX
    tokens = ZWDX(args.server, room_token=args.room_token or os.environ.get("ZWDX_ROOM_TOKEN")).tokens
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


def _gpu_client(args) -> int:
    from gpu_client.agent import serve
    token = args.room_token or os.environ.get("ZWDX_ROOM_TOKEN")
    if not token:
        print("zwdx gpu-client: --room-token (or ZWDX_ROOM_TOKEN), the room's donor token, is required",
              file=sys.stderr)
        return 2
    gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else None
    from gpu_client import container
    isolation, confinement = args.isolation, None
    if isolation == "auto":
        isolation, why = container.default_isolation(args.allow_image)
        print(f"zwdx gpu-client: isolation {isolation}: {why}", file=sys.stderr)
    if isolation == "docker":
        confinement = container.Confinement(images=args.allow_image or [container.DEFAULT_IMAGE],
                                            memory=args.container_memory, pids=args.container_pids,
                                            shm=args.container_shm)
    try:
        return serve(server=args.server, room_token=token, gpus_only=gpus, cpu=args.cpu,
                     advertise_addr=args.advertise_addr, client_id=args.client_id, threads=args.threads,
                     work_dir=args.work_dir, max_jobs=args.max_jobs, standby=not args.no_standby,
                     isolation=isolation, confinement=confinement)
    except container.ContainerError as err:
        print(f"zwdx gpu-client: --isolation docker: {err}", file=sys.stderr)
        return 2


def _job(args) -> int:
    from .sdk import ZWDX
    sdk = ZWDX(args.server, room_token=args.room_token or os.environ.get("ZWDX_ROOM_TOKEN"))
    if args.action == "list":
        for job in sdk.list_jobs():
            print(f"{job['id']}  {job['status']:<10} world {job.get('world_size') or '-':<3} "
                  f"{job['spec']['parallelism']:<5} loss {job.get('final_loss')}")
    elif args.action == "status":
        print(json.dumps(sdk.get_job(args.job_id), indent=2))
    elif args.action == "logs":
        for line in sdk.get_job_logs(args.job_id):
            print(f"[rank {line['rank']}] {line['text']}")
    elif args.action == "cancel":
        print(sdk.cancel_job(args.job_id)["status"])
    return 0


def _size(text: str) -> int:
    """A size in bytes: 1073741824, 512m, 16g."""
    units = {"k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
    try:
        number, unit = (text[:-1], text[-1].lower()) if text[-1:].lower() in units else (text, "")
        return int(float(number) * units.get(unit, 1))
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"expected a size like 512m or 16g, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zwdx", description="Pool lent GPUs and train PyTorch models on them.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("server", help="run the zwdx server (API, Socket.IO, dashboard)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0 for every one)")
    p.add_argument("--port", type=int, default=defaults.PORT)
    p.add_argument("--data-dir", default=os.environ.get("ZWDX_DATA_DIR", "zwdx-data"),
                   help="embedded store and artifacts live here")
    p.add_argument("--mongo-uri", default=os.environ.get("ZWDX_MONGO_URI"),
                   help="use MongoDB instead of the embedded store")
    p.add_argument("--max-artifact-bytes", type=int, default=None)
    p.add_argument("--client-timeout", type=float, default=None, help="seconds of silence before a GPU client is lost")
    p.add_argument("--async-mode", choices=ASYNC_MODES, default=os.environ.get("ZWDX_ASYNC_MODE", "gevent"),
                   help="gevent: every connection a greenlet (default); threading: an OS thread per "
                        "connection (default: $ZWDX_ASYNC_MODE or %(default)s)")
    p.add_argument("--ui-dir", default=os.environ.get("ZWDX_UI_DIR"),
                   help="serve the dashboard from this build folder (default: $ZWDX_UI_DIR, else the one "
                        "installed with zwdx)")
    limits = p.add_argument_group("limits", "each also ZWDX_<NAME> in the environment (ZWDX_ROOM_MAX_JOBS=...)")
    limits.add_argument("--max-request-bytes", type=int, default=None,
                        help=f"largest request body but an artifact's (default {defaults.MAX_REQUEST_BYTES})")
    limits.add_argument("--room-max-jobs", type=int, default=None,
                        help=f"jobs a room may have waiting or running, 0: no limit (default {defaults.ROOM_MAX_JOBS})")
    limits.add_argument("--room-max-artifact-bytes", type=int, default=None,
                        help=f"bytes of artifacts a room may keep, 0: no limit (default {defaults.ROOM_MAX_ARTIFACT_BYTES})")
    limits.add_argument("--rate-limit-rooms", default=None,
                        help=f"rooms one address may create (default '{defaults.RATE_LIMIT_ROOMS}')")
    limits.add_argument("--rate-limit-auth-failures", default=None,
                        help=f"wrong tokens one address may send before it is refused "
                             f"(default '{defaults.RATE_LIMIT_AUTH_FAILURES}')")
    limits.add_argument("--artifact-retention", type=float, default=None,
                        help="seconds a finished job keeps its artifacts, 0: for ever (default 0)")
    limits.add_argument("--sweep-interval", type=float, default=None,
                        help=f"seconds between sweeps of unreferenced artifacts, 0: never (default {defaults.SWEEP_INTERVAL:g})")
    p.set_defaults(func=_server)

    p = sub.add_parser("room", help="rooms")
    rsub = p.add_subparsers(dest="action", required=True)
    c = rsub.add_parser("create", help="create a room and print its submitter and donor tokens (shown once)")
    c.add_argument("--server", default=DEFAULT_SERVER, help="server URL (default: $ZWDX_SERVER_URL or %(default)s)")
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
        a.add_argument("--server", default=DEFAULT_SERVER, help="server URL (default: $ZWDX_SERVER_URL or %(default)s)")
        a.add_argument("--room-token", "-rt", default=None,
                       help="a submitter token of the room (default: $ZWDX_ROOM_TOKEN)")
        a.add_argument("--json", action="store_true", help="print JSON")
        a.set_defaults(func=_room_tokens)

    p = sub.add_parser("gpu-client", help="lend this machine's GPUs to a room")
    p.add_argument("--server", default=DEFAULT_SERVER, help="server URL (default: $ZWDX_SERVER_URL or %(default)s)")
    p.add_argument("--room-token", "-rt", default=None,
                   help="the room's donor token, zd_... (default: $ZWDX_ROOM_TOKEN)")
    p.add_argument("--gpus", default=None, help="comma-separated GPU indices to offer (default: all)")
    p.add_argument("--cpu", action="store_true", help="offer one CPU slot instead of GPUs")
    p.add_argument("--advertise-addr", default=None,
                   help="address other GPU clients reach this one at (default: the interface that reaches the server)")
    p.add_argument("--client-id", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads per CPU rank")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--max-jobs", type=int, default=None, help="exit after this many jobs")
    p.add_argument("--no-standby", action="store_true",
                   help="do not keep a rank process (torch imported, CUDA context made) ready per slot")
    box = p.add_argument_group("isolation", "where the room's code runs (docs/docker.md)")
    box.add_argument("--isolation", choices=["auto", "process", "docker"], default="auto",
                     help="docker: each rank in a fresh locked-down container; process: a process of this user; "
                          "auto (default): docker when an engine answers, its image is here and this client does "
                          "not run in a container itself")
    box.add_argument("--allow-image", action="append", default=None, metavar="IMAGE",
                     help="an image ranks may run in (repeat for more); the first is the default "
                          "(default: zwdx-gpu-client)")
    box.add_argument("--container-memory", type=_size, default=None, metavar="SIZE",
                     help="memory of a rank container, e.g. 16g (default: the RAM shared out over the slots)")
    box.add_argument("--container-pids", type=int, default=4096, help="processes and threads of a rank container")
    box.add_argument("--container-shm", type=_size, default=2 * 1024**3, metavar="SIZE",
                     help="/dev/shm of a rank container (default 2g)")
    p.set_defaults(func=_gpu_client)

    p = sub.add_parser("job", help="look at and control jobs")
    p.add_argument("action", choices=["list", "status", "logs", "cancel"])
    p.add_argument("job_id", nargs="?")
    p.add_argument("--server", default=DEFAULT_SERVER, help="server URL (default: $ZWDX_SERVER_URL or %(default)s)")
    p.add_argument("--room-token", "-rt", default=None,
                   help="a submitter token of the job's room, zs_... (default: $ZWDX_ROOM_TOKEN, else the one "
                        "remembered for the job)")
    p.set_defaults(func=_job)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "server" and args.async_mode not in ASYNC_MODES:
        parser.error(f"ZWDX_ASYNC_MODE must be one of {', '.join(ASYNC_MODES)}, got {args.async_mode!r}")
    no_gevent = args.command == "server" and args.async_mode == "gevent" and not _patch_for_gevent()
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


if __name__ == "__main__":
    sys.exit(main())
