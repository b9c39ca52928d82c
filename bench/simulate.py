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

With a kill planned (``kill_at``, control_plane.py ``--kill-one``) the clients ride out a server
process that dies as gpu_client does: a dropped connection is made again through the balancer
(python-socketio's reconnection, the agent's delays) and registered anew with the jobs it runs;
the ranks' REST calls are tried again while the server is away (gpu_client/outage.py); the
dashboards reconnect. Each drop is noted with when its client was registered again, the calls
and errors of the kill's span are filed apart (kill_one.py), and after the window the SDK users
follow the jobs they submitted to their end (for at most ``drain`` s) so that a lost one shows.
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

import aiohttp
import socketio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout's zwdx
from zwdx.protocol.base import PROTOCOL  # noqa: E402  (the protocol the simulated clients speak)
from recorder import Recorder  # noqa: E402

AWAY = (502, 503, 504)  # what HAProxy answers for a server process that is gone

API = "/api/v1"
TOKEN = "X-Zwdx-Room-Token"
RANK_KEY = "X-Zwdx-Rank-Key"
SHA = "X-Zwdx-Sha256"


class Away(RuntimeError):
    """A proxy's answer for a server that is away."""


#: How long a rank's call is tried again while the server is away (a rank's is 900 s; the
#: bench's drain is shorter).
PATIENCE = 120.0


