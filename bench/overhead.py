"""Training overhead: the same model, data and steps under bare torchrun and as a zwdx job.

    python bench/overhead.py --gpus 2 --model cnn,gpt2 --out $OUT/overhead-2gpu.md
    python bench/overhead.py --gpus 2 --model gpt2 --parallelism FSDP    # FSDP2 against a torchrun FSDP2 script
    python bench/overhead.py --gpus 2 --model gpt2 --parallelism TP      # TP (one GPU client with both GPUs)
    python bench/overhead.py --gpus 0 --cpu-ranks 2 --model cnn,gpt2     # CPU smoke run (gloo)

The script starts a zwdx server and one GPU client per GPU (or per CPU rank), waits until they
are registered (warm), then for each model runs ``torchrun --nproc_per_node=N bench/ddp_train.py``
and submits the identical workload (bench/workload.py) through the SDK, ``--repeat`` times in
alternating order. It reports, per model: steady-state samples/s of each side (measured inside
the shared train function, after warm-up, between device synchronizes) and their ratio; the time
from submit (zwdx) or launch (torchrun) to the first training step, and what it is made of; the
whole job's wall time. Every process it starts, it stops by pid.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import GpuClientProc, ServerProc, median, table  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def run_torchrun(cfg: dict, n: int, threads: int, work: str, timeout: float) -> dict:
    result_path = os.path.join(work, f"torchrun-{cfg['model']}-{time.time_ns()}.json")
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
            os.path.join(HERE, "ddp_train.py"), "--config", json.dumps(cfg), "--result", result_path]
    launched = time.time()
    proc = harness.Child(args, os.path.join(work, "torchrun.log"), env={"OMP_NUM_THREADS": str(threads)})
    try:
        code = proc.wait(timeout)
    except Exception:
        proc.stop()
        raise RuntimeError(f"torchrun ({cfg['model']}) ran past {timeout:g} s:\n{proc.tail()}")
    ended = time.time()
    if code != 0 or not os.path.exists(result_path):
        raise RuntimeError(f"torchrun ({cfg['model']}) exited {code}:\n{proc.tail()}")
    with open(result_path) as fh:
        r = json.load(fh)
    proc = r.get("process_started_at") or launched
    b = {"launch->rank process": proc - launched, "import torch+join+build+DDP": r["entered_at"] - proc,
         "train_func->step": r["first_step_start"] - r["entered_at"],
         "first step": r["first_step_done"] - r["first_step_start"],
         "total to first step": r["first_step_start"] - launched}
    return {"side": "torchrun", "samples_per_s": r["samples_per_s"], "spread": _spread(r), "breakdown": b,
            "to_first_step": r["first_step_start"] - launched, "first_step_done": r["first_step_done"] - launched,
            "wall": ended - launched, "raw": r}


def _spread(r: dict) -> float:
    """How far apart the fastest and slowest measured window were, in % of the mean."""
    return 100.0 * (r["samples_per_s_max"] - r["samples_per_s_min"]) / r["samples_per_s"]


def run_zwdx(sdk, token: str, cfg: dict, n: int, timeout: float) -> dict:
    import workload

    import zwdx
    from zwdx import defaults
    from zwdx.bundle import pack
    model, optimizer = workload.build(cfg)
    data_loader, train = workload.functions(cfg)
    # The parts of a submit that are not the platform's waiting, timed on their own first.
    t = time.time()
    blob = pack(model, data_loader, train, None, optimizer)
    pack_s = time.time() - t
    import hashlib
    sha = hashlib.sha256(blob).hexdigest()
    t = time.time()
    probe = sdk._json("POST", "/artifacts", token, data=blob, timeout=600,
                      headers={defaults.SHA256_HEADER: sha, "Content-Type": "application/octet-stream"})
    upload_s = time.time() - t
    t = time.time()
    resp = sdk._request("GET", f"{defaults.API_PREFIX}/artifacts/{probe['id']}", token, stream=True, timeout=600)
    for _ in resp.iter_content(defaults.CHUNK_BYTES):
        pass
    download_s = time.time() - t
    del blob

    pipeline = cfg.get("submit", {}).get("pipeline")  # bench/strategies.py's PIPELINE settings
    submitted = time.time()
    res = sdk.submit_job(model=model, data_loader_func=data_loader, train_func=train, optimizer=optimizer,
                         parallelism=cfg.get("parallelism", "DDP"), resources=zwdx.Resources(world_size=n),
                         training=zwdx.Training(epochs=1),
                         run=zwdx.Run(room_token=token, name=f"bench-{cfg['model']}", progress=False,
                                      timeout=timeout), strategy=zwdx.Pipeline(**pipeline) if pipeline else None)
    ended = time.time()
    job, r = res["job"], res["results"]
    if res["status"] != "completed":
        raise RuntimeError(f"zwdx job {res['job_id']} {res['status']}: {res.get('reason')}")
    placement = {p["rank"]: p for p in job.get("placement") or []}
    kinds = {p.get("kind") for p in placement.values()}
    if (cfg["device_type"] == "cuda") != (kinds == {"cuda"}):
        raise RuntimeError(f"zwdx placed the job on {kinds} slots, not {cfg['device_type']}")
    streamed = sdk.get_job_metrics(res["job_id"], token).get("first_step") or [{}]
    marks = startup_marks(sdk.get_job_logs(res["job_id"], token))
    assigned = r["entered_at"] - marks["train_func"]  # the marks count from the job's arrival at rank 0's client
    at = {name: assigned + t for name, t in marks.items()}
    joined = max(at["joined"], at["bundle_loaded"])  # ready: in the group, with the bundle loaded
    b = {  # the way from submit to the first step, in seconds
        "pack+upload+create": job["created_at"] - submitted,
        "queued->placed": job["started_at"] - job["created_at"],
        "placed->at GPU client": assigned - job["started_at"],
        "->rank process": marks["rank_process"],
        "join process group": at["joined"] - at["rank_process"],
        # of the join: every rank at rank 0's store (None: code that does not mark it); the rest
        # is init_process_group (on CUDA, NCCL's communicator)
        "(of which meeting at rank 0's store)": at["met"] - at["rank_process"] if "met" in at else None,
        "(bundle fetch+load, meanwhile)": at["bundle_loaded"] - at["rank_process"],
        "user's data_loader_func": at["data_loader"] - joined,  # before the model: a pipeline traces a batch
        f"model to GPU, wrap {cfg.get('parallelism', 'DDP')}": at["wrapped"] - at["data_loader"],
        "optimizer": at["optimizer_checkpoint"] - at["wrapped"],
        "train_func->step": r["first_step_start"] - r["entered_at"],
        "first step": r["first_step_done"] - r["first_step_start"],
        "total to first step": r["first_step_start"] - submitted,
        # not a stage: how much later than rank 0 the last rank was ready, joined with its bundle
        # loaded (its "running" status; DDP's wrap waits for it)
        "(last rank ready later by)": max([(v or {}).get("started_at") or joined
                                           for v in (job.get("ranks") or {}).values()] + [joined]) - joined,
    }
    return {"side": "zwdx", "job_id": res["job_id"], "samples_per_s": r["samples_per_s"], "spread": _spread(r),
            "to_first_step": r["first_step_start"] - submitted, "first_step_done": r["first_step_done"] - submitted,
            "first_step_streamed": (streamed[0].get("ts") or submitted) - submitted,
            "wall": ended - submitted, "bundle_mb": len_mb(probe["size"]), "pack_s": pack_s,
            "upload_s": upload_s, "download_s": download_s, "breakdown": b, "raw": r}


def startup_marks(logs: list[dict]) -> dict[str, float]:
    """The stages rank 0 logs before train_func ("startup, seconds after ...: name=1.23 ..."),
    in seconds after the job reached its GPU client."""
    for entry in logs:
        if entry.get("rank") == 0 and entry["text"].startswith("startup, "):
            return {k: float(v) for k, v in (p.split("=") for p in entry["text"].split(": ", 1)[1].split())}
    raise RuntimeError("rank 0 logged no startup line")


def len_mb(n: int) -> float:
    return n / 1e6


def fleets(args) -> list[tuple[str, str, dict]]:
    """The zwdx sides to run, each on a server and GPU clients of its own: ``(label, checkout,
    environment of its GPU clients)``. This checkout is "zwdx"; ``--baseline DIR`` adds DIR's
    code as "baseline"; each ``--variant LABEL:VAR=VALUE,...`` adds this checkout with those
    variables (the rank processes' switches, rendezvous.py)."""
    out = [("baseline", os.path.abspath(args.baseline), {})] if args.baseline else []
    out.append(("zwdx", harness.ROOT, {}))
    for item in args.variant:
        label, _, assignments = item.partition(":")
        env = dict(a.split("=", 1) for a in assignments.split(",") if a)
        out.append((label, harness.ROOT, env))
    if len({label for label, _, _ in out} | {"torchrun"}) != len(out) + 1:
        raise SystemExit("bench: each --variant needs a label of its own (not zwdx, baseline or torchrun)")
    return out


def start_fleet(args, work: str, started: list, code: str = harness.ROOT, env: dict | None = None):
    """A server and one GPU client per GPU (or CPU rank) running ``code``'s zwdx, all registered;
    each process is added to ``started`` as it starts (the caller stops them)."""
    server = ServerProc(os.path.join(work, "server"), cwd=code)
    started.append(server)
    from zwdx import ZWDX
    sdk = ZWDX(server.url)
    room = sdk.create_room("bench-overhead")
    token = room["submitter_token"]
    n = args.gpus or args.cpu_ranks
    clients = []
    if args.parallelism == "TP":  # a TP group is one GPU client's: one client with every GPU (or CPU slot)
        clients.append(GpuClientProc(server.url, room["donor_token"], os.path.join(work, "client0"), "bench-0",
                                     gpu=",".join(map(str, range(n))) if args.gpus else None, threads=args.threads,
                                     extra=None if args.gpus else ["--cpu-slots", str(n)], env=env, cwd=code))
        started.insert(0, clients[-1])  # stopped before the server
    else:
        for i in range(n):
            clients.append(GpuClientProc(server.url, room["donor_token"], os.path.join(work, f"client{i}"),
                                         f"bench-{i}", gpu=i if args.gpus else None, threads=args.threads, env=env,
                                         cwd=code))
            started.insert(0, clients[-1])  # stopped before the server

    def online():
        for c in clients:
            if not c.alive():
                raise RuntimeError(f"gpu client {c.client_id} exited:\n{c.tail()}")
        room = sdk.get_room(token)
        return [c for c in room["clients"] if c["status"] == "online"] if \
            sum(c["status"] == "online" for c in room["clients"]) == len(clients) else None
    registered = harness.wait_until(online, 120, what=f"{len(clients)} gpu clients online")
    kinds = {s.get("kind") for c in registered for s in c["slots"]}
    want = "cuda" if args.gpus else "cpu"
    if kinds != {want}:
        raise RuntimeError(f"gpu clients offer {kinds} slots, expected {want} (is pynvml/nvidia-ml-py installed?)")
    return server, clients, sdk, token


def wait_warm(clients, settle: float, timeout: float = 180) -> None:
    """Warm GPU clients: wait until every slot has a standby rank process waiting for its rank
    (a child of the GPU client started with ``--standby``, blocked reading its stdin: its
    ``/proc/PID/wchan`` names a pipe, or where the kernel hides that, it sleeps and used no CPU for
    half a second), then ``settle`` seconds more. Read from /proc, so it holds for any checkout."""
    import psutil

    def waiting(proc) -> bool:
        try:
            with open(f"/proc/{proc.pid}/wchan") as fh:
                where = fh.read().strip()
            if where not in ("", "0"):
                return "pipe" in where
            before = sum(proc.cpu_times()[:2])
            time.sleep(0.5)
            return proc.status() == psutil.STATUS_SLEEPING and sum(proc.cpu_times()[:2]) == before
        except (OSError, psutil.Error):
            return False

    def ready(c) -> bool:
        try:
            kids = psutil.Process(c.pid).children()
        except psutil.NoSuchProcess:
            raise RuntimeError(f"gpu client {c.client_id} exited:\n{c.tail()}")
        standby = []
        for kid in kids:
            try:
                if "--standby" in " ".join(kid.cmdline()):
                    standby.append(kid)
            except psutil.Error:  # a rank process that just ended, not reaped yet
                continue
        return bool(standby) and all(waiting(k) for k in standby)
    try:
        harness.wait_until(lambda: all(ready(c) for c in clients), timeout,
                           what="a standby rank process waiting on every slot")
    except TimeoutError as exc:  # measure anyway, and say so
        print(f"  warning: {exc}; the job starts without", flush=True)
    time.sleep(settle)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=0, help="GPUs (one GPU client each); 0: CPU ranks on gloo")
    parser.add_argument("--cpu-ranks", type=int, default=2, help="ranks when --gpus 0")
    parser.add_argument("--model", default="cnn,gpt2", help="cnn, gpt2 or both (comma-separated)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the preset)")
    parser.add_argument("--warmup", type=int, default=None, help="steps before the measurement")
    parser.add_argument("--batch", type=int, default=None, help="per-rank batch (default: the preset)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=INT",
                        help="override a preset's integer setting, e.g. --set layers=24 --set dim=2048 --set heads=16 "
                             "(a ~1.3 B-parameter gpt2)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each side, alternating which goes first")
    parser.add_argument("--sides", default="torchrun,zwdx",
                        help="which sides to run: torchrun, zwdx or both (the ratio needs both)")
    parser.add_argument("--settle", type=float, default=8.0,
                        help="seconds before each zwdx job once every slot's standby rank process waits for "
                             "its rank")
    parser.add_argument("--parallelism", choices=["DDP", "FSDP", "TP"], default="DDP",
                        help="DDP, FSDP2 (each block a unit, then the root), or TP (the derived plan: each "
                             "block's MLP pair split over all ranks, one GPU client) on both sides")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank, both sides")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one run may take")
    parser.add_argument("--out", default=None, help="append the tables here (and raw figures to OUT.json)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs)")
    parser.add_argument("--baseline", default=None, metavar="DIR",
                        help="another checkout (e.g. a git worktree of main), run as a zwdx side of its own "
                             "(its server and GPU clients), alternating with this one")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL:VAR=VALUE,...",
                        help="this checkout once more as a zwdx side of its own, its GPU clients (and ranks) with "
                             "these variables, e.g. lazy-nccl:ZWDX_EAGER_NCCL=0")
    args = parser.parse_args()
    harness.require(harness.SERVER_MODULES + harness.CLIENT_MODULES + (["pynvml"] if args.gpus else []))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on lent machines
    import workload

    device = "cuda" if args.gpus else "cpu"
    n = args.gpus or args.cpu_ranks
    work = tempfile.mkdtemp(prefix="zwdx-bench-overhead-")
    where = harness.machine()
    print(f"bench overhead: {n} {'GPU' if args.gpus else 'CPU'} rank(s) on {where}; work dir {work}", flush=True)
    fleet: dict[str, tuple] = {}  # zwdx side -> (server, clients, sdk, token)
    started: list = []  # every process started, in the order to stop them
    runs: dict[str, list[dict]] = {}
    failures: list[str] = []
    try:
        zwdx_sides = fleets(args) if "zwdx" in args.sides.split(",") else []
        for label, code, env in zwdx_sides:
            fleet[label] = start_fleet(args, os.path.join(work, label), started, code, env)
        for model in [m.strip() for m in args.model.split(",") if m.strip()]:
            for rep in range(args.repeat):
                cfg = workload.config(model, device, steps=args.steps, warmup=args.warmup, batch=args.batch,
                                      seed=rep, parallelism=args.parallelism,
                                      tp=n if args.parallelism == "TP" else 1,
                                      **{k: int(v) for k, v in (item.split("=", 1) for item in args.set)})
                order = ["torchrun"] if "torchrun" in args.sides.split(",") else []
                order += [label for label, _, _ in zwdx_sides]
                shift = rep % len(order) if order else 0  # each side goes first in turn
                for side in order[shift:] + order[:shift]:
                    try:
                        if side == "torchrun":
                            r = run_torchrun(cfg, n, args.threads, work, args.timeout)
                        else:
                            _, clients, sdk, token = fleet[side]
                            wait_warm(clients, args.settle)
                            r = run_zwdx(sdk, token, cfg, n, args.timeout)
                            r["side"] = side
                    except Exception as exc:  # report what did run; say what did not
                        failures.append(f"{model} rep {rep} {side}: {exc}")
                        print(f"  {model} rep {rep} {side:8s}: FAILED: {exc}", flush=True)
                        continue
                    r["cfg"] = cfg
                    runs.setdefault(model, []).append(r)
                    joined = r["breakdown"].get("join process group")
                    print(f"  {model} rep {rep} {side:8s}: {r['samples_per_s']:,.1f} samples/s, first step "
                          f"{r['to_first_step']:.2f} s{f' (join {joined:.2f} s)' if joined is not None else ''}, "
                          f"wall {r['wall']:.1f} s", flush=True)
    finally:
        harness.stop_all(started, work, args.keep)
    return harness.finish(args.out, report(runs, n, args, where), failures,
                          {"bench": "overhead", "machine": where, "ranks": n, "runs": runs})


