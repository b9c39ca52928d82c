"""``zwdx data ...``: a room's datasets from a terminal (``zwdx.datasets``).

    zwdx data push DIR --name NAME [--chunk-bytes N] [--json]
                                                 upload a folder (only the chunks the room lacks)
    zwdx data list [--json]                      the room's datasets and their newest versions
    zwdx data show NAME [--json]                 one dataset: its versions and newest files
    zwdx data rm NAME [--json]                   remove it, every version

The submitter token comes as for ``zwdx jobs`` (``--room-token-file``, ``$ZWDX_ROOM_TOKEN``, or
the room the SDK remembers for the server; ``--room ID`` picks among several).
"""
from __future__ import annotations

import time

from tabulate import tabulate

from . import defaults, sizes
from .job_text import ago as _ago
from .jobs_cli import _print_json, room_token


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def data_push(sdk, args) -> int:
    got = sdk.push_dataset(args.path, args.name, room_token(sdk, args), progress=not args.json,
                           chunk_bytes=args.chunk_bytes)
    if args.json:
        _print_json(got)
        return 0
    said = "a new version" if got["new_version"] else "unchanged (that version was there)"
    print(f"dataset {got['name']}: {said}, version {got['version'][:12]} ({got['files']} files, {_size(got['size'])}); "
          f"{got['uploaded_chunks']} of {got['chunks']} chunk(s) uploaded ({_size(got['uploaded_bytes'])})")
    return 0


def data_list(sdk, args) -> int:
    found = sdk.list_datasets(room_token(sdk, args))
    if args.json:
        _print_json(found)
        return 0
    now = time.time()
    print(tabulate([[d["name"], d["latest"]["version"][:12], d["latest"]["files"], _size(d["latest"]["size"]),
                     len(d["versions"]), _ago(d["latest"]["created_at"], now)] for d in found],
                   headers=["NAME", "VERSION", "FILES", "SIZE", "VERSIONS", "PUSHED"]))
    return 0


def data_show(sdk, args) -> int:
    found = sdk.get_dataset(args.name, room_token(sdk, args))
    if args.json:
        _print_json(found)
        return 0
    now = time.time()
    print(tabulate([[v["version"][:12], v["files"], _size(v["size"]), _ago(v["created_at"], now)]
                    for v in found["versions"]], headers=["VERSION", "FILES", "SIZE", "PUSHED"]))
    files = (found.get("manifest") or {}).get("files") or []
    print(f"\nfiles of version {found['latest']['version'][:12]}:")
    print(tabulate([[f["path"], _size(f["size"]), f["sha256"][:12]] for f in files],
                   headers=["PATH", "SIZE", "SHA256"]))
    return 0


def data_rm(sdk, args) -> int:
    gone = sdk.remove_dataset(args.name, room_token(sdk, args))
    if args.json:
        _print_json(gone)
        return 0
    print(f"dataset {gone['name']}: removed ({gone['versions']} version(s), {_size(gone['bytes_freed'])} freed)")
    return 0


def add_data_parser(sub, server_arguments, token_arguments, run) -> None:
    """``zwdx data`` on the CLI's subparsers."""
    p = sub.add_parser("data", help="a room's datasets: push, list, show, rm")
    actions = p.add_subparsers(dest="action", required=True)
    for action, fn, what in (("push", data_push, "upload a folder as a dataset (only what the room lacks)"),
                             ("list", data_list, "the room's datasets"),
                             ("show", data_show, "one dataset: its versions and files"),
                             ("rm", data_rm, "remove a dataset, every version")):
        a = actions.add_parser(action, help=what)
        if action == "push":
            a.add_argument("path", help="the folder")
            a.add_argument("--name", required=True, help="the dataset's name in the room (a new version if it has one)")
            a.add_argument("--chunk-bytes", type=sizes.argument, default=defaults.DATASET_CHUNK_BYTES, metavar="SIZE",
                           help="the size files are cut at (default 8MiB; larger for datasets of many TiB: the "
                                "manifest, about 70 bytes a chunk, must stay within the server's 8 MiB body limit)")
        elif action in ("show", "rm"):
            a.add_argument("name")
        a.add_argument("--room", default=None, help="a room the SDK remembers, by id (when it knows several)")
        a.add_argument("--json", action="store_true", help="the server's answer as JSON")
        server_arguments(a)
        token_arguments(a, "a submitter token of the room, zs_...")
        a.set_defaults(func=lambda args, fn=fn: run(fn, args))
