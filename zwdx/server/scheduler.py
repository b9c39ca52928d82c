"""Gang scheduling inside a room.

A job needs ``world_size`` slots (a GPU, or one CPU slot of a GPU client without GPUs) that
can run it (``placement/`` says which: Python version, packages, memory, CPU slots of one host
sharing its RAM). Jobs start in FIFO order per room; one that does not fit waits and says why
(``waiting_reason``), and the jobs behind it wait too, unless the room as it is could never
run it (``placement.unschedulable``: more ranks than its eligible slots, ...): such a job
keeps waiting, saying so, and holds back no one. Reservation is one atomic store call
(``Job.start``), so two schedulers racing never give a slot two jobs.

Rooms are placed one by one, each in isolation: whatever one room's records hold (a value a
bug or an older zwdx stored, a job that does not read as one), the error is logged, the
room's waiting jobs say so, and the other rooms are placed as ever. So are the other steps
of a pass (lost GPU clients, settling failed jobs, finishing placements): a GPU client, a job
or a room that fails one is logged and passed over.

After reserving, the rank-0 GPU client is asked for a rendezvous port on an address the
others can reach (``reserve_port``, answered by a Socket.IO acknowledgement); the scheduler
never waits for it. The answer finishes the placement on the next pass: every client gets
its ranks (``JobAssign``), each with its rank key: a fresh secret per rank of the attempt,
bound to the GPU client it goes to, whose hash the placement stores. No answer within
``RESERVE_TIMEOUT`` frees the job's slots and places it again, not on that GPU client; so does
no rank reporting running within ``START_TIMEOUT`` (``jobs.not_started``, settled on the
clock), not on any GPU client of the placement; the ``START_TRIES``-th such placement fails the
job. A dead or fake GPU client delays nothing but the job it held, and that one only so long.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from ..errors import BadRequest
from ..protocol import (ACTIVE, EV_RESERVE_PORT, GPU_NAMESPACE, WAITING, ClientStatus, JobStatus,
                        Parallelism, SlotKind)
from ..protocol.base import parse
from ..protocol.gpu import PortOffer, ReservePort
from ..protocol.job import Job as JobRecord, Master, PlacementEntry
from ..protocol.spec import Auto
from ..protocol.tokens import RANK_KEY_PREFIX
from . import auto, jobs
from . import clients as clients_of_room
from .extensions import socketio
from .auth import hash_secret, new_secret
from .jobs import Job, wanting
from .placement import mixed, plan, room_slots, shadows, unschedulable

log = logging.getLogger(__name__)


#: Seconds between two looks for GPU clients past their deadline and for jobs to settle (and
#: the longest a pass waits for a kick).
REAP_INTERVAL = 1.0

#: The least seconds from one placement pass's start to the next one's (or three times the
#: pass's own time, if more): kicks that come meanwhile (every submit, rank report and exit
#: kicks) are served together, so that a busy room does not list its GPU clients many times a second.
PASS_INTERVAL = 0.2

#: What became of a job the scheduler tried to start (``Scheduler._try_start``).
_STARTED, _BLOCKED, _PASSED = "started", "blocked", "passed"


def _guarded(what: str, step, *args):
    """``step(*args)``, or None with the error logged: one step of a pass never stops the others."""
    try:
        return step(*args)
    except Exception:
        log.exception("scheduler: %s failed", what)
        return None


def _least(record: JobRecord, spec: dict) -> dict:
    """The spec as ``unschedulable`` should judge it: a resuming job may go on with
    ``min_world_size`` ranks (or the ranks it ran with)."""
    if record.status == JobStatus.RESUMING and record.world_size:
        return _sized(spec, spec["recovery"].get("min_world_size") or record.world_size)
    return spec


def _sized(spec: dict, world_size: int) -> dict:
    """A spec document asking for ``world_size`` ranks (and no fewer)."""
    return {**spec, "resources": {**spec["resources"], "world_size": world_size},
            "recovery": {**spec["recovery"], "min_world_size": None}}


@dataclass
class PortRequest:
    """A placed job waiting for its rank-0 GPU client's rendezvous address."""
    job_id: str
    attempt: int
    #: rank -> the key that rank will hold: only their hashes are stored, so they live here until
    #: assigned.
    rank_keys: dict[int, str]
    client_id: str
    deadline: float
    answered: bool = False
    #: What the client acknowledged with (checked as a ``PortOffer`` by the scheduler).
    answer: object = None
    #: Why it could not be asked.
    error: str | None = None


