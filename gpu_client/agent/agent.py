"""The GPU client: joins a room, offers its slots, runs the ranks it is given.

It connects to the server's /gpu Socket.IO namespace with its room's donor token, registers
its slots (with the client secret its first register was given, kept 0600 in the work dir:
``secrets/<client id>.secret``), sends heartbeats, reconnects by itself (with backoff) when the server goes away and
re-registers with the jobs it still runs. What it says and hears are the types of
``zwdx.protocol.gpu``: it builds ``Register``, ``Heartbeat`` and ``RanksExited``, and reads
``JobAssign``, ``JobCancel`` and ``ReservePort`` through them. Each rank of a job it is
assigned gets one ``RankSpec`` with that rank's key (and no other secret of the agent) and
runs in its own process (``launcher.py``), in the job's sandbox: in a container of its own where
Docker can, else as a user of its own per job when the agent is root (``isolation.py``; each
slot registers which isolation it has, and a container's image and limits).

Started without ``--client-id``, it is the GPU client an earlier start on its work dir was
(``workspace.py``). What its ranks can import is read again when the server says a waiting job
needs a module it lacks (``refresh``, at most every ``--modules-refresh`` seconds), on SIGHUP
and on ``zwdx gpu-client --refresh``; a changed list is registered again.

As it registers it says how its peers reach it (``advertise_addr``, and the port of its
reachability listener, ``reach.py``) and its link to the server (``link.py``, measured at most
every ``LINK_REFRESH`` seconds). Before the ranks of a DDP/FSDP job start, it connects to the
job's other GPU clients; one it cannot reach is reported (``Unreachable``) and its ranks are not
started: the server fails the job at once, naming the pair.
"""
from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import threading
import time

import requests
import socketio

from zwdx import __version__, defaults, tls
from zwdx.errors import BadRequest
from zwdx.protocol import (EV_HEARTBEAT, EV_JOB_ASSIGN, EV_JOB_CANCEL, EV_REFRESH, EV_REGISTER,
                           EV_RESERVE_PORT, GPU_NAMESPACE, runtime_versions)
from zwdx.protocol.base import PROTOCOL, incompatible, parse
from zwdx.protocol.gpu import (Heartbeat, HeartbeatAnswer, JobAssign, JobCancel, Link, Refresh, Register, RegisterAnswer, Running)
from zwdx.protocol.vocab import Isolation

from gpu_client import gpus
from . import health, host, link, reach, refusal
from .reach import interface_of, reaching_address
from .config import AgentConfig
from .identity import Identity
from .jobs import JobRunning, _answer
from gpu_client.sandbox.isolation import IsolationError
from gpu_client.sandbox.kinds import build as build_isolation
from gpu_client.sandbox.compile_cache import RoomCaches
from .launcher import Launcher, RunningJob
from .datasets import DatasetCache
from .workspace import Workspace, default_root
from gpu_client.outage import http_session

log = logging.getLogger("gpu_client.agent.agent")

#: ``RegisterAnswer.code`` of a register refused for its client secret.
WRONG_SECRET = "client_secret"


