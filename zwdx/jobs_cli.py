"""``zwdx jobs ...`` and ``zwdx room show|clients``: a room's jobs and GPU clients from a terminal.

    zwdx jobs list [--status S] [--json]      zwdx room show [--json]
    zwdx jobs show ID [--json]                zwdx room clients [prune] [--json]
                                              zwdx room settings [--client-retention S]
    zwdx jobs logs ID [-f] [--rank R]
    zwdx jobs metrics ID [--json]
    zwdx jobs cancel ID
    zwdx jobs download ID [-o FILE]          (a script job: its outputs, -o DIR)
    zwdx jobs tensorboard ID [--logdir DIR]

Tables for people (tabulate), ``--json`` for scripts: the server's own documents, unchanged.
The submitter token comes from ``--room-token-file``, ``$ZWDX_ROOM_TOKEN`` (or the file
``$ZWDX_ROOM_TOKEN_FILE`` names), else from what the SDK remembered: the room of a job it
submitted, or the one room it knows on that server (``--room ID`` picks among several).
Never needed on the command line.
"""
from __future__ import annotations

import json
import math
import sys
import time

from tabulate import tabulate

from .errors import BadRequest
from .protocol import FINISHED, JobStatus
from .protocol.base import escape_controls
from .protocol.spec import nest
from .job_text import (ago, facts, gib, notes, number, placement_rows, plan_lines,
                       shadow_lines, suspect_lines, terms_line)


def _show(text: str, keep: str = "\n") -> None:
    """Print what a server document says: host and GPU names, reasons, image names are what some
    GPU client or job chose, and a terminal acts on their control characters (an OSC 52
    clipboard write, a screen clear, text reordered by bidi overrides): those are written out."""
    print(escape_controls(text, keep))


def _print_json(doc) -> None:
    print(json.dumps(doc, indent=2, default=str))


def room_token(sdk, args) -> str | None:
    """The token for a room-wide command: the one given, else the room remembered for this server."""
    if sdk.room_token:
        return sdk.room_token
    known = sdk.credentials.tokens(sdk.server_url) if sdk.credentials is not None else {}
    wanted = getattr(args, "room", None)
    if wanted:
        if wanted not in known:
            raise BadRequest(f"no token of room {wanted} on {sdk.server_url} is remembered here; give a submitter "
                             f"token with --room-token-file FILE or $ZWDX_ROOM_TOKEN", field="room")
        return known[wanted]
    if len(known) == 1:
        return next(iter(known.values()))
    if known:
        raise BadRequest(f"several rooms on {sdk.server_url} are remembered here ({', '.join(sorted(known))}): "
                         f"pick one with --room ID, or give its token with --room-token-file", field="room")
    return None  # the SDK says what is missing


# -- jobs -------------------------------------------------------------------------------------------
def jobs_list(sdk, args) -> int:
    jobs = sdk.list_jobs(room_token(sdk, args), status=args.status)
    if args.json:
        _print_json(jobs)
        return 0
    now = time.time()
    rows = [[j["id"], j.get("name") or "", j["status"], j.get("world_size") or "-",
             (j.get("spec") or {}).get("parallelism", "-"), ago(j.get("created_at"), now),
             number(j.get("final_loss")), (j.get("waiting_reason") or j.get("reason") or "")[:60]]
            for j in jobs]
    _show(tabulate(rows, headers=["ID", "NAME", "STATUS", "RANKS", "MODE", "SUBMITTED", "FINAL LOSS", "WHY"]))
    return 0


def jobs_show(sdk, args) -> int:
    job = sdk.get_job(args.job_id)
    if args.json:
        _print_json(job)
        return 0
    spec = nest(job.get("spec") or {})  # a server before the tree says it flat
    mixed = (spec.get("strategy") or {}).get("type") == "mixed"
    _show(tabulate(facts(job, spec, time.time()) + notes(job), tablefmt="plain"))
    if job.get("placement"):
        print()
        _show_placement(job, _batches(sdk, job["id"]) if mixed else None)
    for line in suspect_lines(job) + shadow_lines(job) + plan_lines(job):
        _show(line)
    for rank in job.get("failure_order") or []:
        _show(f"\nrank {rank} failed:\n{(job.get('failures') or {}).get(rank, '')}", keep="\n\t")
    return 0


