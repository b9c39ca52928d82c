"""Gang scheduling inside a room.

A job needs ``world_size`` slots (a GPU, or one CPU slot of a GPU client without GPUs) that
can run it (placement.py says which: Python version, packages, memory, CPU slots of one host
sharing its RAM). Jobs start in FIFO order per room; one that does not fit waits and says why
(``waiting_reason``). Reservation is one atomic store call, so two schedulers racing never
give a slot two jobs.

After reserving, the rank-0 GPU client is asked for a rendezvous port on an address the
others can reach; then every client gets its ranks.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict

from .. import defaults
from ..protocol import EV_JOB_ASSIGN, EV_RESERVE_PORT, GPU_NAMESPACE, ClientStatus, JobStatus
from . import lifecycle, notify
from .extensions import socketio
from .auth import hash_secret, new_secret
from .placement import plan

log = logging.getLogger(__name__)


#: Seconds between two looks for GPU clients past their deadline and for jobs to settle (and
#: the longest a pass waits for a kick).
REAP_INTERVAL = 1.0


class Scheduler:
    """Runs in one background thread (a greenlet under gevent) of the server; ``kick()`` asks
    it to look again: settle suspect jobs and place queued ones."""

    def __init__(self, ctx):
        self.ctx = ctx
        self._wake = threading.Event()
        self._settle = False
        self._thread: threading.Thread | None = None

    def kick(self, settle: bool = False) -> None:
        """Look again soon: place queued jobs, and with ``settle`` first settle the jobs whose
        ranks failed or lost their peers (which happens on the clock anyway)."""
        if settle:
            self._settle = True
        self._wake.set()

    def start(self, app) -> None:
        if self.ctx.config.get("SCHEDULER", True) is False:
            return
        self.grace_after_restart()
        self._thread = threading.Thread(target=self._loop, args=(app,), name="zwdx-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End the loop (the server's ``stopping`` is set) and wait for its pass to finish."""
        self.ctx.stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self, app) -> None:
        next_round = 0.0
        with app.app_context():
            while not self.ctx.stopping.is_set():
                self._wake.wait(timeout=REAP_INTERVAL)
                self._wake.clear()
                try:
                    settle, self._settle = self._settle, False
                    if time.time() >= next_round:  # on the clock, not on every kick
                        next_round = time.time() + REAP_INTERVAL
                        self.reap_silent_clients()
                        settle = True
                    if settle:
                        lifecycle.settle_suspects(self.ctx)
                    self.schedule_once()
                except Exception:  # keep scheduling whatever one pass hit
                    log.exception("scheduler: pass failed")

    # -- lost clients ----------------------------------------------------------------------
    def reap_silent_clients(self) -> None:
        """Declare lost the GPU clients past their ``lost_after`` (set on each heartbeat, on a
        dropped connection and when this server starts; none once declared lost)."""
        now = time.time()
        for client in self.ctx.store.list_clients(None, lost_before=now):
            holds_ranks = any(s.get("job_id") for s in client["slots"])
            if client.get("status") == ClientStatus.ONLINE.value or holds_ranks:
                why = ("connection dropped and not back" if client.get("disconnected_at") else "no heartbeat")
                lifecycle.client_lost(self.ctx, client["id"], f"{why} for {now - client.get('last_seen', now):.1f} s")

    def grace_after_restart(self) -> None:
        """A (re)started server gives every GPU client that was online or running ranks
        ``CLIENT_TIMEOUT`` to reconnect before declaring it lost."""
        until = time.time() + float(self.ctx.config["CLIENT_TIMEOUT"])
        for client in self.ctx.store.list_clients(None):
            if client.get("status") == ClientStatus.ONLINE.value or any(s.get("job_id") for s in client["slots"]):
                self.ctx.store.update_client(client["id"], {"status": ClientStatus.OFFLINE.value, "sid": None,
                                                            "lost_after": until})

    # -- placing jobs ----------------------------------------------------------------------
    def schedule_once(self) -> int:
        """One pass over every room's queue. Returns how many jobs were started."""
        store, started = self.ctx.store, 0
        queued = store.list_jobs(statuses=[JobStatus.QUEUED.value, JobStatus.RESUMING.value])
        rooms = defaultdict(list)
        for job in queued:
            rooms[job["room_id"]].append(job)
        for room_id, jobs in rooms.items():
            for job in jobs:  # FIFO: the head of the queue goes first, the rest wait behind it
                placed = self._try_start(job)
                if not placed:
                    break
                started += 1
        return started

    def _held_memory(self, job: dict, slots: list[dict]) -> dict:
        """Bytes per rank of the jobs on the room's CPU slots (job id -> memory_required), which
        count against their hosts' RAM; asked only for a job that needs memory."""
        if not int(job["spec"].get("memory_required") or 0):
            return {}
        held = {}
        for job_id in {s["job_id"] for s in slots if s.get("job_id") and s.get("kind") == "cpu"}:
            other = self.ctx.store.get_job(job_id)
            held[job_id] = int(((other or {}).get("spec") or {}).get("memory_required") or 0)
        return held

    def _try_start(self, job: dict) -> bool:
        store = self.ctx.store
        clients = {c["id"]: c for c in store.list_clients(job["room_id"])}  # each with its slots
        slots = sorted((s for c in clients.values() for s in c["slots"]), key=lambda s: (s["client_id"], s["index"]))
        if any(s.get("job_id") == job["id"] for s in slots):
            return False  # ranks of its last attempt are still stopping
        chosen, reason = plan(job, slots, clients, self._held_memory(job, slots))
        if chosen is None:
            if job["status"] == JobStatus.RESUMING.value:
                reason = f"resuming after: {job.get('restart_history', [{}])[-1].get('reason')}; {reason}"
            if job.get("waiting_reason") != reason:
                updated = store.update_job(job["id"], {"waiting_reason": reason},
                                           expect_status=[job["status"]])
                if updated:
                    notify.job_changed(updated)
            return False
        placement = []
        for rank, slot in enumerate(chosen):
            client = clients[slot["client_id"]]
            placement.append({"rank": rank, "client_id": slot["client_id"], "hostname": client.get("hostname"),
                              "gpu_index": slot["index"], "gpu_name": slot.get("name"), "kind": slot.get("kind")})
        job_key = new_secret("jk")
        now = time.time()
        attempt = int(job.get("restarts") or 0)
        changes = {"status": JobStatus.STARTING.value, "placement": placement, "world_size": len(chosen),
                   "attempt": attempt, "suspect_since": None, "failing_since": None, "failures": {},
                   "backend": "nccl" if chosen[0].get("kind") == "cuda" else "gloo",
                   "job_key_hash": hash_secret(job_key), "waiting_reason": None, "started_at": now,
                   "ranks": {}, "exits": {}}
        if not store.reserve_slots(job["id"], [(s["id"], r) for r, s in enumerate(chosen)], changes):
            return False  # another scheduler got there first; look again next pass
        job = store.update_job(job["id"], {}, push={"timeline": {"status": JobStatus.STARTING.value, "at": now,
                                                                  "attempt": attempt, "world_size": len(chosen)}})
        log.info("job %s: placed on %d slot(s): %s", job["id"], len(chosen),
                 ", ".join(f"rank {p['rank']}@{p['hostname']}:{p['gpu_index']}" for p in placement))
        master = clients[placement[0]["client_id"]]
        try:
            answer = socketio.call(EV_RESERVE_PORT, {"job_id": job["id"]}, to=master["sid"],
                                   namespace=GPU_NAMESPACE, timeout=defaults.RESERVE_TIMEOUT)
            addr, port = answer["addr"], int(answer["port"])
        except Exception as exc:
            lifecycle.fail(self.ctx, job["id"], f"rank-0 gpu client {master['id']} did not offer a "
                           f"rendezvous address: {exc!r}")
            store.release_slots(job["id"])
            return True
        job = store.update_job(job["id"], {"master": {"addr": addr, "port": port}})
        notify.job_changed(job)
        notify.clients_changed(self.ctx, job["room_id"])
        spec = job["spec"]
        for client_id in dict.fromkeys(p["client_id"] for p in placement):
            ranks = [{"rank": p["rank"], "gpu_index": p["gpu_index"], "kind": p["kind"]}
                     for p in placement if p["client_id"] == client_id]
            socketio.emit(EV_JOB_ASSIGN, {
                "job_id": job["id"], "job_key": job_key, "ranks": ranks, "world_size": job["world_size"],
                "master_addr": addr, "master_port": port, "backend": job["backend"],
                "bundle_artifact": spec["bundle_artifact"], "bundle_sha256": spec["bundle_sha256"],
                "parallelism": spec["parallelism"], "epochs": spec["epochs"], "attempt": attempt,
                "checkpoint": job.get("latest_checkpoint"), "keep_checkpoints": spec.get("keep_checkpoints"),
                "checkpoint_every_epoch": spec.get("checkpoint_every_epoch", True),
                "collective_timeout": spec.get("collective_timeout") or self.ctx.config["COLLECTIVE_TIMEOUT"],
            }, to=clients[client_id]["sid"], namespace=GPU_NAMESPACE)
        return True
