"""One load-generator process of bench/control_plane.py: simulated GPU clients, SDK users and
dashboards, all in one asyncio loop (python-socketio's AsyncClient, aiohttp for REST).

    python bench/simulate.py --plan plan.json --index 0 --result r0.json     # started by control_plane.py

A simulated GPU client connects to /gpu with its room's token, registers one CUDA slot,
heartbeats at the interval the server asks for (at register, and anew in a heartbeat's answer), answers ``reserve_port``, and for each
``job_assign`` plays its ranks as gpu_client.rank.runner would over REST: ``running``, a batch of
metric events every ``metric_interval`` s, ``completed`` after 0.5 to 1.5 x ``job_seconds``, then
``ranks_exited`` over Socket.IO. A simulated SDK user submits a job (bundle upload, create),
waits on it as ``ZWDX.wait`` does (the job with its new events, one call held up to
``long_poll`` s until the job has news, at most one every ``poll_interval``, 1 s in the SDK;
``long_poll`` 0: a plain poll every ``poll_interval``) and reads its metrics, again and again. A dashboard joins
/ui and notes how long each metric event took from the rank's report to its screen. Only what
happens inside the measurement window is kept.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import platform
import random
import sys
import time
from collections import defaultdict

import aiohttp
import socketio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's zwdx
from zwdx.protocol.base import PROTOCOL  # noqa: E402  (the protocol the simulated clients speak)

API = "/api/v1"
TOKEN = "X-Zwdx-Room-Token"
RANK_KEY = "X-Zwdx-Rank-Key"
SHA = "X-Zwdx-Sha256"


class Recorder:
    def __init__(self, plan: dict):
        self.t0, self.t1 = None, None
        self.lat: dict[str, list[float]] = defaultdict(list)
        self.errors: dict[str, int] = defaultdict(int)
        self.counts: dict[str, int] = defaultdict(int)
        self.error_samples: list[str] = []

    def inside(self, t: float) -> bool:
        return self.t0 is not None and self.t0 <= t <= self.t1

    def note(self, kind: str, started: float, ended: float | None = None) -> None:
        ended = ended or time.time()
        if self.inside(started):
            self.lat[kind].append(1000.0 * (ended - started))

    def error(self, kind: str, exc) -> None:
        if self.t0 is None or time.time() <= self.t1:
            self.errors[kind] += 1
            if len(self.error_samples) < 20:
                self.error_samples.append(f"{kind}: {type(exc).__name__}: {exc}"[:300])

    def count(self, kind: str, n: int = 1, at: float | None = None) -> None:
        if self.inside(at or time.time()):
            self.counts[kind] += n


class Sim:
    def __init__(self, plan: dict, index: int):
        self.plan, self.index = plan, index
        self.url = plan["url"]
        self.rec = Recorder(plan)
        self.stop = asyncio.Event()
        self.http: aiohttp.ClientSession | None = None
        self.held = self.held_at_end = 0
        self.versions = {"python": platform.python_version(), "torch": "2.4.0", "cloudpickle": "3.0.0"}

    # -- REST -----------------------------------------------------------------------------
    async def rest(self, kind: str, method: str, path: str, token: str | None, rank_key: str | None = None, **kw):
        """A REST call with a room's submitter token, or a rank's key (as a rank process calls)."""
        headers = {**({TOKEN: token} if token else {}), **({RANK_KEY: rank_key} if rank_key else {}),
                   **kw.pop("headers", {})}
        started = time.time()
        try:
            async with self.http.request(method, f"{self.url}{API}{path}", headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=60), **kw) as resp:
                body = await resp.read()
                if resp.status >= 400:
                    raise RuntimeError(f"HTTP {resp.status}: {body[:200]!r}")
            self.rec.note(kind, started)
            return json.loads(body) if body else None
        except Exception as exc:
            self.rec.error(kind, exc)
            return None

    # -- a GPU client ---------------------------------------------------------------------
    async def gpu_client(self, n: int, token: str, delay: float) -> None:
        await asyncio.sleep(delay)
        cid = f"sim-{self.index}-{n}"
        sio = socketio.AsyncClient(reconnection=False, http_session=self.http, ssl_verify=False)
        jobs: dict[str, asyncio.Task] = {}
        running: dict[str, int] = {}
        ns = "/gpu"
        secret: dict[str, str] = {}  # the client secret its first register was answered with

        async def reserve_port(data):
            return {"addr": "127.0.0.1", "port": 20000 + random.randrange(20000)}

        async def job_assign(data):
            self.rec.count("jobs assigned")
            running[data["job_id"]] = int(data.get("attempt") or 0)
            jobs[data["job_id"]] = asyncio.create_task(self.ranks(sio, data, running))

        async def job_cancel(data):
            task = jobs.pop(data.get("job_id"), None)
            if task is not None:
                task.cancel()
            running.pop(data.get("job_id"), None)

        async def register():
            slot = {"index": 0, "kind": "cuda", "name": "Simulated H100", "memory_total": 80 * 2**30,
                    "memory_free": 79 * 2**30, "utilization": 0}
            answer = await sio.call("register", {
                "client_id": cid, "hostname": f"sim-host-{n}", "slots": [slot], "versions": self.versions,
                "advertise_addr": "127.0.0.1", "running": [{"job_id": j, "attempt": a} for j, a in running.items()],
                **({"client_secret": secret["s"]} if secret else {})}, namespace=ns, timeout=60)
            if not answer or not answer.get("ok"):
                raise RuntimeError(f"register refused: {answer}")
            if answer.get("client_secret"):
                secret["s"] = answer["client_secret"]
            return answer

        sio.on("reserve_port", reserve_port, namespace=ns)
        sio.on("job_assign", job_assign, namespace=ns)
        sio.on("job_cancel", job_cancel, namespace=ns)
        started = time.time()
        try:
            await sio.connect(self.url, namespaces=[ns], auth={"token": token, "protocol": PROTOCOL}, transports=["websocket"],
                              wait_timeout=60)
            self.rec.note("socket.io connect", started)
            started = time.time()
            answer = await register()
            self.rec.note("socket.io register", started)
        except Exception as exc:
            self.rec.error("socket.io connect+register", exc)
            await self._close(sio)
            return
        self.held += 1
        interval = float(answer.get("heartbeat_interval") or 2.0)
        await asyncio.sleep(random.random() * interval)
        try:
            while not self.stop.is_set():
                t = time.time()
                try:
                    stats = [{"index": 0, "memory_free": 79 * 2**30 - random.randrange(2**30),
                              "utilization": random.randrange(100)}]
                    answer = await sio.call("heartbeat", {"slots": stats, "running": [
                        {"job_id": j, "attempt": a} for j, a in running.items()]}, namespace=ns, timeout=30)
                    self.rec.note("socket.io heartbeat", t)
                    if answer and not answer.get("ok"):  # declared lost: register again, as the agent does
                        self.rec.count("re-registrations (declared lost)")
                        answer = await register() or {}
                    if answer and answer.get("heartbeat_interval"):  # the server's new pace, as the agent takes it
                        interval = float(answer["heartbeat_interval"])
                except Exception as exc:
                    self.rec.error("socket.io heartbeat", exc)
                    if not sio.connected:
                        break
                try:
                    await asyncio.wait_for(self.stop.wait(), max(0.0, interval - (time.time() - t)))
                except asyncio.TimeoutError:
                    pass
        finally:
            self.held -= 1
            for task in jobs.values():
                task.cancel()
            await self._close(sio)

    async def _close(self, sio) -> None:
        try:
            await asyncio.wait_for(sio.disconnect(), 5)
        except Exception:
            pass

    async def ranks(self, sio, data: dict, running: dict) -> None:
        """The rank processes of one job on this client, as the runner drives them over REST:
        each with its own rank key, and no room token."""
        plan = self.plan
        job, keys = data["job_id"], {r["rank"]: r["key"] for r in data["ranks"]}
        ranks = list(keys)
        try:
            for r in ranks:
                await self.rest("POST /ranks running", "POST", f"/jobs/{job}/ranks/{r}", None, keys[r],
                                json={"status": "running"})
            ends, step, n = time.time() + plan["job_seconds"] * random.uniform(0.5, 1.5), 0, 0
            while time.time() < ends and not self.stop.is_set():
                await asyncio.sleep(plan["metric_interval"])
                for r in ranks:
                    events = []
                    for _ in range(plan["events_per_post"]):
                        n += 1
                        step += 1
                        events.append({"kind": "metric", "rank": r, "key": f"0:{n}", "step": step,
                                       "data": {"loss": 2.0 / (1 + step), "lr": 3e-4}, "ts": time.time()})
                    t = time.time()
                    out = await self.rest("POST /events (metrics)", "POST", f"/jobs/{job}/events", None, keys[r],
                                          json={"events": events})
                    if out:
                        self.rec.count("metric events stored", int(out.get("stored", 0)), t)
            for r in ranks:
                await self.rest("POST /ranks completed", "POST", f"/jobs/{job}/ranks/{r}", None, keys[r],
                                json={"status": "completed", "results": {"loss": 0.1}, "final_loss": 0.1,
                                      "fingerprint": "5" * 64})  # a sha256, as a rank sends
            t = time.time()
            try:
                await sio.call("ranks_exited", {"job_id": job, "attempt": running.get(job, 0),
                                                "exits": {str(r): 0 for r in ranks}}, namespace="/gpu", timeout=30)
                self.rec.note("socket.io ranks_exited", t)
            except Exception as exc:
                self.rec.error("socket.io ranks_exited", exc)
        finally:
            running.pop(job, None)

    # -- an SDK user ----------------------------------------------------------------------
    async def user(self, n: int, token: str) -> None:
        await asyncio.sleep(random.random() * self.plan["job_seconds"] / 2)  # users do not act in step
        plan = self.plan
        while not self.stop.is_set():
            blob = os.urandom(plan["bundle_bytes"])
            art = await self.rest("POST /artifacts (bundle)", "POST", "/artifacts", token, data=blob,
                                  headers={SHA: hashlib.sha256(blob).hexdigest(),
                                           "Content-Type": "application/octet-stream"})
            if not art:
                await asyncio.sleep(1)
                continue
            job = await self.rest("POST /jobs", "POST", "/jobs", token, json={
                "bundle_artifact": art["id"], "parallelism": "DDP", "epochs": 1, "world_size": plan["world_size"],
                "memory_required": 0, "versions": self.versions, "name": f"sim-{self.index}-{n}"})
            if not job:
                await asyncio.sleep(1)
                continue
            submitted, after = time.time(), 0
            while not self.stop.is_set():  # as ZWDX.wait: the job and its new events in one call
                asked = time.monotonic()
                if plan["long_poll"]:  # held until the job has news: its time is not a latency
                    doc = await self.rest("GET /jobs/<id>?wait (held)", "GET", f"/jobs/{job['id']}", token,
                                          params={"events_after": str(after), "wait": str(plan["long_poll"])})
                else:
                    doc = await self.rest("GET /jobs/<id>?events_after", "GET", f"/jobs/{job['id']}", token,
                                          params={"events_after": str(after)})
                if doc and doc.get("events"):
                    after = doc["events"][-1]["seq"]
                    now = time.time()
                    for ev in doc["events"]:
                        if ev.get("kind") == "metric" and ev.get("ts"):
                            self.rec.note("metric -> SDK", float(ev["ts"]), now)
                if doc and doc["status"] in ("completed", "failed", "cancelled"):
                    self.rec.count(f"jobs {doc['status']}")
                    if doc["status"] == "completed":
                        self.rec.note("job submit->completed", submitted)
                    break
                await asyncio.sleep(max(0.0, plan["poll_interval"] - (time.monotonic() - asked)))
            await self.rest("GET /jobs/<id>/metrics", "GET", f"/jobs/{job['id']}/metrics", token)

    # -- a dashboard ----------------------------------------------------------------------
    async def dashboard(self, token: str) -> None:
        sio = socketio.AsyncClient(reconnection=False, http_session=self.http)

        async def job_events(data):
            now = time.time()
            for ev in data.get("events") or []:
                if ev.get("kind") == "metric" and ev.get("ts"):
                    self.rec.note("metric -> dashboard", float(ev["ts"]), now)

        async def clients_update(data):
            self.rec.count("clients_update pushes")
            self.rec.count("clients_update client docs", len(data.get("clients") or []))

        sio.on("job_events", job_events, namespace="/ui")
        sio.on("clients_update", clients_update, namespace="/ui")
        try:
            await sio.connect(self.url, namespaces=["/ui"], auth={"token": token, "protocol": PROTOCOL}, transports=["websocket"],
                              wait_timeout=60)
        except Exception as exc:
            self.rec.error("dashboard connect", exc)
            return
        await self.stop.wait()
        await self._close(sio)

    # -- the run --------------------------------------------------------------------------
    async def run(self, ready_path: str, go_path: str) -> None:
        plan, me = self.plan, self.index
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False))
        tokens = plan["tokens"]
        mine = [c for c in range(plan["clients"]) if c % plan["procs"] == me]
        rate = plan["connect_rate"] / plan["procs"]
        tasks = [asyncio.create_task(self.gpu_client(c, tokens[c % len(tokens)]["donor"], i / rate))
                 for i, c in enumerate(mine)]
        if me == 0:
            tasks += [asyncio.create_task(self.dashboard(t["submitter"])) for t in tokens]
        deadline = time.time() + len(mine) / rate + plan["connect_timeout"]
        while self.held < len(mine) and time.time() < deadline:
            await asyncio.sleep(0.2)
        # Its clients, held for the whole run, out of the garbage collector's sight: its full
        # collections would otherwise pause it as they paused servers (zwdx/server/collector.py),
        # and those pauses would count in what it measures.
        gc.collect()
        gc.freeze()
        with open(ready_path, "w") as fh:
            json.dump({"held": self.held, "wanted": len(mine)}, fh)
        while not os.path.exists(go_path):
            await asyncio.sleep(0.1)
        with open(go_path) as fh:
            go = json.load(fh)
        self.rec.t0, self.rec.t1 = go["t0"], go["t1"]
        users = [u for u in range(plan["users"]) if u % plan["procs"] == me]
        tasks += [asyncio.create_task(self.user(u, tokens[u % len(tokens)]["submitter"])) for u in users]
        await asyncio.sleep(max(0.0, go["t1"] - time.time()))
        self.held_at_end = self.held
        self.stop.set()
        _, pending = await asyncio.wait(tasks, timeout=30)
        for task in pending:
            task.cancel()
        await self.http.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    with open(args.plan) as fh:
        plan = json.load(fh)
    sim = Sim(plan, args.index)
    base = os.path.dirname(os.path.abspath(args.result))
    asyncio.run(sim.run(os.path.join(base, f"ready-{args.index}"), os.path.join(base, "go")))
    rec = sim.rec
    with open(args.result, "w") as fh:
        json.dump({"lat": rec.lat, "errors": rec.errors, "counts": rec.counts, "error_samples": rec.error_samples,
                   "held_at_end": sim.held_at_end,
                   "window": [rec.t0, rec.t1]}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