def _show_placement(job: dict, batch: dict | None) -> None:
    """The ranks' table and their containers' terms."""
    rows, headers = placement_rows(job, batch)
    _show(tabulate(rows, headers=headers))
    for rank, state in sorted((job.get("ranks") or {}).items(), key=lambda kv: int(kv[0])):
        if state.get("terms"):
            _show(f"rank {rank} ran in a container: {terms_line(state['terms'])}")


def _batches(sdk, job_id: str) -> dict:
    """rank -> its batch (the ``batch_size`` metric a mixed-devices rank records at its start)."""
    return {p["rank"]: int(p["value"]) for p in sdk.get_job_metrics(job_id).get("batch_size", [])
            if isinstance(p.get("value"), (int, float))}


def jobs_logs(sdk, args) -> int:
    """The job's log lines; ``-f`` follows them until the job ends (as ``tail -f``)."""
    from .sdk import log_line  # here: ``zwdx server`` patches sockets for gevent before requests is imported
    token = sdk._token(None, args.job_id)
    after = 0
    while True:
        # the status before the read: a job that had ended and has no line left is done
        ended = args.follow and JobStatus(sdk.get_job(args.job_id)["status"]) in FINISHED
        events = sdk._json("GET", f"/jobs/{args.job_id}/events", token, params={"kind": "log", "after": after})["events"]
        for ev in events:
            after = ev["seq"]
            if args.rank is None or ev.get("rank") == args.rank:
                print(log_line(ev), flush=True)
        if not events and not args.follow or (ended and not events):
            return 0
        if not events:
            time.sleep(1.0)


def jobs_metrics(sdk, args) -> int:
    series = sdk.get_job_metrics(args.job_id)
    if args.json:
        _print_json(series)
        return 0
    rows = []
    for name, points in sorted(series.items()):
        values = [p["value"] for p in points if isinstance(p.get("value"), (int, float))]
        finite = [v for v in values if math.isfinite(v)]
        last = points[-1] if points else {}
        rows.append([name, len(points), last.get("step", "-"), number(last.get("value")),
                     number(min(finite)) if finite else "-", number(max(finite)) if finite else "-"])
    print(tabulate(rows, headers=["SERIES", "POINTS", "LAST STEP", "LAST", "MIN", "MAX"]))
    return 0


def jobs_cancel(sdk, args) -> int:
    print(f"job {args.job_id}: {sdk.cancel_job(args.job_id)['status']}")
    return 0


def jobs_download(sdk, args) -> int:
    """The trained weights; a script job's outputs (what ``zwdx run`` downloads)."""
    job = sdk.get_job(args.job_id)
    if (job.get("spec") or {}).get("kind") == "script":
        dest = sdk.download_outputs(args.job_id, args.output or None)
        if dest is None:
            print(f"job {args.job_id}: no outputs (status {job['status']}): its rank 0 wrote nothing under "
                  f"$ZWDX_OUTPUT_DIR; `zwdx jobs logs {args.job_id} --rank 0` says where it wrote", file=sys.stderr)
            return 1
        print(f"job {args.job_id}: outputs in {dest}")
        return 0
    out = args.output or f"{args.job_id}.safetensors"
    got = sdk.download_weights(args.job_id, out)
    print(f"job {args.job_id}: weights in {got['path']} ({got['bytes']:,} bytes, sha256 {got['sha256']})")
    return 0


def jobs_tensorboard(sdk, args) -> int:
    from .trackers import TensorBoard
    log_dir = args.logdir or f"zwdx-runs/{args.job_id}"
    sent = sdk.export_metrics(args.job_id, [TensorBoard(log_dir=log_dir)])
    print(f"job {args.job_id}: {sent} metric event(s) written to {log_dir} (tensorboard --logdir {log_dir})")
    return 0