class Sim:
    def __init__(self, plan: dict, index: int):
        self.plan, self.index = plan, index
        self.url = plan["url"]
        self.rec = Recorder()
        self.stop = asyncio.Event()
        self.closing = asyncio.Event()  # no new jobs (set with stop, or before it to follow jobs to their end)
        self.reconnect = plan.get("kill_at") is not None
        self.jobs_seen: dict[str, str | None] = {}  # job id -> its last status seen by its SDK user
        self.http: aiohttp.ClientSession | None = None
        self.held = self.held_at_end = 0
        self.versions = {"python": platform.python_version(), "torch": "2.4.0", "cloudpickle": "3.0.0"}

    # -- REST -----------------------------------------------------------------------------
    async def rest(self, kind: str, method: str, path: str, token: str | None, rank_key: str | None = None, **kw):
        """A REST call with a room's submitter token, or a rank's key (as a rank process calls)."""
        headers = {**({TOKEN: token} if token else {}), **({RANK_KEY: rank_key} if rank_key else {}),
                   **kw.pop("headers", {})}
        started, tries = time.time(), 0
        # a rank's calls are tried again while the server is away, as gpu_client/outage.py does
        patient = self.reconnect and rank_key is not None
        while True:
            try:
                async with self.http.request(method, f"{self.url}{API}{path}", headers=headers,
                                             timeout=aiohttp.ClientTimeout(total=60), **kw) as resp:
                    body = await resp.read()
                    if resp.status >= 400:
                        raise (Away if resp.status in AWAY else RuntimeError)(f"HTTP {resp.status}: {body[:200]!r}")
                self.rec.note(kind, started)
                if tries:
                    self.rec.count(f"{kind}: sent again (server away)")
                return json.loads(body) if body else None
            except (Away, aiohttp.ClientConnectionError) as exc:
                if not patient or time.time() - started > PATIENCE:
                    self.rec.error(kind, exc, started)
                    return None
                await asyncio.sleep(min(5.0, 0.5 * 2 ** tries))
                tries += 1
            except Exception as exc:
                self.rec.error(kind, exc, started)
                return None

    # -- a GPU client ---------------------------------------------------------------------
    async def gpu_client(self, n: int, token: str, delay: float) -> None:
        await asyncio.sleep(delay)
        cid = f"sim-{self.index}-{n}"
        # with a kill planned: reconnecting as the agent does (gpu_client/agent/agent.py)
        sio = socketio.AsyncClient(reconnection=self.reconnect, reconnection_delay=0.5, reconnection_delay_max=2,
                                   randomization_factor=0.5, http_session=self.http, ssl_verify=False)
        registered = asyncio.Event()
        drop: list[list] = []  # its last drop: [[client, dropped at, registered again at]]
        jobs: dict[str, asyncio.Task] = {}
        running: dict[str, int] = {}
        ns = "/gpu"
        secret: dict[str, str] = {}  # the client secret its first register was answered with

        async def reserve_port(data):
            return {"addr": "127.0.0.1", "port": 20000 + random.randrange(20000)}

        async def job_assign(data):
            self.rec.count("jobs assigned")
            earlier = jobs.pop(data["job_id"], None)  # an attempt before this one
            if earlier is not None:
                earlier.cancel()
            running[data["job_id"]] = int(data.get("attempt") or 0)
            jobs[data["job_id"]] = asyncio.create_task(self.ranks(sio, data, running, registered))

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

        async def disconnected(*_):
            if registered.is_set() and not self.stop.is_set():
                registered.clear()
                self.held -= 1
                drop[:] = [[cid, time.time(), None]]
                self.rec.drops.append(drop[0])

        async def connected():
            if drop and not registered.is_set():  # connected again: registered again, with its jobs
                drop[0][3:] = [time.time()]
                asyncio.get_running_loop().create_task(register_again())

        async def register_again():  # (the connect event comes before sio.connected is True)
            while not registered.is_set() and not self.stop.is_set():
                t = time.time()
                try:
                    await register()
                except Exception as exc:
                    self.rec.error("socket.io register (again)", exc, t)
                    if ns not in sio.namespaces:  # dropped again: its next connect tries
                        return
                    await asyncio.sleep(1.0)
                    continue
                self.rec.note("socket.io register (again)", t)
                drop[0][2] = time.time()
                registered.set()
                self.held += 1

        if self.reconnect:
            sio.on("disconnect", disconnected, namespace=ns)
            sio.on("connect", connected, namespace=ns)
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
        registered.set()
        interval = float(answer.get("heartbeat_interval") or 2.0)
        await asyncio.sleep(random.random() * interval)
        try:
            while not self.stop.is_set():
                if not registered.is_set():  # dropped: it beats again once registered elsewhere
                    try:
                        await asyncio.wait_for(registered.wait(), 1.0)
                    except asyncio.TimeoutError:
                        pass
                    continue
                t = time.time()
                try:
                    stats = [{"index": 0, "memory_free": 79 * 2**30 - random.randrange(2**30),
                              "utilization": random.randrange(100)}]
                    answer = await sio.call("heartbeat", {"slots": stats, "running": [
                        {"job_id": j, "attempt": a} for j, a in running.items()]}, namespace=ns,
                        timeout=10)  # the agent's: a beat sent as its server dies waits this out
                    self.rec.note("socket.io heartbeat", t)
                    if answer and not answer.get("ok"):  # declared lost: register again, as the agent does
                        self.rec.count("re-registrations (declared lost)")
                        answer = await register() or {}
                    if answer and answer.get("heartbeat_interval"):  # the server's new pace, as the agent takes it
                        interval = float(answer["heartbeat_interval"])
                except Exception as exc:
                    self.rec.error("socket.io heartbeat", exc, t)
                    if not sio.connected and not self.reconnect:
                        break
                try:
                    await asyncio.wait_for(self.stop.wait(), max(0.0, interval - (time.time() - t)))
                except asyncio.TimeoutError:
                    pass
        finally:
            if registered.is_set():
                self.held -= 1
            for task in jobs.values():
                task.cancel()
            await self._close(sio)

    async def _close(self, sio) -> None:
        try:
            await asyncio.wait_for(sio.disconnect(), 5)
        except Exception:
            pass

    async def ranks(self, sio, data: dict, running: dict, registered: asyncio.Event) -> None:
        """The rank processes of one job on this client, as the runner drives them over REST:
        each with its own rank key, and no room token."""
        plan = self.plan
        job, keys = data["job_id"], {r["rank"]: r["key"] for r in data["ranks"]}
        attempt = int(data.get("attempt") or 0)
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
            for _ in range(3 if self.reconnect else 1):  # said again once its client is registered again
                t = time.time()
                try:
                    if self.reconnect:
                        await asyncio.wait_for(registered.wait(), 60)
                    await sio.call("ranks_exited", {"job_id": job, "attempt": attempt,
                                                    "exits": {str(r): 0 for r in ranks}}, namespace="/gpu", timeout=30)
                    self.rec.note("socket.io ranks_exited", t)
                    break
                except Exception as exc:
                    self.rec.error("socket.io ranks_exited", exc, t)
        finally:
            if running.get(job) == attempt:
                running.pop(job, None)

    # -- an SDK user ----------------------------------------------------------------------
    async def user(self, n: int, token: str) -> None:
        await asyncio.sleep(random.random() * self.plan["job_seconds"] / 2)  # users do not act in step
        plan = self.plan
        while not self.closing.is_set():
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
            self.jobs_seen[job["id"]] = job.get("status")
            while not self.stop.is_set():  # as ZWDX.wait: the job and its new events in one call
                asked = time.monotonic()
                if plan["long_poll"]:  # held until the job has news: its time is not a latency
                    doc = await self.rest("GET /jobs/<id>?wait (held)", "GET", f"/jobs/{job['id']}", token,
                                          params={"events_after": str(after), "wait": str(plan["long_poll"])})
                else:
                    doc = await self.rest("GET /jobs/<id>?events_after", "GET", f"/jobs/{job['id']}", token,
                                          params={"events_after": str(after)})
                if doc:
                    self.jobs_seen[job["id"]] = doc["status"]
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
        sio = socketio.AsyncClient(reconnection=self.reconnect, http_session=self.http)

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
        if self.reconnect:
            self.rec.kill_time = go["t0"] + plan["kill_at"]
        users = [u for u in range(plan["users"]) if u % plan["procs"] == me]
        following = [asyncio.create_task(self.user(u, tokens[u % len(tokens)]["submitter"])) for u in users]
        tasks += following
        await asyncio.sleep(max(0.0, go["t1"] - time.time()))
        self.held_at_end = self.held
        self.closing.set()
        if self.reconnect and following:  # the jobs under way, followed to their end (or for `drain` s)
            await asyncio.wait(following, timeout=plan.get("drain", 60))
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
                   "held_at_end": sim.held_at_end, "drops": rec.drops,
                   "jobs": sim.jobs_seen if sim.reconnect else None,
                   "window": [rec.t0, rec.t1]}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
