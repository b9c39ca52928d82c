"""Gang scheduling inside a room.

A job needs ``world_size`` slots (a GPU, or one CPU slot of a GPU client without GPUs), each
with at least ``memory_required`` bytes free, on GPU clients that run the submitter's Python
minor version (cloudpickled code needs it). Jobs start in FIFO order per room; one that does
not fit waits and says why (``waiting_reason``). Reservation is one atomic store call, so two
schedulers racing never give a slot two jobs.

After reserving, the rank-0 GPU client is asked for a rendezvous port on an address the
others can reach; then every client gets its ranks.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter, defaultdict

from .. import defaults
from ..protocol import (EV_JOB_ASSIGN, EV_RESERVE_PORT, GPU_NAMESPACE, ClientStatus, JobStatus,
                        python_minor)
from . import lifecycle, notify, socketio
from .auth import hash_secret, new_secret

log = logging.getLogger(__name__)


def _eligible(job: dict, slots: list[dict], clients: dict) -> tuple[list[dict], str]:
    """Free slots that can run the job, and why others cannot."""
    spec = job["spec"]
    need_py = python_minor(spec["versions"]["python"])
    mem = int(spec.get("memory_required") or 0)
    ok, too_small, wrong_py, busy = [], 0, set(), 0
    for slot in slots:
        client = clients.get(slot["client_id"])
        if client is None or client.get("status") != ClientStatus.ONLINE.value:
            continue
        have_py = python_minor((client.get("versions") or {}).get("python", "?"))
        if have_py != need_py:
            wrong_py.add(have_py)
            continue
        if mem and int(slot.get("memory_total") or 0) < mem:
            too_small += 1
            continue
        if slot.get("job_id"):
            busy += 1
            continue
        if mem and int(slot.get("memory_free") or 0) < mem:
            busy += 1
            continue
        ok.append(slot)
    why = []
    if wrong_py:
        why.append(f"{len(wrong_py)} version(s) of Python on GPU clients ({', '.join(sorted(wrong_py))}) "
                   f"cannot load a bundle made with Python {need_py}")
    if too_small:
        why.append(f"{too_small} slot(s) have less than {mem} bytes of memory in all")
    if busy:
        why.append(f"{busy} slot(s) busy or short of free memory")
    return ok, "; ".join(why)


def plan(job: dict, slots: list[dict], clients: dict) -> tuple[list[dict] | None, str]:
    """Choose the slots for a job, rank order grouped by GPU client; or None and the reason."""
    eligible, why = _eligible(job, slots, clients)
    by_kind = defaultdict(list)
    for slot in eligible:
        by_kind[slot.get("kind", "cuda")].append(slot)
    want = job["spec"].get("world_size")
    least = job["spec"].get("min_world_size")
    if job.get("status") == JobStatus.RESUMING.value and job.get("world_size"):
        want = job["world_size"]  # go on at the size it ran at, or at least min_world_size
    for kind in ("cuda", "cpu"):
        chosen = by_kind.get(kind) or []
        if not chosen:
            continue
        if want is None:
            return chosen, ""
        if len(chosen) < want and least and len(chosen) >= least:
            want = len(chosen)
        if len(chosen) >= want:
            # Fill whole clients first: fewer hosts, more ranks over local links.
            per_client = Counter(s["client_id"] for s in chosen)
            order = sorted(chosen, key=lambda s: (-per_client[s["client_id"]], s["client_id"], s["index"]))
            picked = order[:want]
            return sorted(picked, key=lambda s: (s["client_id"], s["index"])), ""
    have = max((len(v) for v in by_kind.values()), default=0)
    need = want or 1
    reason = f"waiting for {need} free slot(s) with {job['spec'].get('memory_required') or 0} bytes free; {have} available"
    return None, reason + (f" ({why})" if why else "")


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

    def _try_start(self, job: dict) -> bool:
        store = self.ctx.store
        clients = {c["id"]: c for c in store.list_clients(job["room_id"])}  # each with its slots
        slots = sorted((s for c in clients.values() for s in c["slots"]), key=lambda s: (s["client_id"], s["index"]))
        if any(s.get("job_id") == job["id"] for s in slots):
            return False  # ranks of its last attempt are still stopping
        chosen, reason = plan(job, slots, clients)
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