# -- the room -------------------------------------------------------------------------------------
def room_show(sdk, args) -> int:
    room = sdk.get_room(room_token(sdk, args))
    if args.json:
        _print_json(room)
        return 0
    totals, usage = room.get("totals") or {}, room.get("usage") or {}
    online = sum(c["status"] == "online" for c in room["clients"])
    fields = [("room", f"{room['name']} ({room['id']})"),
              ("gpu clients", f"{online} online of {len(room['clients'])}")]
    fields += [(k.replace("_", " "), f"{v / 2**30:.1f} GiB" if k.startswith("memory") else v) for k, v in totals.items()]
    if usage:
        limit = usage.get("jobs_limit") or "no limit"
        fields += [("jobs waiting or running", f"{usage['jobs']} of {limit}"),
                   ("bytes stored", f"{gib(usage['artifact_bytes'] + usage.get('event_bytes', 0))} of "
                                    f"{gib(usage['artifact_bytes_limit']) if usage['artifact_bytes_limit'] else 'no limit'}"
                                    f" (artifacts {gib(usage['artifact_bytes'])}, "
                                    f"events {gib(usage.get('event_bytes', 0))})"),
                   ("events", f"{usage.get('events', 0)} of {usage.get('events_limit') or 'no limit'}")]
    _show(tabulate(fields, tablefmt="plain"))
    return 0


def room_clients(sdk, args) -> int:
    if args.clients_action == "prune":
        gone = sdk.prune_clients(room_token(sdk, args), offline_for=args.offline_for)
        if args.json:
            _print_json(gone)
        else:
            _show(f"{len(gone)} offline gpu client(s) dropped" + (f": {', '.join(gone)}" if gone else ""))
        return 0
    room = sdk.get_room(room_token(sdk, args))
    if args.json:
        _print_json(room["clients"])
        return 0
    now, rows = time.time(), []
    for c in room["clients"]:
        for s in c.get("slots") or [{}]:
            busy = f"job {s['job_id']} rank {s.get('rank')}" if s.get("job_id") else "free"
            rows.append([c["id"], c.get("hostname") or "", c["status"], s.get("index", "-"),
                         f"{s.get('kind', '-')} {s.get('name') or ''}".strip(), gib(s.get("memory_free")),
                         gib(s.get("memory_total")), s.get("isolation") or "-", busy if s else "-",
                         _link(c.get("link")), ago(c.get("last_seen"), now)])
    _show(tabulate(rows, headers=["GPU CLIENT", "HOST", "STATUS", "SLOT", "DEVICE", "FREE", "TOTAL", "ISOLATION",
                                  "RUNNING", "LINK (DOWN/UP, RTT)", "LAST SEEN"]))
    apart = sorted({tuple(sorted((c["id"], peer))) for c in room["clients"] for peer in c.get("unreachable") or []})
    for a, b in apart:
        _show(f"{a} and {b} cannot reach each other: DDP/FSDP jobs keep them apart (DILOCO goes anywhere)")
    for c in room["clients"]:
        if c.get("suspected_in"):
            token = f"; its donor token {c['token_id']}: `zwdx room tokens revoke {c['token_id']}` keeps it out" \
                if c.get("token_id") else ""
            _show(f"SUSPECT: {c['id']} was named dishonest by job(s) {', '.join(c['suspected_in'])}{token}")
    return 0


def room_settings(sdk, args) -> int:
    token = room_token(sdk, args)
    room = sdk.set_room(token, client_retention=args.client_retention) if args.client_retention is not None \
        else sdk.get_room(token)
    if args.json:
        _print_json({"client_retention": room.get("client_retention")})
        return 0
    keep = room.get("client_retention")
    _show("client retention: " + ("the server's (--client-retention)" if keep is None else
                                  "never dropped" if not keep else f"{keep:g} s offline, then dropped"))
    return 0


def _mbit(bytes_per_second: float) -> str:
    bits = bytes_per_second * 8
    return f"{bits / 1e9:.1f}G" if bits >= 1e9 else f"{bits / 1e6:.0f}M" if bits >= 1e6 else f"{bits / 1e3:.0f}k"