class Agent(JobRunning):
    """A GPU client, as its ``AgentConfig`` says (``config.py``: what ``zwdx gpu-client`` was
    told); its isolation is ``kinds.build``'s."""

    def __init__(self, config: AgentConfig):
        self.config = config
        self.server = config.server.rstrip("/")
        self.outage_tolerance = config.outage_tolerance  # how long its ranks wait for a server that is away
        self.token = config.room_token
        self.ca_file = tls.ca_file(config.ca_file)  # a private CA that signed the server's certificate
        self.verify = self.ca_file or True
        self.work_dir = os.path.abspath(config.work_dir or default_root())
        # first: an isolation that cannot hold refuses to start (IsolationError) before anything is written
        found = gpus.discover(config.gpus_only, config.cpu, config.cpu_slots)
        docker = {"confinement": config.confinement, "server": self.server, "slots": len(found)}
        self.isolation = build_isolation(config.isolation, self.work_dir, config.rank_dir, config.rank_uids, **docker)
        self.isolation.check()
        # no --client-id: the id an agent of this work dir had before (one no running agent holds)
        self.workspace = Workspace(self.work_dir, config.client_id)
        self.identity = Identity(self.work_dir, self.workspace.client_id)  # its id, and the secret that proves it
        self.datasets = DatasetCache(self.workspace.datasets, config.dataset_cache_bytes or defaults.DATASET_CACHE_BYTES,
                                     config.fetch_policy)  # fetch.py: what a job's URL may reach
        self.hostname = socket.gethostname()
        terms = self.isolation.terms()
        self.slots = [s.model_copy(update={"isolation": self.isolation.kind, "terms": terms}) for s in found]
        self.host_id = host.host_id()                # GPU clients of one machine share its RAM
        self.modules = host.importable_modules()     # the scheduler keeps jobs needing others away
        self.modules_refresh = defaults.MODULES_REFRESH if config.modules_refresh is None else config.modules_refresh
        self._modules_read = 0.0                      # when a refresh last looked (the rate's clock)
        self._modules_lock = threading.Lock()
        self.advertise_addr = config.advertise_addr
        self.threads = config.threads
        self.max_jobs = config.max_jobs  # burst mode: stop after this many jobs (tests, rq's burst)
        self.jobs: dict[str, RunningJob] = {}
        #: job id -> (the socket listening on the rendezvous port offered for it, when): held until
        #: its rank 0 takes it over, so no other process can take the port meanwhile
        self.listeners: dict[str, tuple[socket.socket, float]] = {}
        self._listeners_lock = threading.Lock()
        rooms_compiled = RoomCaches(config.compile_cache) if config.compile_cache else None  # compile_cache.py
        if rooms_compiled is not None:
            rooms_compiled.check(other_users=self.isolation.kind == Isolation.USER)
        self.launcher = Launcher(self.workspace.dir, self.isolation, config.standby, rooms_compiled, config.tuning)
        if rooms_compiled is not None and self.launcher.compile_cache is None:
            log.warning("gpu-client: --compile-cache is not used with isolation %s (a container sees no host folder)",
                        self.isolation.kind.value)
        self.finished = 0
        self.heartbeat_interval = defaults.HEARTBEAT_INTERVAL
        self.stop = threading.Event()
        self.fatal: str | None = None
        self._registered = threading.Event()
        self.link: Link | None = None            # its link to the server, measured at a register
        self.listener: reach.Listener | None = None  # answers its peers' reachability probes
        self.http = self._session()
        # back within a restarted server's grace (CLIENT_TIMEOUT, 8 s), however long it was away
        self.sio = socketio.Client(reconnection=True, reconnection_delay=0.5, reconnection_delay_max=2,
                                   randomization_factor=0.5, http_session=self.http)
        self._bind()

    def _session(self, rank_key: str | None = None) -> requests.Session:
        """A session that verifies the server's certificate (as a rank, with its key)."""
        if rank_key is not None:
            return http_session(rank_key, verify=self.verify, patience=self.outage_tolerance)
        return tls.session(self.verify)

    @property
    def client_id(self) -> str:
        return self.identity.client_id

    # -- Socket.IO -------------------------------------------------------------------------
    def _bind(self) -> None:
        ns = GPU_NAMESPACE
        self.sio.on("connect", self._on_connect, namespace=ns)
        self.sio.on("connect_error", self._on_connect_error, namespace=ns)
        self.sio.on("disconnect", self._on_disconnect, namespace=ns)
        self.sio.on(EV_RESERVE_PORT, self._on_reserve_port, namespace=ns)
        self.sio.on(EV_JOB_ASSIGN, self._on_assign, namespace=ns)
        self.sio.on(EV_JOB_CANCEL, self._on_cancel, namespace=ns)
        self.sio.on(EV_REFRESH, self._on_refresh, namespace=ns)

    def _on_connect(self):
        threading.Thread(target=self._register, daemon=True).start()

    def _reach(self) -> None:
        """Where this client is reached (its address, interface and reachability port) and its
        link to the server, measured again when older than ``LINK_REFRESH``."""
        if self.advertise_addr is None:
            self.advertise_addr = reaching_address(self.server)
        iface = interface_of(self.advertise_addr)
        if iface:  # ranks talk over the interface that reaches the server, not the hostname's
            self.launcher.network = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", iface),
                                     "NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME", iface)}
        if self.listener is None:
            self.listener = reach.Listener(self.advertise_addr, self.client_id)
        if self.link is None or time.time() - self.link.measured_at > defaults.LINK_REFRESH:
            self.link = link.measure(self.http, self.server, self.token) or self.link

    def _register(self, again: bool = True):
        self._reach()
        hello = Register(client_id=self.client_id, hostname=self.hostname, host_id=self.host_id, slots=self.slots,
                         versions=self.isolation.versions(runtime_versions()), modules=self.modules, advertise_addr=self.advertise_addr,
                         reach_port=self.listener.port, link=self.link, running=self._running(),
                         client_secret=self.identity.secret)
        try:
            data = self.sio.call(EV_REGISTER, hello.model_dump(mode="json"), namespace=GPU_NAMESPACE, timeout=15)
        except Exception as exc:
            log.warning("gpu-client %s: register failed: %s", self.client_id, exc)
            return
        answer = _answer(RegisterAnswer, data)
        if not answer.ok and answer.code == WRONG_SECRET and again and not self.jobs:
            old = self.client_id
            self.identity.renew()
            self.workspace.renamed(old, self.client_id)
            return self._register(again=False)
        # a server that let it in without checking (one from before versions: 1.0) may still speak
        # another major: its word is checked here too
        mismatch = answer.ok and incompatible(answer.protocol, "server", "GPU client", answer.zwdx, __version__)
        if not answer.ok or mismatch:
            self.fatal = mismatch or answer.error or "register refused"
            log.error("gpu-client %s: %s", self.client_id, self.fatal)
            self.stop.set()
            return
        self._registered_as(answer)

    def _registered_as(self, answer: RegisterAnswer) -> None:
        """What the server's yes says: the secret it gave, the beat it asks, the room; then standbys."""
        if answer.client_secret:
            self.identity.keep(answer.client_secret)
        self.heartbeat_interval = answer.heartbeat_interval or self.heartbeat_interval
        self.launcher.room_id = answer.room_id
        self._registered.set()
        health.beat(self.work_dir)
        for slot in self.slots:
            self._want_standby(slot.index)
        log.info("gpu-client %s: registered in room %s with %d slot(s): %s%s; server zwdx %s, protocol %s",
                 self.client_id, answer.room_id, len(self.slots), ", ".join(s.name for s in self.slots),
                 _link_line(self.link), answer.zwdx or "0.1.0 or older", answer.protocol or "1.0")

    def _auth(self) -> dict:
        """What it connects with: its donor token, and the protocol and zwdx it speaks (a server of
        another protocol major refuses it, naming both and which side to upgrade)."""
        return {"token": self.token, "protocol": PROTOCOL, "zwdx": __version__}

    def _on_connect_error(self, data=None):
        message = data.get("message") if isinstance(data, dict) else str(data)
        if message and ("token" in message or "zwdx protocol" in message):  # no retry mends these
            self.fatal = message
            self.stop.set()
        log.warning("gpu-client %s: connection refused: %s", self.client_id, message)

    def _on_disconnect(self, reason=None, *_):
        self._registered.clear()
        if reason == self.sio.reason.SERVER_DISCONNECT:  # python-socketio does not reconnect after this one
            log.warning("gpu-client %s: the server closed the connection; connecting again", self.client_id)
            threading.Thread(target=self._connect_again, name="connect-again", daemon=True).start()
            return
        log.warning("gpu-client %s: disconnected from %s; reconnecting", self.client_id, self.server)

    def _connect_again(self) -> None:
        """After the server closed the connection (its token revoked or rotated, or it stops):
        connect as at start, until connected or stopped. A refused token is fatal
        (``_on_connect_error``): the client exits (2) rather than wait for ever."""
        backoff = 0.5
        while not self.stop.wait(backoff) and not self.sio.connected:
            try:
                self.sio.connect(self.server, namespaces=[GPU_NAMESPACE], auth=self._auth(),
                                 transports=["websocket"], wait_timeout=10)
            except (socketio.exceptions.ConnectionError, ValueError) as exc:  # ValueError: not closed yet
                if self.fatal:
                    return
                log.warning("gpu-client %s: cannot connect again (%s); retrying", self.client_id, exc)
                backoff = min(backoff * 2, 10)

    def _running(self) -> list[Running]:
        return [Running(job_id=j.job_id, attempt=j.attempt) for j in list(self.jobs.values())]

    def _on_assign(self, data):
        assigned_at = time.time()
        try:
            assign = parse(JobAssign, data, EV_JOB_ASSIGN)
        except BadRequest as err:
            self._refuse_assign(data, err)
            return
        job = RunningJob(assign.job_id, assign.attempt)
        self.jobs[job.key] = job
        threading.Thread(target=self._run_job, args=(job, assign, assigned_at), name=f"job-{job.job_id}",
                         daemon=True).start()

    def _on_cancel(self, data):
        try:
            cancel = parse(JobCancel, data, EV_JOB_CANCEL)
        except BadRequest as err:
            log.error("gpu-client %s: %s", self.client_id, err)
            return
        for job in list(self.jobs.values()):
            if job.job_id != cancel.job_id or cancel.attempt not in (None, job.attempt):
                continue
            log.info("gpu-client %s: job %s (attempt %d) stopping: %s", self.client_id, job.job_id, job.attempt,
                     cancel.reason)
            threading.Thread(target=self.launcher.kill, args=(job,), daemon=True).start()

    def _on_refresh(self, data):
        """The server has a job waiting for modules this client did not list: look again, at most
        every ``modules_refresh`` seconds."""
        try:
            ask = parse(Refresh, data, EV_REFRESH)
        except BadRequest as err:
            log.error("gpu-client %s: %s", self.client_id, err)
            return
        if time.time() - self._modules_read < self.modules_refresh:
            log.debug("gpu-client %s: asked to look for %s again; looked %.0f s ago", self.client_id,
                      ", ".join(ask.modules), time.time() - self._modules_read)
            return
        threading.Thread(target=self.refresh_modules, args=(ask.reason or "asked by the server",), daemon=True).start()

    def refresh_modules(self, why: str) -> bool:
        """Read again what its ranks can import (``host.importable_modules``, as the isolation
        sees it); if that changed, register again with it. Whether it changed."""
        with self._modules_lock:
            self._modules_read = time.time()
            try:
                self.isolation.look_again()
                found = self.isolation.importable(host.importable_modules())
            except Exception as exc:  # the list it registered stays
                log.warning("gpu-client %s: cannot read its importable modules again (%s): %s", self.client_id, why,
                            exc)
                return False
            before, self.modules = set(self.modules or ()), found
        new = sorted(set(found or ()) - before)
        gone = sorted(before - set(found or ()))
        if found is not None and not new and not gone:
            log.info("gpu-client %s: importable modules read again (%s): nothing new", self.client_id, why)
            return False
        log.info("gpu-client %s: importable modules read again (%s): %d new%s, %d gone%s; registering again",
                 self.client_id, why, len(new), f" ({', '.join(new[:10])})" if new else "", len(gone),
                 f" ({', '.join(gone[:10])})" if gone else "")
        if self._registered.is_set():
            self._register()
        return True

    # -- main loop -------------------------------------------------------------------------
    def _heartbeats(self) -> None:
        while not self.stop.wait(self.heartbeat_interval):
            if not self._registered.is_set():
                continue
            beat = Heartbeat(slots=gpus.stats(self.slots), running=self._running())
            try:
                data = self.sio.call(EV_HEARTBEAT, beat.model_dump(mode="json", exclude_unset=True),
                                     namespace=GPU_NAMESPACE, timeout=10)
            except Exception as exc:
                log.debug("gpu-client %s: heartbeat failed: %s", self.client_id, exc)
                continue
            answer = _answer(HeartbeatAnswer, data)
            if answer.ok:
                health.beat(self.work_dir)  # the container's healthcheck (gpu_client/agent/health.py)
                if answer.heartbeat_interval:  # the server's new pace (it has many clients, or fewer again)
                    self.heartbeat_interval = answer.heartbeat_interval
            else:
                log.warning("gpu-client %s: %s", self.client_id, answer.error)
                self._registered.clear()
                threading.Thread(target=self._register, daemon=True).start()

    def run(self) -> int:
        """Serve until stopped (SIGINT/SIGTERM, burst done, or refused). Returns an exit code."""
        self.modules = self.isolation.importable(self.modules)  # what its ranks can import
        print(f"gpu-client {self.client_id}: {self.isolation.describe()}", flush=True)
        tls.warn_if_plain(self.server, f"gpu-client {self.client_id}")
        backoff = 0.5
        threading.Thread(target=self._heartbeats, daemon=True).start()
        while not self.stop.is_set() and not self.sio.connected:
            if not self._trusted():
                break
            try:
                self.sio.connect(self.server, namespaces=[GPU_NAMESPACE], auth=self._auth(),
                                 transports=["websocket"], wait_timeout=10)
            except socketio.exceptions.ConnectionError:
                if self.fatal:
                    break
                why = refusal.why_refused(self.server, self.verify)
                if why and not why[1]:
                    self.fatal = f"refused by the server: {why[0]}"
                    self.stop.set()
                    break
                if why:
                    exc = f"refused by the server: {why[0]}"
                log.warning("gpu-client %s: cannot reach %s (%s); retrying in %.1f s", self.client_id,
                            self.server, exc, backoff)
                self.stop.wait(backoff)
                backoff = min(backoff * 2, 10)
        while not self.stop.is_set():
            self.launcher.start_wanted(timeout=0.5)
        self.shutdown()
        if self.fatal:
            log.error("gpu-client %s: stopped: %s", self.client_id, self.fatal)
            return 2
        return 0

    def _trusted(self) -> bool:
        """False (and fatal) when the server's TLS certificate fails verification: no retry mends
        that. An unreachable server is tried again by the caller."""
        why = tls.distrusted(self.server, self.verify)
        if why:
            self.fatal = f"cannot connect to {self.server}: {why}"
            self.stop.set()
        return not why

    def shutdown(self) -> None:
        self.stop.set()
        self.launcher.shutdown()
        for job in list(self.jobs.values()):
            self.launcher.kill(job)
        deadline = time.time() + 10
        while self.jobs and time.time() < deadline:  # let job threads report the exits
            time.sleep(0.1)
        try:
            self.sio.disconnect()
        except Exception:
            pass
        if self.listener is not None:
            self.listener.close()
        self.workspace.close()


def _link_line(measured: Link | None) -> str:
    if measured is None:
        return ""
    return (f"; link to the server: down {measured.down * 8 / 1e6:,.0f} Mbit/s, up {measured.up * 8 / 1e6:,.0f} "
            f"Mbit/s, rtt {measured.rtt * 1000:.1f} ms")


def serve(config: AgentConfig) -> int:
    try:
        agent = Agent(config)
    except IsolationError as err:
        log.error("gpu-client: %s", err)
        return 2

    def _stop(signum, _frame):
        log.info("gpu-client %s: signal %d, stopping", agent.client_id, signum)
        agent.stop.set()
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    # `zwdx gpu-client --refresh` (or kill -HUP): read again what its ranks can import
    signal.signal(signal.SIGHUP, lambda *_: threading.Thread(target=agent.refresh_modules, args=("SIGHUP",),
                                                             daemon=True).start())
    code = agent.run()
    gc.freeze()  # else the interpreter's last collection walks torch's whole heap: seconds at every stop
    return code
