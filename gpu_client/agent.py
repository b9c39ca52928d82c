"""The GPU client: joins a room, offers its slots, runs the ranks it is given.

It connects to the server's /gpu Socket.IO namespace with the room token, registers its
slots, sends heartbeats, reconnects by itself (with backoff) when the server goes away and
re-registers with the jobs it still runs. Each rank runs in its own process group, so a job
that crashes never takes the agent down and a cancel can kill everything a rank started.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid
from urllib.parse import urlparse

import psutil
import requests
import socketio

from zwdx import defaults
from zwdx.protocol import (EV_HEARTBEAT, EV_JOB_ASSIGN, EV_JOB_CANCEL, EV_RANKS_EXITED, EV_REGISTER,
                           EV_RESERVE_PORT, GPU_NAMESPACE, runtime_versions)

from . import gpus, host
from .reporter import http_session

log = logging.getLogger("gpu_client.agent")


class FatalError(Exception):
    """The server refused this client for good (bad token...)."""


def reaching_address(server_url: str) -> str:
    """The address of this machine's interface that reaches the server."""
    parsed = urlparse(server_url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # UDP: no packet is sent, the kernel just picks a route
        return probe.getsockname()[0]


def free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


class RunningJob:
    """The ranks of one attempt of one job on this GPU client."""

    def __init__(self, job_id: str, attempt: int):
        self.job_id, self.attempt = job_id, attempt
        self.key = f"{job_id}:{attempt}"
        self.procs: dict[int, subprocess.Popen] = {}
        self.cancelled = threading.Event()


def interface_of(addr: str) -> str | None:
    """The network interface holding ``addr`` (for GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)."""
    try:
        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address == addr for a in addrs):
                return name
    except Exception:
        pass
    return None


