"""Control plane under load: how many simulated GPU clients one server process holds.

    python bench/control_plane.py --clients 100,250,500,1000 --store sqlite,mongo --out $OUT/control.md
    python bench/control_plane.py --clients 100,200 --procs 1 --async-mode threading --all --profile
    python bench/control_plane.py --clients 1000,2000,5000 --store mongo --servers 1,2,4 --all

For each store and each level of simulated GPU clients it starts a fresh server (and, for
``mongo``, a MongoDB wire-protocol server, nx-27017), then ``--procs`` load generators
(bench/simulate.py) that connect the clients at ``--connect-rate`` per second, register them
and keep them heartbeating; once all are registered, SDK users (``--users-per-100`` per 100
clients) submit jobs of ``--world-size`` ranks that the simulated clients run for
``--job-seconds`` while posting metric events, and a dashboard per room watches. After
``--warm`` seconds it measures for ``--hold`` seconds: clients held, heartbeats and metric
events per second, p50/p99 of every REST call and Socket.IO call, metric-to-dashboard
latency, the server's CPU and its peak memory. A level passes when every p99 is under
``--p99-limit`` ms with every client held and no errors; the ramp stops after the first
failing level unless ``--all``. ``--async-mode`` passes the server's own flag (gevent, its
default, or threading). ``--profile`` samples the server with py-spy during the window and
prints where its Python time goes; ``--stalls`` prints the main thread's longest busy periods
(the hub not back to waiting for I/O) and what ran in them. ``--servers N`` (a list: each count a level of its own) runs
N server processes on the level's store with a Redis message queue and HAProxy in front, both
started by the bench (``redis-server`` and ``haproxy`` on PATH; docs/deploy-scale.md): the
clients, users and dashboards reach them through the balancer only, and the server CPU is
theirs added up (the peak memory, the largest one's). ``--kill-one AT`` (levels of two
processes or more) SIGKILLs the last server process AT seconds into the window and reports
its clients' way back (bench/kill_one.py).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import kill_one  # noqa: E402
from harness import BalancerProc, Child, MongoProc, RedisProc, ServerProc, percentile, proc_status, table  # noqa: E402

from zwdx import defaults  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SOCKET_KINDS = ("socket.io heartbeat", "socket.io register", "socket.io ranks_exited")
NOT_GATED = ("socket.io connect", "socket.io register", "job submit->completed", "metric -> dashboard",
             "metric -> SDK", "GET /jobs/<id>?wait (held)", "socket.io register (again)")


def gated(kind: str) -> bool:
    """Whether a call's p99 (or an error of it) decides a level: not one of NOT_GATED, nor made
    during a kill's span (--kill-one: reported apart)."""
    return kind not in NOT_GATED and not kind.endswith((kill_one.DURING, kill_one.AFTER))


def level_database(uri: str, level_dir: str) -> str:
    """``uri`` naming a database of this level's own (a real MongoDB's URI, given without one)."""
    from urllib.parse import urlsplit, urlunsplit
    parts = urlsplit(uri)
    return urlunsplit(parts._replace(path="/" + os.path.basename(level_dir).replace("-", "_")))


