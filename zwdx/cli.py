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
import sys

from . import cli_gpu, cli_server, data_cli, defaults, jobs_cli
from .cli_common import DEFAULT_SERVER, byte_size, version_line  # noqa: F401 (byte_size: the tests' and docs')
from .cli_common import server_arguments as _server_arguments, token_arguments as _token_arguments
from .cli_server import ASYNC_MODES, _patch_for_gevent
from .errors import ZwdxError
from .token_source import token_from

log = logging.getLogger(__name__)


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


def _sdk(args):
    """The SDK, with the token the command was given (if any)."""
    from .sdk import ZWDX
    return ZWDX(args.server, room_token=token_from(args.room_token, args.room_token_file, f"zwdx {args.command}"),
                ca_file=args.ca_file)


def _run(fn, args) -> int:
    """A ``jobs_cli`` command with the SDK the arguments describe."""
    return fn(_sdk(args), args)


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
    cli_server.add_parser(sub)

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
    cli_gpu.add_parser(sub)

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