class Agent:
    def __init__(self, server: str, room_token: str, gpus_only: list[int] | None = None, cpu: bool = False,
                 advertise_addr: str | None = None, client_id: str | None = None, threads: int | None = None,
                 work_dir: str | None = None, max_jobs: int | None = None, standby: bool = True):
        self.server = server.rstrip("/")
        self.token = room_token
        self.client_id = client_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self.slots = gpus.discover(gpus_only, cpu)
        self.host_id = host.host_id()                # GPU clients of one machine share its RAM
        self.modules = host.importable_modules()     # the scheduler keeps jobs needing others away
        self.advertise_addr = advertise_addr
        self.threads = threads
        self.work_dir = work_dir or os.path.join(os.path.expanduser("~"), ".zwdx", "gpu_client")
        self.max_jobs = max_jobs  # burst mode: stop after this many jobs (tests, rq's burst)
        self.jobs: dict[str, RunningJob] = {}
        self.use_standby = standby
        self.standby: dict[int, subprocess.Popen] = {}  # slot index -> rank process waiting for a job
        self._standby_lock = threading.Lock()
        self._standby_wanted: queue.Queue[int] = queue.Queue()  # slots whose standby the main thread starts
        self.finished = 0
        self.heartbeat_interval = defaults.HEARTBEAT_INTERVAL
        self.stop = threading.Event()
        self.fatal: str | None = None
        self._registered = threading.Event()
        self.sio = socketio.Client(reconnection=True, reconnection_delay=0.5, reconnection_delay_max=5,
                                   randomization_factor=0.5)
        self._bind()

    # -- Socket.IO -------------------------------------------------------------------------
    def _bind(self) -> None:
        ns = GPU_NAMESPACE
        self.sio.on("connect", self._on_connect, namespace=ns)
        self.sio.on("connect_error", self._on_connect_error, namespace=ns)
        self.sio.on("disconnect", self._on_disconnect, namespace=ns)
        self.sio.on(EV_RESERVE_PORT, self._on_reserve_port, namespace=ns)
        self.sio.on(EV_JOB_ASSIGN, self._on_assign, namespace=ns)
        self.sio.on(EV_JOB_CANCEL, self._on_cancel, namespace=ns)

    def _on_connect(self):
        threading.Thread(target=self._register, daemon=True).start()

    def _register(self):
        if self.advertise_addr is None:
            self.advertise_addr = reaching_address(self.server)
        data = {"client_id": self.client_id, "hostname": socket.gethostname(), "host_id": self.host_id,
                "slots": self.slots, "versions": runtime_versions(), "modules": self.modules,
                "advertise_addr": self.advertise_addr, "running": self._running()}
        try:
            answer = self.sio.call(EV_REGISTER, data, namespace=GPU_NAMESPACE, timeout=15)
        except Exception as exc:
            log.warning("gpu-client %s: register failed: %s", self.client_id, exc)
            return
        if not answer or not answer.get("ok"):
            self.fatal = (answer or {}).get("error", "register refused")
            log.error("gpu-client %s: %s", self.client_id, self.fatal)
            self.stop.set()
            return
        self.heartbeat_interval = float(answer.get("heartbeat_interval", self.heartbeat_interval))
        self._registered.set()
        for slot in self.slots:
            self._spawn_standby(slot["index"])
        log.info("gpu-client %s: registered in room %s with %d slot(s): %s", self.client_id, answer["room_id"],
                 len(self.slots), ", ".join(s["name"] for s in self.slots))

    def _on_connect_error(self, data=None):
        message = data.get("message") if isinstance(data, dict) else str(data)
        if message and "token" in message:
            self.fatal = message
            self.stop.set()
        log.warning("gpu-client %s: connection refused: %s", self.client_id, message)

    def _on_disconnect(self, *_):
        self._registered.clear()
        log.warning("gpu-client %s: disconnected from %s; reconnecting", self.client_id, self.server)

    def _on_reserve_port(self, data):
        port = free_port(self.advertise_addr if self.advertise_addr != "0.0.0.0" else "")
        log.info("gpu-client %s: job %s rendezvous at %s:%d", self.client_id, data.get("job_id"),
                 self.advertise_addr, port)
        return {"addr": self.advertise_addr, "port": port}

    def _running(self) -> list[dict]:
        return [{"job_id": j.job_id, "attempt": j.attempt} for j in list(self.jobs.values())]

    def _on_assign(self, data):
        job = RunningJob(data["job_id"], int(data.get("attempt") or 0))
        self.jobs[job.key] = job
        threading.Thread(target=self._run_job, args=(job, data, time.time()), name=f"job-{job.job_id}",
                         daemon=True).start()

    def _on_cancel(self, data):
        for job in list(self.jobs.values()):
            if job.job_id != data.get("job_id") or data.get("attempt") not in (None, job.attempt):
                continue
            log.info("gpu-client %s: job %s (attempt %d) stopping: %s", self.client_id, job.job_id, job.attempt,
                     data.get("reason"))
            job.cancelled.set()
            threading.Thread(target=self._kill, args=(job,), daemon=True).start()

    # -- running ranks ---------------------------------------------------------------------
    def _threads(self, ranks: int) -> int:
        return self.threads or max(1, (os.cpu_count() or 1) // max(1, ranks))

    def _spawn_standby(self, index: int) -> None:
        """Have the next rank process of a slot started ahead of time (see runner.standby), by
        the main thread: a rank dies with the thread that started it (PR_SET_PDEATHSIG is a
        thread's, not a process's), so a standby started by a short-lived thread could be
        killed when that thread ended."""
        if self.use_standby and not self.stop.is_set():
            self._standby_wanted.put(index)

    def _start_standby(self, index: int) -> None:
        if self.stop.is_set():
            return
        with self._standby_lock:
            if index in self.standby and self.standby[index].poll() is None:
                return
            slot = next(s for s in self.slots if s["index"] == index)
            device = f"cuda:{index}" if slot["kind"] == "cuda" else "cpu"
            folder = os.path.join(self.work_dir, "standby")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"slot{index}.log"), "ab") as out:
                threads = str(self._threads(len(self.slots)))
                self.standby[index] = subprocess.Popen(
                    [sys.executable, "-m", "gpu_client.runner", "--standby", device], stdin=subprocess.PIPE,
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                    env={**os.environ, "OMP_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1"})

    def _start_rank(self, index: int, env: dict, log_path: str) -> subprocess.Popen:
        """Hand the rank to the slot's standby process, or start a fresh one. Either reads a
        line on stdin once the bundle is here when ``ZWDX_BUNDLE_PENDING`` is set."""
        with self._standby_lock:
            proc = self.standby.pop(index, None)
        if proc is not None and proc.poll() is None:
            try:
                proc.stdin.write((json.dumps({"env": {k: v for k, v in env.items() if os.environ.get(k) != v},
                                              "log": log_path}) + "\n").encode())
                proc.stdin.flush()
                return proc
            except OSError:
                proc.kill()
        if self.use_standby:
            log.info("gpu-client %s: no standby rank process on slot %d; starting a fresh one", self.client_id, index)
        with open(log_path, "ab") as out:
            return subprocess.Popen([sys.executable, "-m", "gpu_client.runner"], env=env, stdin=subprocess.PIPE,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def _bundle_path(self, data) -> str:
        return os.path.join(self.work_dir, "bundles", f"{data['bundle_sha256']}.zwdx")

    def _fetch_bundle(self, data) -> None:
        path = self._bundle_path(data)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        session = http_session(self.token, data["job_key"])
        url = f"{self.server}{defaults.API_PREFIX}/jobs/{data['job_id']}/bundle"
        digest, tmp = hashlib.sha256(), f"{path}.{os.getpid()}.{threading.get_ident()}.part"
        with session.get(url, stream=True, timeout=60) as resp:
            resp.raise_for_status()
            with open(tmp, "wb") as fh:
                for block in resp.iter_content(defaults.CHUNK_BYTES):
                    digest.update(block)
                    fh.write(block)
        if digest.hexdigest() != data["bundle_sha256"]:
            os.unlink(tmp)
            raise IOError(f"bundle of job {data['job_id']} arrived corrupted (sha256 mismatch)")
        os.replace(tmp, path)

    def _run_job(self, job: RunningJob, data: dict, assigned_at: float) -> None:
        """Start the job's ranks at once, so that they join their process group while the
        bundle downloads; tell them when it is here."""
        exits: dict[str, int] = {}
        try:
            bundle = self._bundle_path(data)
            pending = not os.path.exists(bundle)
            threads = self._threads(len(data["ranks"]))
            iface = interface_of(self.advertise_addr)
            net = {}
            if iface:  # ranks talk over the interface that reaches the server, not the hostname's
                net = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", iface),
                       "NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME", iface)}
            logs = os.path.join(self.work_dir, "jobs", job.job_id)
            os.makedirs(logs, exist_ok=True)
            for local_rank, r in enumerate(data["ranks"]):
                env = {**os.environ, "RANK": str(r["rank"]), "WORLD_SIZE": str(data["world_size"]),
                       "LOCAL_RANK": str(local_rank), "MASTER_ADDR": data["master_addr"],
                       "MASTER_PORT": str(data["master_port"]), "ZWDX_SERVER": self.server,
                       "ZWDX_ROOM_TOKEN": self.token, "ZWDX_JOB_ID": job.job_id, "ZWDX_JOB_KEY": data["job_key"],
                       "ZWDX_CLIENT_ID": self.client_id, "ZWDX_HOSTNAME": socket.gethostname(),
                       "ZWDX_BUNDLE": bundle, "ZWDX_BUNDLE_PENDING": "1" if pending else "0",
                       "ZWDX_ASSIGNED_AT": repr(assigned_at), "ZWDX_BACKEND": data["backend"],
                       "ZWDX_DEVICE": f"cuda:{r['gpu_index']}" if r["kind"] == "cuda" else "cpu",
                       "ZWDX_PARALLELISM": data["parallelism"],
                       "ZWDX_EPOCHS": "" if data.get("epochs") is None else str(data["epochs"]),  # "": its default
                       "ZWDX_COLLECTIVE_TIMEOUT": str(data["collective_timeout"]),
                       "ZWDX_ATTEMPT": str(data.get("attempt", 0)), "ZWDX_NUM_THREADS": str(threads),
                       "ZWDX_CHECKPOINT": json.dumps(data.get("checkpoint")),
                       "ZWDX_CHECKPOINT_EVERY_EPOCH": "1" if data.get("checkpoint_every_epoch", True) else "0",
                       "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", **net}
                job.procs[r["rank"]] = self._start_rank(r["gpu_index"], env,
                                                        os.path.join(logs, f"rank{r['rank']}.log"))
                log.info("gpu-client %s: job %s rank %d started (pid %d)", self.client_id, job.job_id,
                         r["rank"], job.procs[r["rank"]].pid)
            if pending:
                self._fetch_bundle(data)
            for proc in job.procs.values():  # the bundle is here (or was already)
                try:
                    if pending:
                        proc.stdin.write(b"ready\n")
                    proc.stdin.close()
                except OSError:
                    pass  # the rank is gone already; its exit code says so
            for rank, proc in job.procs.items():
                exits[str(rank)] = proc.wait()
        except Exception as exc:
            log.exception("gpu-client %s: job %s could not start", self.client_id, job.job_id)
            self._report_start_failure(data, exc)
            self._kill(job)
            for r in data["ranks"]:
                exits.setdefault(str(r["rank"]), job.procs[r["rank"]].wait() if r["rank"] in job.procs else 97)
        log.info("gpu-client %s: job %s (attempt %d) ranks exited: %s", self.client_id, job.job_id, job.attempt,
                 exits)
        self._send_exits(job, exits)
        self.jobs.pop(job.key, None)
        for r in data["ranks"]:
            self._spawn_standby(r["gpu_index"])
        self.finished += 1
        if self.max_jobs is not None and self.finished >= self.max_jobs:
            self.stop.set()

    def _report_start_failure(self, data, exc) -> None:
        session = http_session(self.token, data["job_key"])
        for r in data["ranks"]:
            try:
                session.post(f"{self.server}{defaults.API_PREFIX}/jobs/{data['job_id']}/ranks/{r['rank']}",
                             json={"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                                   "traceback": traceback.format_exc()}, timeout=30)
            except requests.RequestException:
                pass

    def _send_exits(self, job: RunningJob, exits: dict) -> None:
        while not self.stop.is_set() or self.sio.connected:
            try:
                if self.sio.connected and self._registered.wait(5):
                    self.sio.call(EV_RANKS_EXITED, {"job_id": job.job_id, "attempt": job.attempt, "exits": exits},
                                  namespace=GPU_NAMESPACE, timeout=15)
                    return
            except Exception as exc:
                log.warning("gpu-client %s: cannot report exits of job %s yet: %s", self.client_id, job.job_id, exc)
            time.sleep(1)

    def _kill(self, job: RunningJob, grace: float = 3.0) -> None:
        for proc in list(job.procs.values()):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.time() + grace
        for proc in list(job.procs.values()):
            try:
                proc.wait(timeout=max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    # -- main loop -------------------------------------------------------------------------
    def _heartbeats(self) -> None:
        while not self.stop.wait(self.heartbeat_interval):
            if not self._registered.is_set():
                continue
            try:
                answer = self.sio.call(EV_HEARTBEAT, {"slots": gpus.stats(self.slots), "running": self._running()},
                                       namespace=GPU_NAMESPACE, timeout=10)
                if answer and not answer.get("ok"):
                    log.warning("gpu-client %s: %s", self.client_id, answer.get("error"))
                    self._registered.clear()
                    threading.Thread(target=self._register, daemon=True).start()
            except Exception as exc:
                log.debug("gpu-client %s: heartbeat failed: %s", self.client_id, exc)

    def run(self) -> int:
        """Serve until stopped (SIGINT/SIGTERM, burst done, or refused). Returns an exit code."""
        backoff = 0.5
        threading.Thread(target=self._heartbeats, daemon=True).start()
        while not self.stop.is_set() and not self.sio.connected:
            try:
                self.sio.connect(self.server, namespaces=[GPU_NAMESPACE], auth={"token": self.token},
                                 transports=["websocket"], wait_timeout=10)
            except socketio.exceptions.ConnectionError as exc:
                if self.fatal:
                    break
                log.warning("gpu-client %s: cannot reach %s (%s); retrying in %.1f s", self.client_id,
                            self.server, exc, backoff)
                self.stop.wait(backoff)
                backoff = min(backoff * 2, 10)
        while not self.stop.is_set():
            try:
                self._start_standby(self._standby_wanted.get(timeout=0.5))
            except queue.Empty:
                pass
        self.shutdown()
        if self.fatal:
            log.error("gpu-client %s: stopped: %s", self.client_id, self.fatal)
            return 2
        return 0

    def shutdown(self) -> None:
        self.stop.set()
        with self._standby_lock:
            for proc in self.standby.values():
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            self.standby.clear()
        for job in list(self.jobs.values()):
            self._kill(job)
        deadline = time.time() + 10
        while self.jobs and time.time() < deadline:  # let job threads report the exits
            time.sleep(0.1)
        try:
            self.sio.disconnect()
        except Exception:
            pass


def serve(**kwargs) -> int:
    agent = Agent(**kwargs)

    def _stop(signum, _frame):
        log.info("gpu-client %s: signal %d, stopping", agent.client_id, signum)
        agent.stop.set()
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    return agent.run()
