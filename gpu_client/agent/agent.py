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
import traceback

import requests
import socketio

from zwdx import __version__, defaults, tls
from zwdx.errors import BadRequest
from zwdx.protocol import (EV_HEARTBEAT, EV_JOB_ASSIGN, EV_JOB_CANCEL, EV_RANKS_EXITED, EV_REFRESH, EV_REGISTER,
                           EV_RESERVE_PORT, EV_UNREACHABLE, GPU_NAMESPACE, RankStatus, SlotKind, runtime_versions)
from zwdx.protocol.base import PROTOCOL, incompatible, parse
from zwdx.protocol.gpu import (Ack, Heartbeat, HeartbeatAnswer, JobAssign, JobCancel, Link, PortOffer, RankPlace, RanksExited,
                               Refresh, Register, RegisterAnswer, ReservePort, Running, Unreachable)
from zwdx.protocol.rank import RankSpec
from zwdx.protocol.vocab import Isolation

from gpu_client import gpus
from . import health, host, link, reach, refusal
from gpu_client.sandbox import folder as sandbox
from gpu_client.rank import script
from .reach import interface_of, listener, reaching_address
from .identity import Identity
from gpu_client.sandbox.isolation import IsolationError
from gpu_client.sandbox.kinds import build as build_isolation
from gpu_client.sandbox.compile_cache import RoomCaches
from .launcher import Launcher, RunningJob
from .datasets import DatasetCache, share as share_datasets
from .workspace import Workspace, default_root
from gpu_client.outage import http_session

#: Seconds a rendezvous port offered for a job stays held while no assignment comes (the server
#: placed the job elsewhere): then it is closed.
LISTENER_KEPT = 15 * 60

log = logging.getLogger("gpu_client.agent.agent")

#: The exit code recorded for a rank whose process could not be started.
NOT_STARTED = 97

#: The CA file's name in a job's sandbox.
CA_FILE = "ca.pem"

#: ``RegisterAnswer.code`` of a register refused for its client secret.
WRONG_SECRET = "client_secret"