def report(runs: dict, n: int, args, where: str) -> str:
    unit = f"{n} x {'GPU' if args.gpus else 'CPU rank'}"
    rows_t, rows_s, stages = [], [], {}

    def med(runs_, key, sub=None):
        values = [(r[key] if sub is None else r[key][sub]) for r in runs_]
        return median([v for v in values if v is not None]) if any(v is not None for v in values) else None
    for model, rs in runs.items():
        side: dict[str, list] = {}
        for r in rs:
            side.setdefault(r["side"], []).append(r)
        for name, group in side.items():
            keys = list(group[0]["breakdown"])
            stages.setdefault(name, []).append(([model] + [med(group, "breakdown", k) for k in keys], keys))
        tr = side.get("torchrun", [])
        for name, zw in side.items():
            if name == "torchrun":
                continue
            cfg = rs[0]["cfg"]
            z_sps = med(zw, "samples_per_s")
            if tr:
                t_sps = med(tr, "samples_per_s")
                rows_t.append([model, name, unit, cfg["batch"], f"{cfg['steps']} ({cfg['warmup']})", t_sps, z_sps,
                               f"{100 * z_sps / t_sps:.2f}%", f"{med(tr, 'spread'):.1f}% / {med(zw, 'spread'):.1f}%"])
            transfer = median([r["upload_s"] + r["download_s"] for r in zw])
            to_first = med(zw, "to_first_step")
            firsts = [r["to_first_step"] for r in zw]
            rows_s.append([model, name, med(tr, "to_first_step") if tr else None, to_first,
                           f"{min(firsts):.2f}-{max(firsts):.2f}", med(zw, "first_step_done"),
                           med(zw, "first_step_streamed"),
                           med(zw, "bundle_mb"), med(zw, "pack_s"), transfer, to_first - transfer,
                           median([r["raw"]["epoch_end_s"] for r in zw]), med(tr, "wall") if tr else None,
                           med(zw, "wall")])
    head = (f"\n## zwdx overhead over bare torchrun: {where}; {unit}, {args.parallelism}, "
            f"{'bf16 autocast' if args.gpus else 'fp32, gloo'}, median of {args.repeat} run(s) per side\n\n")
    out = [head]
    if rows_t:
        out += [table(["model", "side", "ranks", "batch/rank", "steps (warm-up)", "torchrun samples/s",
                       "zwdx samples/s", "zwdx / torchrun", "window spread t / z"], rows_t,
                      "Steady-state throughput"), "\n"]
    if rows_s:
        out += [table(["model", "side", "torchrun launch->1st step s", "zwdx submit->1st step s", "(each run) min-max s",
                       "zwdx submit->1st step done s", "(as streamed) s", "bundle MB", "pack s", "upload+download s", "zwdx minus transfer s",
                       "zwdx epoch-end checkpoint s", "torchrun wall s", "zwdx wall s"], rows_s,
                      "Time to first step and whole job")]
    for name, rows in stages.items():
        if rows:
            out += ["\n", table(["model"] + rows[0][1], [r for r, _ in rows],
                                 f"{name}: launch or submit to first step, seconds per stage (rank 0)", digits=2)]
    return "".join(out)


if __name__ == "__main__":
    sys.exit(main())
