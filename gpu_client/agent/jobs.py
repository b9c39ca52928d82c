"""How a GPU client runs the ranks of a job it is assigned (``JobRunning``, a part of ``Agent``):
one ``RankSpec`` per rank with that rank's key and no other secret of the agent, the bundle
fetched (or streamed into the sandbox), the job's datasets lent, the job's other GPU clients
reached first (DDP/FSDP: one it cannot reach is reported as ``Unreachable`` and no rank starts),
the ranks started by the launcher and their exits sent to the server."""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import traceback

import requests

from zwdx import defaults
from zwdx.errors import BadRequest
from zwdx.protocol import EV_RANKS_EXITED, EV_RESERVE_PORT, EV_UNREACHABLE, GPU_NAMESPACE, RankStatus, SlotKind
from zwdx.protocol.gpu import Ack, JobAssign, PortOffer, RankPlace, RanksExited, ReservePort, Unreachable
from zwdx.protocol.base import parse
from zwdx.protocol.rank import RankSpec

from gpu_client.rank import script
from gpu_client.sandbox import folder as sandbox

from . import reach
from .datasets import share as share_datasets
from .launcher import RunningJob
from .reach import listener

log = logging.getLogger("gpu_client.agent.agent")

#: Seconds a rendezvous port offered for a job stays held while no assignment comes (the server
#: placed the job elsewhere): then it is closed.
LISTENER_KEPT = 15 * 60

#: The exit code recorded for a rank whose process could not be started.
NOT_STARTED = 97

#: The CA file's name in a job's sandbox.
CA_FILE = "ca.pem"



class JobRunning:
    """The agent's jobs: ``Agent`` holds the state these methods use (its config, isolation,
    workspace, launcher, sessions)."""

    # -- the rendezvous port a job's rank 0 listens on: offered, held until the job comes --------
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

    # -- running ranks -------------------------------------------------------------------
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
            job_id=assign.job_id, attempt=assign.attempt, local_rank=local_rank,
            rank=place.rank if place.shadow_of is None else place.shadow_of,  # a shadow: the worker's identity
            shadow=None if place.shadow_of is None else place.rank,
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
            self._start_ranks(job, assign, (held, worker), pending, assigned_at, streamed)
            _close_open(held, worker)  # a listener no rank here serves (none should be left)
            self._deliver_bundle(job, assign, bundle, streamed)
            # the job's code may run already (a streamed bundle loads as it arrives): what the agent
            # writes into the sandbox goes where the job cannot write, following no link (sandbox.py)
            if assign.spec.datasets:  # in the cache (verified now) or fetched, then in the sandbox, before "ready"
                self._provide_datasets(job, assign)
            self.launcher.ready(job, pending)
            for rank, proc in job.procs.items():
                exits[str(rank)] = proc.wait()
        except Exception as exc:
            _close_open(held, worker)  # not handed to a rank (the launcher closes those it hands)
            log.exception("gpu-client %s: job %s could not start", self.client_id, job.job_id)
            self._report_start_failure(assign.job_id, {r.rank: r.key for r in assign.ranks}, exc)
            self.launcher.kill(job)
            for r in assign.ranks:
                exits.setdefault(str(r.rank), job.procs[r.rank].wait() if r.rank in job.procs else NOT_STARTED)
        self._after_job(job, assign, exits)

    def _start_ranks(self, job: RunningJob, assign: JobAssign, stores: tuple, pending: bool, assigned_at: float,
                     streamed: bool) -> None:
        """One rank process per place, each handed the listening sockets of the stores it serves:
        ``stores`` = (the job's, rank 0's; its worker's, the worker's first rank here)."""
        held, worker = stores
        worker_port = worker.getsockname()[1] if worker is not None else None
        for local_rank, place in enumerate(assign.ranks):
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

    def _deliver_bundle(self, job: RunningJob, assign: JobAssign, bundle: str, streamed: bool) -> None:
        """The bundle into the job's sandbox: streamed as it arrives, else from the cache (fetched
        first if not there; its sha256 checked on every use)."""
        if streamed:
            self._fetch_bundle(assign, lambda part: self.isolation.share(part, job.sandbox))
            if not os.path.samefile(self.isolation.bundle_path(job.sandbox), bundle):
                self.isolation.share(bundle, job.sandbox)  # it was copied, not linked: again, whole
            return
        if not self.workspace.cached(assign.spec.code.bundle_sha256):
            self._fetch_bundle(assign)
        self.isolation.share(bundle, job.sandbox)  # the rank checks the sha256 again as it loads

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


def _answer(model, data):
    """The server's answer as ``model``; one that is not (no answer, another shape) as a refusal."""
    try:
        return parse(model, data)
    except BadRequest as err:
        return model(ok=False, error=f"the server's answer could not be read: {err}")


def _close_open(*socks) -> None:
    """Close each of these sockets that is still open (None: none)."""
    for sock in socks:
        if sock is not None and sock.fileno() != -1:
            sock.close()