class Agent:
    """``room_token``: the room's donor token (a legacy room token works too). ``isolation``:
    ``user``, ``process`` or None (``user`` as root, else ``process``); ``rank_uids`` and
    ``rank_dir`` tune it (``kinds.build``)."""

    def __init__(self, server: str, room_token: str, gpus_only: list[int] | None = None, cpu: bool = False,
                 advertise_addr: str | None = None, client_id: str | None = None, threads: int | None = None,
                 work_dir: str | None = None, max_jobs: int | None = None, standby: bool = True,
                 isolation: str | None = None, rank_uids: range | None = None, rank_dir: str | None = None,
                 ca_file: str | None = None, dataset_cache_bytes: int | None = None, confinement=None,
                 cpu_slots: int = 1, fetch_policy=None, compile_cache: str | None = None,
                 modules_refresh: float | None = None,
                 outage_tolerance: float = defaults.OUTAGE_TOLERANCE):
        self.server = server.rstrip("/")
        self.outage_tolerance = outage_tolerance  # how long its ranks wait for a server that is away
        self.token = room_token
        self.ca_file = tls.ca_file(ca_file)  # a private CA that signed the server's certificate
        self.verify = self.ca_file or True
        self.work_dir = os.path.abspath(work_dir or default_root())
        # first: an isolation that cannot hold refuses to start (IsolationError) before anything is written
        found = gpus.discover(gpus_only, cpu, cpu_slots)
        docker = {"confinement": confinement, "server": self.server, "slots": len(found)}
        self.isolation = build_isolation(isolation, self.work_dir, rank_dir, rank_uids, **docker)
        self.isolation.check()
        # no --client-id: the id an agent of this work dir had before (one no running agent holds)
        self.workspace = Workspace(self.work_dir, client_id)
        self.identity = Identity(self.work_dir, self.workspace.client_id)  # its id, and the secret that proves it
        self.datasets = DatasetCache(self.workspace.datasets, dataset_cache_bytes or defaults.DATASET_CACHE_BYTES,
                                     fetch_policy)  # fetch.py: what a job's URL may reach
        self.hostname = socket.gethostname()
        terms = self.isolation.terms()
        self.slots = [s.model_copy(update={"isolation": self.isolation.kind, "terms": terms}) for s in found]
        self.host_id = host.host_id()                # GPU clients of one machine share its RAM
        self.modules = host.importable_modules()     # the scheduler keeps jobs needing others away
        self.modules_refresh = defaults.MODULES_REFRESH if modules_refresh is None else modules_refresh
        self._modules_read = 0.0                      # when a refresh last looked (the rate's clock)
        self._modules_lock = threading.Lock()
        self.advertise_addr = advertise_addr
        self.threads = threads
        self.max_jobs = max_jobs  # burst mode: stop after this many jobs (tests, rq's burst)
        self.jobs: dict[str, RunningJob] = {}
        #: job id -> (the socket listening on the rendezvous port offered for it, when): held until
        #: its rank 0 takes it over, so no other process can take the port meanwhile
        self.listeners: dict[str, tuple[socket.socket, float]] = {}
        self._listeners_lock = threading.Lock()
        rooms_compiled = RoomCaches(compile_cache) if compile_cache else None  # compile_cache.py
        if rooms_compiled is not None:
            rooms_compiled.check(other_users=self.isolation.kind == Isolation.USER)
        self.launcher = Launcher(self.workspace.dir, self.isolation, standby, rooms_compiled)
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

    def _register(self, again: bool = True):
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

    def _on_reserve_port(self, data):
        try:
            ask = parse(ReservePort, data, EV_RESERVE_PORT)
        except BadRequest as err:  # answered, so the server need not wait for its timeout
            log.error("gpu-client %s: %s", self.client_id, err)
            return Ack(ok=False, error=err.message).model_dump()
        sock = listener(self.advertise_addr if self.advertise_addr != "0.0.0.0" else "")
        port = sock.getsockname()[1]
        now = time.time()
        with self._listeners_lock:
            stale = [self.listeners.pop(job_id)[0] for job_id, (_, at) in list(self.listeners.items())
                     if job_id == ask.job_id or now - at > LISTENER_KEPT]  # placed elsewhere, or an attempt before
            self.listeners[ask.job_id] = (sock, now)
        for old in stale:
            old.close()
        log.info("gpu-client %s: job %s rendezvous at %s:%d", self.client_id, ask.job_id, self.advertise_addr, port)
        return PortOffer(addr=self.advertise_addr, port=port).model_dump()

    def _held_listener(self, assign: JobAssign) -> socket.socket | None:
        """The socket listening on the job's rendezvous port, if this client offered that port."""
        with self._listeners_lock:
            held = self.listeners.pop(assign.job_id, (None, 0))[0]
        if held is not None and held.getsockname()[1] != assign.master_port:
            held.close()  # offered for another attempt's placement
            return None
        return held

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

    # -- running ranks ---------------------------------------------------------------------
    def _threads(self, ranks: int) -> int:
        return self.threads or max(1, (os.cpu_count() or 1) // max(1, ranks))

    def _device(self, index: int, kind: SlotKind) -> str:
        return f"cuda:{index}" if kind == SlotKind.CUDA else "cpu"

    def _want_standby(self, index: int) -> None:
        slot = next((s for s in self.slots if s.index == index), None)
        if slot is not None and not self.stop.is_set():
            self.launcher.want_standby(index, self._device(index, slot.kind), self._threads(len(self.slots)))

    def _rank_spec(self, assign: JobAssign, place: RankPlace, local_rank: int, job: RunningJob, pending: bool,
                   assigned_at: float, worker_port: int | None = None, streamed: bool = False) -> RankSpec:
        logs = self.workspace.job_dir(assign.job_id)
        return RankSpec(
            job_id=assign.job_id, attempt=assign.attempt, rank=place.rank, local_rank=local_rank,
            world_size=assign.world_size, master_addr=assign.master_addr, master_port=assign.master_port,
            job=assign.spec, peers=reach.egress_peers(assign), backend=assign.backend,
            device=self._device(place.gpu_index, place.kind), collective_timeout=assign.collective_timeout,
            checkpoint=assign.checkpoint, threads=self._threads(len(assign.ranks)), joining=assign.joining,
            worker_port=worker_port, tp_size=assign.tp_size,
            bundle_path=self.isolation.bundle_path(job.sandbox), bundle_sha256=assign.spec.code.bundle_sha256,
            bundle_pending=pending, bundle_size=assign.spec.code.bundle_size if streamed else None,
            data_dir=os.path.join(job.sandbox.dir, "data") if assign.spec.datasets else None,
            assigned_at=assigned_at, server=self.server, client_id=self.client_id,
            hostname=self.hostname, rank_key=place.key, log_path=os.path.join(logs, f"rank{place.rank}.log"),
            outage_tolerance=self.outage_tolerance,
            sandbox=job.sandbox, ca_file=os.path.join(job.sandbox.dir, CA_FILE) if self.ca_file else None,
            **script.rank_fields(assign, place, local_rank, sandbox.home(job.sandbox)))

    def _fetch_bundle(self, assign: JobAssign, shared=None) -> None:
        """Into the cache (``workspace.py``), checked against the job's sha256; ``shared``: see
        ``Workspace.keep_bundle`` (the ranks read it as it arrives)."""
        session = self._session(assign.ranks[0].key)  # any of its ranks' keys opens the job's bundle
        url = f"{self.server}{defaults.API_PREFIX}/jobs/{assign.job_id}/bundle"
        with session.get(url, stream=True, timeout=60) as resp:
            resp.raise_for_status()
            self.workspace.keep_bundle(assign.spec.code.bundle_sha256, resp.iter_content(defaults.CHUNK_BYTES),
                                       f"bundle of job {assign.job_id}", shared)

    def _provide_datasets(self, job: RunningJob, assign: JobAssign) -> None:
        """The job's datasets from the cache (``datasets.py``), into its sandbox's ``data``."""
        session = self._session(assign.ranks[0].key)  # any of its ranks' keys opens the job's datasets
        try:
            provided = self.datasets.lend(assign.spec.datasets, lambda p: share_datasets(self.isolation, job.sandbox, p),
                                          session, f"{self.server}{defaults.API_PREFIX}/jobs/{assign.job_id}")
        finally:
            session.close()
        log.info("gpu-client %s: job %s datasets ready: %s", self.client_id, job.job_id,
                 ", ".join(f"{p.name} ({'fetched' if p.fetched else 'cached'}, {p.size} bytes)" for p in provided))

    def _run_job(self, job: RunningJob, assign: JobAssign, assigned_at: float) -> None:
        """Start the job's ranks at once, so that they join their process group while the
        bundle is checked in the cache (its sha256, on every use) or fetched; tell them when it
        is there."""
        exits: dict[str, int] = {}
        held = self._held_listener(assign)
        if self._peers_unreachable(assign):
            if held is not None:
                held.close()
            self._after_job(job, assign, {str(r.rank): NOT_STARTED for r in assign.ranks})
            return
        worker = None
        try:
            bundle, pending = self.workspace.bundle_path(assign.spec.code.bundle_sha256), True
            # Not in the cache: the ranks read the bundle as it arrives, from the file being written.
            streamed = bool(assign.spec.code.bundle_size and self.isolation.streams_bundle and not assign.spec.script
                            and not os.path.exists(bundle))
            self.launcher.lease(job, self.client_id)
            if self.ca_file:  # where the ranks can read it
                self.isolation.share(self.ca_file, job.sandbox, CA_FILE, link=False)
            # DILOCO, several ranks per worker: this client's ranks are one worker, meeting on loopback
            worker = listener("127.0.0.1") if assign.spec.diloco and assign.spec.diloco.ranks_per_worker > 1 else None
            worker_port = worker.getsockname()[1] if worker is not None else None
            for local_rank, place in enumerate(assign.ranks):
                # the stores this rank serves: the job's (rank 0), its worker's (the worker's first rank here)
                hand = [s for s, serves in ((held, place.rank == 0), (worker, local_rank == 0)) if s is not None and serves]
                if hand and not self.isolation.hands_sockets:  # a container binds its ports itself
                    for sock in hand:
                        sock.close()
                    hand = []
                spec = self._rank_spec(assign, place, local_rank, job, pending, assigned_at, worker_port, streamed)
                spec.listeners = len(hand)
                job.procs[place.rank] = self.launcher.start(place.gpu_index, spec, self.client_id, tuple(hand))
                log.info("gpu-client %s: job %s rank %d started (pid %d)", self.client_id, job.job_id, place.rank,
                         job.procs[place.rank].pid)
            for sock in (held, worker):  # a listener no rank here serves (none should be left)
                if sock is not None and sock.fileno() != -1:
                    sock.close()
            if streamed:
                self._fetch_bundle(assign, lambda part: self.isolation.share(part, job.sandbox))
                if not os.path.samefile(self.isolation.bundle_path(job.sandbox), bundle):
                    self.isolation.share(bundle, job.sandbox)  # it was copied, not linked: again, whole
            else:
                if not self.workspace.cached(assign.spec.code.bundle_sha256):  # its sha256 checked on every use
                    self._fetch_bundle(assign)
                self.isolation.share(bundle, job.sandbox)  # the rank checks the sha256 again as it loads
            # the job's code may run already (a streamed bundle loads as it arrives): what the agent
            # writes into the sandbox goes where the job cannot write, following no link (sandbox.py)
            if assign.spec.datasets:  # in the cache (verified now) or fetched, then in the sandbox, before "ready"
                self._provide_datasets(job, assign)
            self.launcher.ready(job, pending)
            for rank, proc in job.procs.items():
                exits[str(rank)] = proc.wait()
        except Exception as exc:
            for sock in (held, worker):  # not handed to a rank (the launcher closes those it hands)
                if sock is not None and sock.fileno() != -1:
                    sock.close()
            log.exception("gpu-client %s: job %s could not start", self.client_id, job.job_id)
            self._report_start_failure(assign.job_id, {r.rank: r.key for r in assign.ranks}, exc)
            self.launcher.kill(job)
            for r in assign.ranks:
                exits.setdefault(str(r.rank), job.procs[r.rank].wait() if r.rank in job.procs else NOT_STARTED)
        self._after_job(job, assign, exits)

    def _after_job(self, job: RunningJob, assign: JobAssign, exits: dict[str, int]) -> None:
        log.info("gpu-client %s: job %s (attempt %d) ranks exited: %s", self.client_id, job.job_id, job.attempt,
                 exits)
        self.launcher.release(job)
        self._send_exits(job, exits)
        self.jobs.pop(job.key, None)
        for r in assign.ranks:
            self._want_standby(r.gpu_index)
        self.finished += 1
        if self.max_jobs is not None and self.finished >= self.max_jobs:
            self.stop.set()

    def _peers_unreachable(self, assign: JobAssign) -> bool:
        """Connect to the job's other GPU clients (``reach.py``); tell the server of those that
        did not answer, and say whether there were any (then the ranks are not started)."""
        if not assign.peers:
            return False
        missed = reach.unreachable(assign.peers, self.client_id)
        if not missed:
            return False
        log.error("gpu-client %s: job %s: cannot reach %s", self.client_id, assign.job_id,
                  "; ".join(f"{peer} ({why})" for peer, why in missed.items()))
        report = Unreachable(job_id=assign.job_id, attempt=assign.attempt, peers=missed)
        try:
            answer = _answer(Ack, self.sio.call(EV_UNREACHABLE, report.model_dump(), namespace=GPU_NAMESPACE,
                                                timeout=15))
            if not answer.ok:
                log.warning("gpu-client %s: unreachable peers not taken: %s", self.client_id, answer.error)
        except Exception as exc:  # its ranks' exits still fail the job
            log.warning("gpu-client %s: unreachable peers not reported: %s", self.client_id, exc)
        return True

    def _refuse_assign(self, data, err: BadRequest) -> None:
        """A ``job_assign`` this client cannot read (a server of another version?): fail its ranks
        with the reason, if the payload says which, so the job does not wait for them forever."""
        log.error("gpu-client %s: %s", self.client_id, err)
        try:
            keys = {int(r["rank"]): str(r["key"]) for r in data["ranks"]}
            job = RunningJob(str(data["job_id"]), int(data.get("attempt") or 0))
            self._report_start_failure(job.job_id, keys, err)
        except Exception:
            return
        threading.Thread(target=self._send_exits, args=(job, {str(r): NOT_STARTED for r in keys}),
                         daemon=True).start()

    def _report_start_failure(self, job_id: str, keys: dict[int, str], exc: BaseException) -> None:
        """Each rank's failure, reported with that rank's key."""
        for rank, key in keys.items():
            session = self._session(key)
            try:
                session.post(f"{self.server}{defaults.API_PREFIX}/jobs/{job_id}/ranks/{rank}",
                             json={"status": RankStatus.FAILED.value, "error": f"{type(exc).__name__}: {exc}",
                                   "traceback": "".join(traceback.format_exception(exc))}, timeout=30)
            except requests.RequestException:
                pass
            finally:
                session.close()

    def _send_exits(self, job: RunningJob, exits: dict) -> None:
        message = RanksExited(job_id=job.job_id, attempt=job.attempt, exits=exits).model_dump()
        while not self.stop.is_set() or self.sio.connected:
            try:
                if self.sio.connected and self._registered.wait(5):
                    self.sio.call(EV_RANKS_EXITED, message, namespace=GPU_NAMESPACE, timeout=15)
                    return
            except Exception as exc:
                log.warning("gpu-client %s: cannot report exits of job %s yet: %s", self.client_id, job.job_id, exc)
            time.sleep(1)

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


def _answer(model, data):
    """The server's answer as ``model``; one that is not (no answer, another shape) as a refusal."""
    try:
        return parse(model, data)
    except BadRequest as err:
        return model(ok=False, error=f"the server's answer could not be read: {err}")


def serve(**kwargs) -> int:
    try:
        agent = Agent(**kwargs)
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