def run_level(args, store: str, clients: int, work: str, n_servers: int = 1) -> dict:
    import requests
    level_dir = tempfile.mkdtemp(prefix=f"zwdx-bench-{store}-{clients}-{n_servers}-", dir=args.data_root or work)
    mongo = redis = balancer = None
    servers: list[ServerProc] = []
    gens: list[Child] = []
    spy = stall_spy = None
    try:
        if store == "mongo":
            if not harness.mongo_store_available():
                return {"store": store, "clients": clients, "pending": "zwdx/server/store/mongo.py is not there yet"}
            if not args.mongo_uri:
                mongo = MongoProc(level_dir)
        # The simulated SDK users all share one room: its quota of open jobs (ROOM_MAX_JOBS) would
        # refuse their submits past 100, which limits the room, not the server. Every simulated
        # client speaks from this machine's one address: no cap per address on connections or sessions.
        # They register under their room's one donor token: no cap on its clients or its registers.
        env = {"ZWDX_ROOM_MAX_JOBS": "0", "ZWDX_MAX_CONNECTIONS_PER_ADDRESS": "0", "ZWDX_SOCKET_SESSIONS_PER_ADDRESS": "0",
               "ZWDX_DONOR_MAX_CLIENTS": "0", "ZWDX_RATE_LIMIT_REGISTERS": ""}
        if args.heartbeat_interval:
            env.update({"ZWDX_HEARTBEAT_INTERVAL": str(args.heartbeat_interval),
                        "ZWDX_CLIENT_TIMEOUT": str(max(10.0, 5 * args.heartbeat_interval))})
        if args.heartbeat_rate is not None:
            env["ZWDX_HEARTBEAT_RATE"] = str(args.heartbeat_rate)
        mongo_uri = mongo.uri if mongo else (level_database(args.mongo_uri, level_dir) if store == "mongo" else None)
        if n_servers > 1:  # several processes: one message queue, the balancer in front (deploy-scale.md)
            redis = RedisProc(level_dir)
            env["ZWDX_MESSAGE_QUEUE"] = redis.url
        for _ in range(n_servers):  # on SQLite they share the data dir, on MongoDB the database
            servers.append(ServerProc(os.path.join(level_dir, "server"), mongo_uri=mongo_uri,
                                      extra=["--async-mode", args.async_mode] if args.async_mode else None, env=env))
        if n_servers > 1:
            balancer = BalancerProc(level_dir, [s.url for s in servers])
        server = servers[0]
        url = balancer.url if balancer else server.url
        async_mode = requests.get(f"{url}/health", timeout=10).json().get("async_mode", "threading")
        rooms = [requests.post(f"{url}/api/v1/rooms", json={"name": f"bench-{i}"}).json()
                 for i in range(args.rooms)]
        tokens = [{"submitter": r["submitter_token"], "donor": r["donor_token"]} for r in rooms]
        users = max(1, round(clients * args.users_per_100 / 100))
        kill_at = args.kill_one if n_servers > 1 else None
        plan = {"url": url, "tokens": tokens, "clients": clients, "users": users, "procs": args.procs,
                "connect_rate": args.connect_rate, "connect_timeout": 60, "world_size": args.world_size,
                "job_seconds": args.job_seconds, "metric_interval": args.metric_interval,
                "events_per_post": args.events_per_post, "bundle_bytes": args.bundle_kb * 1024,
                "poll_interval": args.poll_interval, "long_poll": args.long_poll,
                "kill_at": kill_at, "drain": 1.5 * args.job_seconds + 30}
        plan_path = os.path.join(level_dir, "plan.json")
        with open(plan_path, "w") as fh:
            json.dump(plan, fh)
        for i in range(args.procs):
            gens.append(Child([sys.executable, os.path.join(HERE, "simulate.py"), "--plan", plan_path, "--index",
                               str(i), "--result", os.path.join(level_dir, f"result-{i}.json")],
                              os.path.join(level_dir, f"simulate-{i}.log")))
        ramp_started = time.time()

        def ready():
            for g in gens:
                if not g.alive():
                    raise RuntimeError(f"load generator exited:\n{g.tail()}")
            for srv in servers:
                if not srv.alive():
                    raise RuntimeError(f"server exited:\n{srv.tail()}")
            return all(os.path.exists(os.path.join(level_dir, f"ready-{i}")) for i in range(args.procs))
        harness.wait_until(ready, clients / args.connect_rate + 120, interval=0.2, what="simulated clients registered")
        ramp_s = time.time() - ramp_started
        held_ready = 0
        for i in range(args.procs):
            with open(os.path.join(level_dir, f"ready-{i}")) as fh:
                held_ready += json.load(fh)["held"]
        t0 = time.time() + args.warm
        t1 = t0 + args.hold
        with open(os.path.join(level_dir, "go"), "w") as fh:
            json.dump({"t0": t0, "t1": t1}, fh)
        time.sleep(max(0.0, t0 - time.time()))
        cpu0, w0 = sum(harness.cpu_seconds(srv.pid) for srv in servers), time.time()
        gen0 = sum(harness.cpu_seconds(g.pid) for g in gens)
        mongo0 = harness.cpu_seconds(mongo.pid) if mongo else None
        if args.stalls:
            stall_spy = subprocess.Popen([py_spy(), "record", "--pid", str(server.pid), "--idle", "--rate",
                                          str(STALL_RATE), "--duration", str(int(args.hold)), "--format", "speedscope",
                                          "--nonblocking", "--output", os.path.join(level_dir, "server.speedscope.json")],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        if args.profile:
            spy = subprocess.Popen([py_spy(), "record", "--pid", str(server.pid), "--gil", "--rate", str(args.profile_rate),
                                    "--duration", str(int(args.hold)), "--format", "raw", "--nonblocking",
                                    "--output", os.path.join(level_dir, "server.pyspy.txt")],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        killed = None
        if kill_at is not None:  # the last process (py-spy may watch the first), by its pid
            time.sleep(max(0.0, t0 + kill_at - time.time()))
            victim = servers[-1]
            victim_cpu = harness.cpu_seconds(victim.pid)
            victim.kill(signal.SIGKILL)  # the process alone, as a crash
            killed = {"server": len(servers) - 1, "pid": victim.pid, "at": time.time(), "cpu": victim_cpu}
            victim.wait()
        alive = [srv for srv in servers if killed is None or srv.pid != killed["pid"]]
        time.sleep(max(0.0, t1 - time.time()))
        window = time.time() - w0
        cpu = (sum(harness.cpu_seconds(srv.pid) for srv in alive) + (killed["cpu"] if killed else 0) - cpu0) / window
        gen_cpu = (sum(harness.cpu_seconds(g.pid) for g in gens) - gen0) / window
        mongo_cpu = (harness.cpu_seconds(mongo.pid) - mongo0) / window if mongo else None
        each = [proc_status(srv.pid) for srv in alive]
        status = {"VmRSS": max(e["VmRSS"] for e in each), "VmHWM": max(e["VmHWM"] for e in each),
                  "Threads": max(e["Threads"] for e in each)}
        mongo_status = proc_status(mongo.pid) if mongo else None
        online = None
        try:
            online = sum(c["status"] == "online" for t in tokens for c in requests.get(
                f"{url}/api/v1/room", headers={"X-Zwdx-Room-Token": t["submitter"]}, timeout=30).json()["clients"])
        except Exception:
            pass
        for g in gens:
            try:
                g.wait(90 + (plan["drain"] if killed else 0))
            except subprocess.TimeoutExpired:
                g.stop()
        profile = summarize_profile(os.path.join(level_dir, "server.pyspy.txt")) if finished(spy) else None
        stalls = summarize_stalls(os.path.join(level_dir, "server.speedscope.json")) if finished(stall_spy) else None
        lat, errors, counts, samples, held = defaultdict(list), Counter(), Counter(), [], 0
        drops, jobs = [], {}
        for i in range(args.procs):
            path = os.path.join(level_dir, f"result-{i}.json")
            if not os.path.exists(path):
                errors["load generator died"] += 1
                samples.append(gens[i].tail(5))
                continue
            with open(path) as fh:
                r = json.load(fh)
            for k, v in r["lat"].items():
                lat[k].extend(v)
            errors.update(r["errors"])
            counts.update(r["counts"])
            samples += r["error_samples"]
            held += r.get("held_at_end", 0)
            drops += r.get("drops") or []
            jobs.update(r.get("jobs") or {})
        return {"store": store, "servers": n_servers, "clients": clients, "async_mode": async_mode, "users": users, "rooms": args.rooms,
                "ramp_s": ramp_s,
                "held_ready": held_ready, "held": held, "online": online, "hold_s": args.hold,
                "cpu": cpu, "gen_cpu": gen_cpu, "rss": status["VmRSS"], "hwm": status["VmHWM"], "threads": status["Threads"],
                "mongo_hwm": mongo_status["VmHWM"] if mongo_status else None, "mongo_cpu": mongo_cpu,
                "lat": {k: summarize(v) for k, v in lat.items()}, "errors": dict(errors), "counts": dict(counts),
                "error_samples": samples[:10], "profile": profile, "stalls": stalls,
                "kill": {**kill_one.summarize(drops, jobs, t0 + kill_at), "server": killed["server"]} if killed else None}
    finally:
        for recorder in (spy, stall_spy):
            if recorder is not None and recorder.poll() is None:
                os.killpg(recorder.pid, 9)
        for g in gens:
            g.stop(5)
        if balancer is not None:
            balancer.stop()
        for srv in servers:
            srv.stop()
        if redis is not None:
            redis.stop()
        if mongo is not None:
            mongo.stop()
        if not args.keep:
            shutil.rmtree(level_dir, ignore_errors=True)


def finished(recorder: subprocess.Popen | None) -> bool:
    """Wait for a py-spy recording to end (it stops itself after the window), killing it past
    30 s; False when there was none."""
    if recorder is None:
        return False
    try:
        recorder.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(recorder.pid, 9)
        recorder.wait()
    return True


def py_spy() -> str:
    """py-spy's executable: on PATH, or in bin/ of a --target install on PYTHONPATH."""
    found = shutil.which("py-spy")
    for root in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        candidate = os.path.join(root, "bin", "py-spy")
        if not found and root and os.access(candidate, os.X_OK):
            found = candidate
    if not found:
        raise RuntimeError("--profile and --stalls need py-spy (pip install py-spy)")
    return found


def summarize(values: list[float]) -> dict:
    return {"n": len(values), "p50": percentile(values, 50), "p99": percentile(values, 99),
            "max": max(values) if values else None}


def summarize_profile(path: str, top: int = 40) -> list[tuple[str, float, float]]:
    """py-spy's raw stacks -> the frames holding the GIL longest: (frame, self %, inclusive %)."""
    own, incl, total = Counter(), Counter(), 0
    try:
        with open(path) as fh:
            for line in fh:
                stack, _, n = line.rstrip().rpartition(" ")
                if not n.isdigit():
                    continue
                frames = [f.split(" (")[0] + " (" + f.split(" (")[-1].split(":")[0] + ")" if " (" in f else f
                          for f in stack.split(";")]
                total += int(n)
                own[frames[-1]] += int(n)
                for f in set(frames):
                    incl[f] += int(n)
    except OSError:
        return []
    if not total:
        return []
    rows = [(f, 100.0 * own[f] / total, 100.0 * incl[f] / total) for f, _ in incl.most_common(top * 3)]
    return sorted(rows, key=lambda r: -r[2])[:top]


#: Samples a second of ``--stalls`` (py-spy with idle samples: a timeline of the main thread).
STALL_RATE = 250


def _short(frame: dict) -> str:
    return f"{frame['name']} ({os.path.basename(frame.get('file') or '?')}:{frame.get('line', '?')})"


def summarize_stalls(path: str, top: int = 12) -> dict | None:
    """py-spy's timeline of the server's main thread (speedscope, idle samples kept) -> its busy
    periods: runs of samples in which the gevent hub never got back to waiting for I/O. Every
    connection waits out a busy period, so the longest ones are the p99's floor. Per period:
    how long, and what ran (the innermost zwdx frames of its samples, most first)."""
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        return None
    frames = doc.get("shared", {}).get("frames", [])
    profiles = [p for p in doc.get("profiles", []) if p.get("type") == "sampled"]
    if not profiles or not frames:
        return None
    tick_ms = 1000.0 / STALL_RATE

    def idle(stack: list[int]) -> bool:
        leaf = frames[stack[-1]] if stack else None
        return leaf is None or (leaf["name"].rpartition(".")[2] == "run"
                                and (leaf.get("file") or "").endswith(os.path.join("gevent", "hub.py")))

    # The main thread: the one whose samples wait in the hub (the others: the store's checkpointer...)
    main = max(profiles, key=lambda p: sum(1 for stack in p.get("samples", []) if stack and idle(stack)))

    def what(stack: list[int]) -> str:
        ours = [frames[i] for i in stack if "/zwdx/" in (frames[i].get("file") or "")]
        chosen = ours[-2:] if ours else [frames[i] for i in stack[-2:]]
        return " < ".join(_short(f) for f in reversed(chosen))

    periods, run = [], []
    for stack in main.get("samples", []) + [[]]:
        if idle(stack):
            if run:
                periods.append(run)
            run = []
        else:
            run.append(what(stack))
    samples = len(main.get("samples", []))
    busy = sum(len(p) for p in periods)
    longest = sorted(periods, key=len, reverse=True)[:top]
    over = [[ms, sum(1 for p in periods if len(p) * tick_ms >= ms)] for ms in (10, 50, 100, 200)]
    return {"samples": samples, "busy_share": busy / samples if samples else 0.0, "periods": len(periods),
            "over_ms": over, "tick_ms": tick_ms,
            "longest": [[len(p) * tick_ms, Counter(p).most_common(3)] for p in longest]}


def passed(r: dict, limit: float) -> tuple[bool, str]:
    worst = max(((k, v["p99"]) for k, v in r["lat"].items() if gated(k) and v["n"]),
                key=lambda kv: kv[1], default=("-", 0.0))
    why = kill_one.verdict(r["kill"]) if r.get("kill") else []
    if worst[1] >= limit:
        why.append(f"p99 {worst[1]:,.0f} ms ({worst[0]})")
    if r["held"] < r["clients"]:
        why.append(f"held {r['held']}/{r['clients']}")
    errs = sum(n for k, n in r["errors"].items() if not k.endswith((kill_one.DURING, kill_one.AFTER)))
    if errs:
        why.append(f"{errs} errors")
    return not why, "; ".join(why) or f"worst p99 {worst[1]:,.0f} ms ({worst[0]})"


def report(results: list[dict], args) -> str:
    mib = 1024 * 1024
    rows, details = [], []
    for r in results:
        if "pending" in r:
            rows.append([r["store"], r.get("servers", 1), r["clients"]] + ["-"] * 12 + [f"pending: {r['pending']}"])
            continue
        ok, why = passed(r, args.p99_limit)
        lat = r["lat"]
        rest = {k: v for k, v in lat.items() if k.startswith(("GET", "POST")) and gated(k) and v["n"]}
        rest_all = [v for v in rest.values()]
        hb = lat.get("socket.io heartbeat", {"n": 0, "p50": None, "p99": None})
        dash = lat.get("metric -> dashboard", {"n": 0, "p50": None, "p99": None})
        rows.append([r["store"], r.get("servers", 1), r["clients"], f"{r['held']}", hb["n"] / r["hold_s"],
                     r["counts"].get("metric events stored", 0) / r["hold_s"],
                     sum(v["n"] for v in rest_all) / r["hold_s"],
                     max((v["p50"] for v in rest_all), default=None), max((v["p99"] for v in rest_all), default=None),
                     hb["p50"], hb["p99"], dash["p99"], f"{100 * r['cpu']:.0f}%", f"{100 * r['gen_cpu']:.0f}%",
                     r["hwm"] / mib,
                     ("PASS " if ok else "FAIL ") + why])
        det = [[k, v["n"], v["p50"], v["p99"], v["max"]] for k, v in sorted(lat.items())]
        det += [[f"count: {k}", v, "", "", ""] for k, v in sorted(r["counts"].items())]
        det += [[f"errors: {k}", v, "", "", ""] for k, v in sorted(r["errors"].items())]
        details.append(table(["call", "n", "p50 ms", "p99 ms", "max ms"], det,
                             f"{r['store']}, {r.get('servers', 1)} server process(es), {r['clients']} clients, "
                             f"{r['users']} SDK users, {r['rooms']} room(s): "
                             f"every call in the {r['hold_s']:g} s window (ramp {r['ramp_s']:.0f} s, "
                             f"{r['threads']} server threads, RSS {r['rss'] / mib:,.0f} MiB at the end"
                             + (f", nx-27017 peak {r['mongo_hwm'] / mib:,.0f} MiB, CPU {100 * r['mongo_cpu']:.0f}%"
                                if r.get("mongo_hwm") else "")
                             + ")"))
        if r.get("kill"):
            k = r["kill"]
            details.append(table(
                ["clients dropped", "back", "not back", "back p50 s", "back p99 s", "back max s",
                 f"back later than {kill_one.BACK_WITHIN:g} s", "connected again p50 / max s", "jobs", "jobs lost"],
                [[k["dropped"], k["back"], k["not_back"], k["p50_s"], k["p99_s"], k["max_s"], k["late"],
                  f"{harness.fmt(k['connected_p50_s'])} / {harness.fmt(k['connected_max_s'])}", k["jobs"],
                  k["jobs_lost"]]],
                f"server process {k['server']} of {r['servers']} SIGKILLed {args.kill_one:g} s into the window: its "
                f"GPU clients' way back (from the drop to their next register on a process still alive) and the jobs "
                f"submitted (followed to their end); calls and errors marked{kill_one.DURING} are not gated"))
            if k["lost_sample"]:
                details.append("jobs lost: " + " | ".join(k["lost_sample"]) + "\n")
        if r.get("error_samples"):
            details.append("errors seen: " + " | ".join(r["error_samples"][:5]) + "\n")
        if r.get("stalls"):
            st = r["stalls"]
            title = (f"busy periods of the server's main thread, {r['store']}, {r['clients']} clients: busy "
                     f"{100 * st['busy_share']:.0f}% of {st['samples']} samples ({st['tick_ms']:g} ms each), "
                     f"{st['periods']} periods, of which " + ", ".join(f"{n} >= {ms} ms" for ms, n in st["over_ms"]))
            details.append(table(["ms", "what ran (samples), most first"],
                                 [[ms, "; ".join(f"{w} ({n})" for w, n in ran)] for ms, ran in st["longest"]], title))
        if r.get("profile"):
            details.append(table(["server frame (GIL held)", "self %", "incl %"],
                                 [[f, s, i] for f, s, i in r["profile"]],
                                 f"py-spy --gil, {r['store']}, {r['clients']} clients"))
    best = {}
    for r in results:
        if "pending" not in r and passed(r, args.p99_limit)[0]:
            key = f"{r['store']} x{r.get('servers', 1)}"
            best[key] = max(best.get(key, 0), r["clients"])
    modes = ", ".join(dict.fromkeys(r["async_mode"] for r in results if "async_mode" in r)) or "-"
    counts = ", ".join(str(n) for n in dict.fromkeys(r.get("servers", 1) for r in results)) or "1"
    head = (f"\n## Control plane under load: {harness.machine()}; server in {counts} process(es) ({modes}; several: "
            f"Redis and HAProxy in front, started by the bench), "
            f"load generators in {args.procs} process(es) on the same machine\n\n"
            f"Per client: heartbeat every {args.heartbeat_interval or 2:g} s"
            + (", stretched by each server process past " + (f"{args.heartbeat_rate:g}" if args.heartbeat_rate
               is not None else "its default HEARTBEAT_RATE of 250") + " heartbeats/s (see heartbeats/s)"
               if args.heartbeat_rate != 0 else "") + f". SDK users: {args.users_per_100:g} "
            f"per 100 clients, jobs of {args.world_size} ranks for 0.5-1.5 x {args.job_seconds:g} s, "
            + (f"held up to {args.long_poll:g} s until the job has news, at most one call per {args.poll_interval:g} s"
             if args.long_poll else f"polled every {args.poll_interval:g} s")
            + " as ZWDX.wait does (the job with its new events, one call). Each running "
            f"rank posts {args.events_per_post} metric events every {args.metric_interval:g} s. "
            f"{args.rooms} room(s), one dashboard each. Window {args.hold:g} s after {args.warm:g} s warm-up.\n"
            f"Most clients held (store x server processes) with every p99 under {args.p99_limit:g} ms: "
            + (", ".join(f"{k}: {v}" for k, v in best.items()) or "none of the levels tried") + "\n\n")
    summary = table(["store", "servers", "clients", "held", "heartbeats/s", "metric events/s", "REST calls/s",
                     "REST worst p50 ms", "REST worst p99 ms", "heartbeat p50 ms", "heartbeat p99 ms",
                     "metric->dashboard p99 ms", "server CPU", "load generators CPU", "server peak MiB", "verdict"], rows, "Summary")
    return head + summary + "\n" + "\n".join(details)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="100,250,500,1000", help="levels of simulated GPU clients")
    parser.add_argument("--store", default="sqlite", help="sqlite, mongo or both (comma-separated)")
    parser.add_argument("--mongo-uri", default=None,
                        help="for --store mongo: this MongoDB (a database per level is made there) instead "
                             "of an nx-27017 stand-in started by the script")
    parser.add_argument("--servers", default="1",
                        help="server processes (a list: 1,2,4); more than one: with a Redis message queue and HAProxy "
                             "in front, started here (redis-server and haproxy on PATH)")
    parser.add_argument("--kill-one", type=float, default=None, metavar="AT",
                        help="with --servers >= 2: SIGKILL one server process (the last) AT s into the window and "
                             "report how its clients came back and the jobs lost (kill_one.py)")
    parser.add_argument("--rooms", type=int, default=1, help="rooms the clients and users are spread over")
    parser.add_argument("--users-per-100", type=float, default=10, help="SDK users per 100 GPU clients")
    parser.add_argument("--world-size", type=int, default=2, help="ranks per simulated job")
    parser.add_argument("--job-seconds", type=float, default=20, help="how long a simulated job runs")
    parser.add_argument("--metric-interval", type=float, default=1.0, help="seconds between a rank's metric posts")
    parser.add_argument("--events-per-post", type=int, default=5, help="metric events in one post")
    parser.add_argument("--bundle-kb", type=int, default=64, help="size of a simulated job bundle")
    parser.add_argument("--poll-interval", type=float, default=defaults.POLL_INTERVAL,
                        help=f"SDK users' shortest time between polls (SDK: {defaults.POLL_INTERVAL:g} s)")
    parser.add_argument("--heartbeat-rate", type=float, default=None,
                        help="the servers' HEARTBEAT_RATE: heartbeats/s past which a process stretches its clients' "
                             "interval (default: the server's, 250; 0: never, every client at --heartbeat-interval)")
    parser.add_argument("--long-poll", type=float, default=10.0,
                        help="seconds an SDK user's poll asks to be held until the job has news (SDK: 10 s); "
                             "0: plain polls every --poll-interval, as the SDK did before")
    parser.add_argument("--heartbeat-interval", type=float, default=None,
                        help="server's HEARTBEAT_INTERVAL (default 2 s); CLIENT_TIMEOUT becomes 5 x this")
    parser.add_argument("--hold", type=float, default=30, help="seconds measured at each level")
    parser.add_argument("--warm", type=float, default=15, help="seconds of load before measuring")
    parser.add_argument("--procs", type=int, default=min(4, os.cpu_count() or 1), help="load generator processes")
    parser.add_argument("--connect-rate", type=float, default=100, help="new client connections per second")
    parser.add_argument("--p99-limit", type=float, default=200, help="ms")
    parser.add_argument("--all", action="store_true", help="run every level even after one fails")
    parser.add_argument("--async-mode", choices=["gevent", "threading"], default=None,
                        help="the server's --async-mode (default: the server's own, gevent)")
    parser.add_argument("--data-root", default=None,
                        help="where each level's server keeps its data dir (default: a temporary dir; "
                             "/dev/shm takes the disk out of the figures)")
    parser.add_argument("--profile", action="store_true", help="py-spy the server during each window")
    parser.add_argument("--stalls", action="store_true",
                        help="py-spy the first server's main thread as a timeline during each window and print its "
                             "longest busy periods (the hub not back to waiting for I/O) and what ran in them")
    parser.add_argument("--profile-rate", type=int, default=50, help="py-spy samples per second")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds: start no level that would likely end past this (keeps a run inside a limit)")
    parser.add_argument("--keep", action="store_true", help="keep logs and raw results")
    parser.add_argument("--out", default=None, help="append the tables here (and raw figures to OUT.json)")
    args = parser.parse_args()
    server_counts = [int(n) for n in args.servers.split(",") if n.strip()]
    if args.kill_one is not None and max(server_counts) < 2:
        print("bench control_plane: --kill-one needs --servers 2 or more", file=sys.stderr)
        return 2
    harness.require(harness.SERVER_MODULES + ["aiohttp"] + (["pymongo"] if "mongo" in args.store else [])
                    + (["redis"] if max(server_counts) > 1 else []))
    if max(server_counts) > 1:
        missing = [tool for tool in ("redis-server", "haproxy") if not shutil.which(tool)]
        if missing:
            print(f"bench control_plane: --servers {args.servers} needs {' and '.join(missing)} (apt-get install "
                  f"redis-server haproxy)", file=sys.stderr)
            return 2
    limit = harness.raise_fd_limit()
    if limit < 4 * max(int(c) for c in args.clients.split(",")):
        print(f"bench control_plane: only {limit} open files allowed; the largest levels may fail for it",
              flush=True)
    work = tempfile.mkdtemp(prefix="zwdx-bench-control-")
    results = []
    try:
        started, longest = time.time(), 0.0
        for store in [s.strip() for s in args.store.split(",") if s.strip()]:
            for n_servers in server_counts:
                for clients in [int(c) for c in args.clients.split(",")]:
                    name = f"{store} x{n_servers} {clients} clients"
                    if args.budget and time.time() - started + 1.5 * longest > args.budget:
                        print(f"  {name}: skipped (--budget {args.budget:g} s)", flush=True)
                        continue
                    level_started = time.time()
                    r = run_level(args, store, clients, work, n_servers)
                    longest = max(longest, time.time() - level_started)
                    results.append(r)
                    if "pending" in r:
                        print(f"  {store}: pending ({r['pending']})", flush=True)
                        break
                    ok, why = passed(r, args.p99_limit)
                    print(f"  {name}: {'PASS' if ok else 'FAIL'} ({why}); server CPU "
                          f"{100 * r['cpu']:.0f}%, peak {r['hwm'] / 2**20:,.0f} MiB", flush=True)
                    if not ok and not args.all:
                        break
    finally:
        if args.keep:
            print(f"logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    text = report(results, args)
    print(text)
    harness.write_out(args.out, text, {"bench": "control_plane", "machine": harness.machine(), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
