"""``zwdx gpu-client``: lend this machine's GPUs (or CPU slots) to a room."""
from __future__ import annotations

import os
import signal
import sys

from . import defaults, tuning
from .cli_common import byte_size, server_arguments, token_arguments, version_line
from .token_source import token_from

#: ``zwdx gpu-client --isolation`` (``zwdx.protocol.Isolation``).
ISOLATIONS = ("docker", "user", "process")


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


def add_parser(sub) -> None:
    """The ``gpu-client`` subcommand."""
    p = sub.add_parser("gpu-client", help="lend this machine's GPUs to a room")
    p.add_argument("--version", action="version", version=version_line(),
                   help="print zwdx's version and protocol, and exit")
    server_arguments(p)
    token_arguments(p, "the room's donor token, zd_...")
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