class Scheduler:
    """Runs in one background thread (a greenlet under gevent) of the server; ``kick()`` asks
    it to look again: settle suspect jobs and place queued ones."""

    def __init__(self, ctx):
        self.ctx = ctx
        self._wake = threading.Event()
        self._settle = False
        self._thread: threading.Thread | None = None
        self._asked: dict[str, PortRequest] = {}  # job id -> the port request of its placement
        self._asked_lock = threading.Lock()
        self._port_answered = threading.Event()  # a rank-0 GPU client answered (or could not be asked)
        self._failing: dict[str, str] = {}  # room id -> the error that keeps its jobs from being placed

    def kick(self, settle: bool = False) -> None:
        """Look again soon: place queued jobs, and with ``settle`` first settle the jobs whose
        ranks failed or lost their peers (which happens on the clock anyway)."""
        if settle:
            self._settle = True
        self._wake.set()

    def start(self, app) -> None:
        if not self.ctx.settings.scheduler:
            return
        if self.ctx.lease.shared:  # it leads once it holds the lease, and may take it over from another
            self.ctx.lease.on_taken.append(self.took_over)
        else:
            self.grace_after_restart()
        self._thread = threading.Thread(target=self._loop, args=(app,), name="zwdx-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End the loop (the server's ``stopping`` is set) and wait for its pass to finish."""
        self.ctx.stopping.set()
        self._wake.set()
        self._port_answered.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self, app) -> None:
        next_round = next_pass = 0.0
        with app.app_context():
            while not self.ctx.stopping.is_set():
                self._wake.wait(timeout=REAP_INTERVAL)
                # Kicked again soon after a pass: wait out the interval, but finish at once a placement
                # whose rank-0 GPU client answered (the job's clients wait for their assignment).
                while (left := next_pass - time.time()) > 0 and not self.ctx.stopping.is_set():
                    if self._port_answered.wait(left) and not self.ctx.stopping.is_set():
                        self._port_answered.clear()
                        if self.ctx.lease.held():
                            _guarded("finishing placements", self.finish_placements)
                self._wake.clear()
                began = time.time()
                if not self.ctx.lease.held():
                    continue  # another server process schedules (lease.py)
                settle, self._settle = self._settle, False
                if time.time() >= next_round:  # on the clock, not on every kick
                    next_round = time.time() + REAP_INTERVAL
                    _guarded("reaping lost gpu clients", self.reap_silent_clients)
                    settle = True
                if settle:
                    _guarded("settling failed jobs", self.settle)
                _guarded("finishing placements", self.finish_placements)
                _guarded("placing jobs", self.schedule_once)
                _guarded("placing joining DILOCO workers", self.join_workers)
                # A pass that took long (a large room) leaves the process twice as long to its
                # connections before the next one.
                next_pass = began + max(PASS_INTERVAL, 3 * (time.time() - began))

    # -- lost clients ----------------------------------------------------------------------
    def reap_silent_clients(self) -> None:
        """Declare lost the GPU clients past their ``lost_after`` (set on a dropped connection, when
        their server process is found dead and when this server starts; none while a process
        holds the client, which declares it lost itself: ``presence.py``; none once lost)."""
        now = time.time()
        for client in self.ctx.store.list_clients(None, lost_before=now):
            try:
                holds_ranks = any(s.get("job_id") for s in client["slots"])
                if client.get("status") == ClientStatus.ONLINE.value or holds_ranks:
                    why = ("connection dropped and not back" if client.get("disconnected_at") else "no heartbeat")
                    jobs.client_lost(self.ctx, client["id"],
                                     f"{why} for {now - float(client.get('last_seen') or now):.1f} s")
            except Exception:  # one client's record never keeps the others from being declared lost
                log.exception("scheduler: gpu client %s of room %s not reaped", client.get("id"), client.get("room_id"))

    def settle(self) -> None:
        """Settle the jobs whose ranks failed or lost their peers, room by room (``jobs.settle_suspects``)."""
        for room_id in self.ctx.store.job_rooms(ACTIVE):
            _guarded(f"settling the jobs of room {room_id}", jobs.settle_suspects, self.ctx, room_id)

    def grace_after_restart(self) -> None:
        """A (re)started server gives every GPU client that was online or running ranks
        ``CLIENT_TIMEOUT`` to reconnect before declaring it lost."""
        until = time.time() + self.ctx.settings.client_timeout
        for client in self.ctx.store.list_clients(None):
            if client.get("status") == ClientStatus.ONLINE.value or any(s.get("job_id") for s in client["slots"]):
                self.ctx.store.update_client(client["id"], {"status": ClientStatus.OFFLINE.value, "sid": None,
                                                            "lost_after": until})

    def took_over(self) -> None:
        """This process starts leading among several: the GPU clients that were online or running
        ranks get ``CLIENT_TIMEOUT`` from now before they are declared lost (those of a process
        that died reconnect through the balancer to another one), their records left as they
        are (the others are connected, to other processes)."""
        until = time.time() + self.ctx.settings.client_timeout
        for client in self.ctx.store.list_clients(None):
            if client.get("status") == ClientStatus.ONLINE.value and client.get("lost_after") is None:
                continue  # held by a live process (presence.py: a dead one's are found through Redis)
            if (client.get("status") == ClientStatus.ONLINE.value or any(s.get("job_id") for s in client["slots"])) \
                    and float(client.get("lost_after") or 0) < until:
                self.ctx.store.update_client(client["id"], {"lost_after": until})
        self.kick(settle=True)

    # -- placing jobs ----------------------------------------------------------------------
    def schedule_once(self) -> int:
        """One pass over every room's queue, each room in isolation (an error placing one room's
        jobs is logged and told to them, and the next room is placed). Returns how many jobs
        were placed."""
        started = 0
        for room_id in self.ctx.store.job_rooms(WAITING):
            try:
                started += self.schedule_room(room_id)
                self._failing.pop(room_id, None)
            except Exception as exc:
                if self._failing.get(room_id) != repr(exc):  # logged once per error, not at every pass
                    self._failing[room_id] = repr(exc)
                    log.exception("scheduler: room %s not placed", room_id)
                _guarded(f"telling room {room_id}'s jobs", self._could_not_place, room_id, exc)
        return started

    def schedule_room(self, room_id: str) -> int:
        """Place the room's waiting jobs in FIFO order: the head of the queue goes first and the
        rest wait behind it, except behind a job the room could never run. How many started."""
        started, clients = 0, None
        for job in self.ctx.store.list_jobs(room_id, statuses=list(WAITING)):
            if clients is None:  # the room's clients, each with its slots, from the view (roomview.py): a
                clients = self.ctx.views.of(room_id)  # start marks its slots in it as in the store
                time.sleep(0)  # under gevent, let the connections waiting meanwhile be served first
            outcome = self._try_start(job, clients)
            if outcome is _STARTED:
                started += 1
            elif outcome is _BLOCKED:
                break
        return started

    def _could_not_place(self, room_id: str, exc: Exception) -> None:
        """Tell the room's waiting jobs that read as jobs why none of them was placed."""
        reason = f"the scheduler cannot place this room's jobs ({type(exc).__name__}: {str(exc)[:200]}); see the " \
                 f"server's log"
        for job_id in self.ctx.store.job_ids(room_id, WAITING):
            try:
                job = Job.load(self.ctx.store, job_id)
            except Exception:
                continue  # the job's own record is what does not read
            if job is not None:
                jobs.said(self.ctx, job, reason)

    def _held_memory(self, job: JobRecord, slots: list[dict]) -> dict:
        """Bytes per rank of the jobs on the room's CPU slots (job id -> memory_required), which
        count against their hosts' RAM; asked only for a job that needs memory."""
        if not job.spec.resources.memory_required:
            return {}
        held = {}
        for job_id in {s["job_id"] for s in slots if s.get("job_id") and s.get("kind") == SlotKind.CPU.value}:
            other = self.ctx.store.get_job(job_id)
            held[job_id] = other.spec.resources.memory_required if other else 0
        return held

    def _try_start(self, record: JobRecord, clients: dict):
        """``_STARTED``; ``_BLOCKED`` (it waits, and the jobs behind it too); or ``_PASSED`` (it
        waits for what the room could never give it now, and holds back no one). ``clients``: the
        room's, by id, each with its slots (the reservation itself is checked in the store)."""
        store = self.ctx.store
        slots = room_slots(clients)
        if any(s.get("job_id") == record.id for s in slots):
            return _BLOCKED  # ranks of its last attempt are still stopping
        if isinstance(record.spec.strategy, Auto):  # its mode chosen now, from the room as it is (auto.py)
            resolved = auto.resolve(self.ctx, record, clients)
            if resolved is None:
                return _PASSED  # none fits the idle slots now: it waits saying why, holding back no one
            record = resolved
        asked = {"spec": record.spec.model_dump(mode="json"), "status": record.status.value,
                 "world_size": record.world_size, "avoid": record.avoid}
        asked = shadows.asked(record, asked)  # DILOCO's spot checks: their slots too
        kept = getattr(self.ctx.views, "kept", None)  # the records of the view's documents (``clients``)
        chosen, reason = plan(asked, slots, clients, self._held_memory(record, slots), kept=kept)
        job = Job(store, record)
        if chosen is None:
            _guarded(f"asking gpu clients to look again for job {record.id}'s packages", clients_of_room.ask_refresh,
                     record.id, asked["spec"], clients.values())
            # It waits either way (GPU clients may join), saying why; one the room as it is could
            # never run holds back none of the jobs behind it; nor one only the GPU clients it passes
            # over could run (a fake client must not stop the room's queue through the job it held).
            never = unschedulable(_least(record, asked["spec"]),
                                  [c for c in clients.values() if c["id"] not in record.avoid], kept)
            jobs.wait(self.ctx, record, reason)
            return _PASSED if never else _BLOCKED
        chosen, of = shadows.arrange(record, chosen, clients)
        placement = [PlacementEntry(rank=rank, client_id=slot["client_id"], hostname=clients[slot["client_id"]].get(
            "hostname"), gpu_index=slot["index"], gpu_name=slot.get("name"), kind=slot.get("kind") or SlotKind.CUDA)
            for rank, slot in enumerate(chosen)]
        rank_keys = {p.rank: new_secret(RANK_KEY_PREFIX) for p in placement}
        note = mixed(p.kind.value for p in placement)  # GPU and CPU slots together: what it costs
        if not job.start(placement, [s["id"] for s in chosen], {r: hash_secret(k) for r, k in rank_keys.items()},
                         note=note, shadows=shadows.entries(placement, of)):
            return _BLOCKED  # another scheduler got there first; look again next pass
        for rank, slot in enumerate(chosen):  # the pass's view of the room, as the store now has it
            slot["job_id"], slot["rank"] = record.id, rank
        log.info("job %s: placed on %d slot(s): %s%s", job.id, len(chosen),
                 ", ".join(f"rank {p.rank}@{p.hostname}:{p.gpu_index}" for p in placement),
                 f" ({note})" if note else "")
        self._ask_port(job.record, rank_keys, clients[placement[0].client_id])
        jobs.placed(self.ctx, job.record)
        return _STARTED

    def join_workers(self) -> int:
        """A running DILOCO job with a dropped worker takes a free slot that can run it: a new
        worker joins in the dropped one's place (``Job.join``) and its GPU client is told at
        once (the job's rendezvous is done). After the queues are placed: a waiting job that fits goes first.
        Returns how many joined."""
        joined = 0
        for record in self.ctx.store.list_jobs(None, statuses=[JobStatus.RUNNING], parallelism=Parallelism.DILOCO):
            joined += _guarded(f"a worker joining job {record.id}", self._join, record) or 0
        return joined

    def _join(self, record: JobRecord) -> int:
        joined = 0
        for rank in wanting(record):
            clients = {c["id"]: c for c in self.ctx.store.list_clients(record.room_id)}
            # every slot, held ones too: plan takes free ones, and counts the RAM the others hold
            slots = room_slots(clients)
            asked = {"spec": _sized(record.spec.model_dump(mode="json"), 1),
                     "status": JobStatus.QUEUED.value, "world_size": None, "avoid": record.avoid}
            chosen, _ = plan(asked, slots, clients, self._held_memory(record, slots))
            if not chosen:
                break
            slot, key = chosen[0], new_secret(RANK_KEY_PREFIX)
            entry = PlacementEntry(rank=rank, client_id=slot["client_id"], hostname=clients[slot["client_id"]].get(
                "hostname"), gpu_index=slot["index"], gpu_name=slot.get("name"), kind=slot.get("kind") or SlotKind.CUDA)
            job = Job(self.ctx.store, record)
            if not job.join(entry, slot["id"], hash_secret(key)):
                break
            log.info("job %s: gpu client %s joins as rank %d", record.id, entry.client_id, rank)
            jobs.assign(self.ctx, job.record, {rank: key}, joining=True)
            jobs.placed(self.ctx, job.record)
            record, joined = job.record, joined + 1
        return joined

    def _ask_port(self, job: JobRecord, rank_keys: dict[int, str], client: dict) -> None:
        """Ask the rank-0 GPU client for a rendezvous address; its acknowledgement comes back on
        a Socket.IO thread, which only notes it and wakes the scheduler."""
        timeout = self.ctx.settings.reserve_timeout
        request = PortRequest(job.id, job.attempt, rank_keys, client["id"], time.time() + timeout)
        with self._asked_lock:
            self._asked[job.id] = request

        def answered(*answer):
            request.answer, request.answered = (answer[0] if answer else None), True
            self._port_answered.set()
            self.kick()
        try:
            if not client.get("sid"):
                raise ConnectionError("the gpu client is not connected")
            socketio.emit(EV_RESERVE_PORT, ReservePort(job_id=job.id).model_dump(mode="json"), to=client["sid"],
                          namespace=GPU_NAMESPACE, callback=answered)
        except Exception as exc:  # the connection went away as we wrote
            request.error, request.answered = repr(exc), True
            self._port_answered.set()
            self.kick()

    def finish_placements(self) -> int:
        """Finish the placements whose rank-0 GPU client answered, and fail those it did not
        answer in time. Returns how many jobs were assigned to their GPU clients."""
        now = time.time()
        with self._asked_lock:
            due = [r for r in self._asked.values() if r.answered or r.deadline <= now]
            for request in due:
                del self._asked[request.job_id]
        return sum(bool(_guarded(f"finishing the placement of job {r.job_id}", self._finish, r)) for r in due)

    def _finish(self, request: PortRequest) -> bool:
        store = self.ctx.store
        job = Job.load(store, request.job_id)
        if job is None or job.record.attempt != request.attempt:
            return False
        if job.status != JobStatus.STARTING:
            jobs.let_go(self.ctx, job.record)  # cancelled, failed or interrupted while it waited
            return False
        offer, error = None, request.error
        if not request.answered:
            timeout = self.ctx.settings.reserve_timeout
            error = f"no answer within {timeout:g} s"
        elif error is None:
            try:
                offer = parse(PortOffer, request.answer, "its answer")
            except BadRequest as exc:
                error = exc.message
        if error is not None:  # placed again elsewhere: a GPU client that never answers holds no job
            jobs.not_started(self.ctx, job.record, f"rank-0 gpu client {request.client_id} did not offer a "
                                                        f"rendezvous address: {error}", {request.client_id})
            return False
        if not job.rendezvous(Master(addr=offer.addr, port=offer.port)):
            jobs.let_go(self.ctx, job.refresh().record)  # it moved on as the answer came
            return False
        jobs.assign(self.ctx, job.record, request.rank_keys)
        jobs.apply(self.ctx, jobs.Effects(show=job.record))
        return True