def _link(link: dict | None) -> str:
    """'940M/910M 0.4ms': bits per second down and up (to the server), and the round trip."""
    if not link:
        return "-"
    return f"{_mbit(link['down'])}/{_mbit(link['up'])} {link['rtt'] * 1000:.1f}ms"


JOB_ACTIONS = {"list": jobs_list, "show": jobs_show, "status": jobs_show, "logs": jobs_logs, "metrics": jobs_metrics,
               "cancel": jobs_cancel, "download": jobs_download, "tensorboard": jobs_tensorboard}


def add_jobs_parser(sub, server_arguments, token_arguments, run) -> None:
    """``zwdx jobs`` (and ``zwdx job``, its earlier name) on the CLI's subparsers."""
    for command in ("jobs", "job"):
        p = sub.add_parser(command, help="a room's jobs: list, show, logs, metrics, cancel, download, tensorboard"
                           if command == "jobs" else "the same as zwdx jobs")
        actions = p.add_subparsers(dest="action", required=True)
        for action, what in (("list", "the room's jobs, newest last"), ("show", "one job: status, placement, results"),
                             ("status", "the same as show"), ("logs", "what the job's ranks printed"),
                             ("metrics", "each metric series: points, last, min, max"), ("cancel", "cancel a job"),
                             ("download", "the trained weights as a safetensors file (a script job: its outputs)"),
                             ("tensorboard", "the job's metrics as TensorBoard event files")):
            a = actions.add_parser(action, help=what)
            if action != "list":
                a.add_argument("job_id")
            else:
                a.add_argument("--status", default=None, help="only jobs in this status")
                a.add_argument("--room", default=None, help="a room the SDK remembers, by id (when it knows several)")
            if action in ("list", "show", "status", "metrics"):
                a.add_argument("--json", action="store_true", help="the server's documents as JSON")
            if action == "logs":
                a.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
                a.add_argument("--rank", type=int, default=None, help="one rank's lines only")
            if action == "download":
                a.add_argument("-o", "--output", default=None,
                               help="the file (default: JOB_ID.safetensors); a script job's folder (default: "
                                    "zwdx-output/JOB_ID)")
            if action == "tensorboard":
                a.add_argument("--logdir", default=None, help="where (default: zwdx-runs/JOB_ID)")
            server_arguments(a)
            token_arguments(a, "a submitter token of the room, zs_... (else the one remembered for the job)")
            a.set_defaults(func=lambda args, fn=JOB_ACTIONS[action]: run(fn, args))


def add_room_parsers(rsub, server_arguments, token_arguments, run) -> None:
    """``zwdx room show``, ``zwdx room clients [prune]`` and ``zwdx room settings``."""
    for action, fn, what in (("show", room_show, "the room: GPU clients online, totals, quotas"),
                             ("clients", room_clients, "the room's GPU clients and their slots; prune: drop the "
                                                       "offline ones"),
                             ("settings", room_settings, "the room's settings: how long offline GPU clients are kept")):
        a = rsub.add_parser(action, help=what)
        if action == "clients":
            a.add_argument("clients_action", nargs="?", choices=["prune"],
                           help="prune: drop the GPU clients offline now (that run no ranks) from the room's list")
            a.add_argument("--offline-for", type=float, default=0.0, metavar="SECONDS",
                           help="prune: only those offline for at least this long (default: every one offline)")
        if action == "settings":
            a.add_argument("--client-retention", type=float, default=None, metavar="SECONDS",
                           help="drop GPU clients offline for longer than this from the room's list, 0: never "
                                "(default: the server's --client-retention, a day)")
        a.add_argument("--room", default=None, help="a room the SDK remembers, by id (when it knows several)")
        a.add_argument("--json", action="store_true", help="the server's document as JSON")
        server_arguments(a)
        token_arguments(a, "a submitter token of the room, zs_...")
        a.set_defaults(func=lambda args, fn=fn: run(fn, args))

