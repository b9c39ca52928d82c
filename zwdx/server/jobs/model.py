"""A job as the server holds it: its record and every move the server makes it through
(rq's ``Job``). The record is ``zwdx.protocol.job.Job`` (``JobRecord`` here); each move is a
store write of typed values, guarded by the statuses it may happen from, so two servers or
threads that race apply it at most once. A move that does not apply changes nothing and says
so (False or None). Moves only write: the caller (``lifecycle.py``, ``reports.py``, the scheduler) says what
must follow (``effects.Effects``: who is told, what is released), and ``effects.apply`` does it.

    queued|resuming --start--> starting --rank_running--> running --complete--> completed
    queued|resuming|starting|running --fail--> failed      ... --cancel--> cancelled
    starting|running --interrupt--> resuming (restarts left) or failed
    starting --not_started--> queued|resuming, not on the GPU clients that held it (tries left) or failed
    running --drop--> running (DILOCO: lost workers dropped, the others go on)

Failures come in two kinds. A rank whose own code raised makes the job *failing*: it fails
once every rank reported (or ``FAILURE_GRACE`` is over), with every failing rank's traceback.
A rank that lost its peers (a collective broke, or its process died without a word) makes
the job *suspect*: if a GPU client of the job turns out lost, the job is interrupted (it goes
on from its last checkpoint, up to ``max_restarts`` times); if none is lost within
``CLIENT_TIMEOUT`` (or every rank exited), it fails. ``overdue`` says when (``rules.py``).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Collection

from ...protocol import ACTIVE, WAITING, FailureKind, JobStatus, RankStatus, SlotKind
from ...protocol.layout import RankLayout
from ...protocol.report import StepCheck
from ...protocol.job import CheckpointEntry, DilocoJoin, Job as JobRecord, Master, PlacementEntry, RankCredential, \
    RankFailure, RankState, RestartEntry, Shadow, TimelineEntry
from .. import meters
from ..store import Store
from . import rules

_ACTIVE = tuple(ACTIVE)
_OPEN = (*ACTIVE, *WAITING)


class Job:
    """One job's record and the store it lives in; ``clock`` tells the time (tests pass a fake)."""

    def __init__(self, store: Store, record: JobRecord, clock: Callable[[], float] = time.time):
        self.store, self.record, self.clock = store, record, clock

    @classmethod
    def load(cls, store: Store, job_id: str, clock: Callable[[], float] = time.time) -> Job | None:
        record = store.get_job(job_id)
        return None if record is None else cls(store, record, clock)

    @classmethod
    def submit(cls, store: Store, record: JobRecord, clock: Callable[[], float] = time.time) -> Job:
        """Store a new job (``queued``); the store gives it its place in line."""
        return cls(store, store.create_job(record), clock)

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def status(self) -> JobStatus:
        return self.record.status

    def __repr__(self) -> str:
        return f"<Job {self.id} {self.status.value} attempt {self.record.attempt}>"

    def refresh(self) -> Job:
        self.record = self.store.get_job(self.id) or self.record
        return self

    def _took(self, record: JobRecord | None) -> bool:
        """Keep the store's answer to a write; False when the write did not apply."""
        if record is None:
            return False
        self.record = record
        return True

    def append_timeline(self, entry: TimelineEntry, when: Collection[JobStatus] | None = None) -> bool:
        return self._took(self.store.jobs.note(self.id, entry, when))

    def _move(self, to: JobStatus, when: Collection[JobStatus], at: float, fields: dict[str, Any] | None = None,
              history: RestartEntry | None = None, **entry: Any) -> bool:
        """Change the status (and ``fields``) and record it on the timeline, in one write."""
        if not self._took(self.store.jobs.move(self.id, to, TimelineEntry(status=to, at=at, **entry), when, fields,
                                               history)):
            return False
        meters.job_moved(self.record, to, at)
        return True

    # -- placing -------------------------------------------------------------------------------
    def wait(self, reason: str) -> bool:
        """A waiting job's ``waiting_reason`` changed (written only when it did)."""
        if self.status not in WAITING or self.record.waiting_reason == reason:
            return False
        return self._took(self.store.jobs.wait(self.id, reason, self.status))

    def start(self, placement: list[PlacementEntry], slot_ids: list[str], key_hashes: dict[int, str],
              note: str | None = None, shadows: dict[str, Shadow] | None = None) -> bool:
        """queued|resuming -> starting: the slots (one per rank, in rank order) are the job's,
        the new attempt starts with nothing heard from its ranks, and each rank's key (its hash,
        bound to the attempt and the rank's GPU client) replaces the last attempt's. NCCL when
        every rank is on a GPU, gloo otherwise. ``note``: what the timeline says of the
        placement (mixed devices). ``shadows``: DILOCO's spot checks, the placement's last ranks,
        outside the world size. False: a slot or the job was taken meanwhile (nothing changed)."""
        now, attempt, size = self.clock(), self.record.restarts, len(placement) - len(shadows or {})
        keys = {str(p.rank): RankCredential(hash=key_hashes[p.rank], client_id=p.client_id, attempt=attempt)
                for p in placement}
        fields = {"status": JobStatus.STARTING, "placement": placement, "world_size": size, "attempt": attempt,
                  "backend": "nccl" if all(p.kind == SlotKind.CUDA for p in placement) else "gloo",
                  "rank_keys": keys, "started_at": now, "waiting_reason": None, "master": None,
                  "ranks": {}, "exits": {}, "failures": {}, "joins": {}, "shadows": shadows or {},
                  "suspect_since": None, "suspect_reason": None,
                  "failing_since": None, "failing_reason": None}
        if not self.store.reserve_slots(self.id, [(slot, rank) for rank, slot in enumerate(slot_ids)], fields):
            return False
        meters.job_placed(self.record, now)
        entry = TimelineEntry(status=JobStatus.STARTING, at=now, attempt=attempt, world_size=size, reason=note)
        if not self.append_timeline(entry, when=[JobStatus.STARTING]):
            self.refresh()  # cancelled in between: it keeps its slots until the caller lets go
        return True

    def unplace(self, reason: str) -> bool:
        """starting -> queued (resuming, if it ran before): a placement none of whose GPU clients
        was told where to meet (the server that placed it stopped first) is undone, and the job
        waits to be placed again, ``reason`` on its timeline; no restart is counted, as nothing
        ran. The caller frees its slots. False: it moved on meanwhile."""
        r = self.record
        if r.status != JobStatus.STARTING or r.master is not None:
            return False
        back = JobStatus.RESUMING if r.restarts or r.latest_checkpoint else JobStatus.QUEUED
        fields: dict[str, Any] = {"placement": None, "world_size": None, "rank_keys": {}, "started_at": None,
                                  "waiting_reason": reason, "ranks": {}, "exits": {}}
        return self._move(back, [JobStatus.STARTING], self.clock(), fields, reason=reason)

    def not_started(self, reason: str, clients: Collection[str], tries: int) -> JobStatus | None:
        """starting -> queued (resuming, if it ran before): the placement did not start (no
        rendezvous address came, or no rank reported running in time). The job waits to be
        placed again, never on ``clients`` (the GPU clients that held it), ``reason`` on its
        timeline; no restart is counted, as nothing ran. The ``tries``-th such placement fails
        the job instead (0: never). The caller stops its ranks and frees its slots. The status
        it moved to, or None (it moved on meanwhile)."""
        r, now = self.record, self.clock()
        if r.status != JobStatus.STARTING:
            return None
        failures, avoid = r.start_failures + 1, sorted(set(r.avoid) | set(clients))
        fields = {"start_failures": failures, "avoid": avoid}
        if tries and failures >= tries:
            why = f"{reason}; gave up after {failures} placement(s) that did not start"
            moved = self._move(JobStatus.FAILED, [JobStatus.STARTING], now, {**fields, "ended_at": now, "reason": why},
                               reason=why)
            return JobStatus.FAILED if moved else None
        back = JobStatus.RESUMING if r.restarts or r.latest_checkpoint else JobStatus.QUEUED
        reason = f"placed again, not on gpu client(s) {', '.join(avoid)}: {reason}"
        fields.update({"placement": None, "world_size": None, "rank_keys": {}, "started_at": None, "master": None,
                       "waiting_reason": reason, "ranks": {}, "exits": {}})
        return back if self._move(back, [JobStatus.STARTING], now, fields, reason=reason) else None

    def join(self, entry: PlacementEntry, slot_id: str, key_hash: str) -> bool:
        """DILOCO: a worker joins the running job in dropped rank ``entry.rank``'s place, on
        ``slot_id``, under a new key (the same attempt: no restart). The rounds wait for it from
        the round it joins at (``joins``). False: the slot or the job moved meanwhile."""
        r, now = self.record, self.clock()
        rank = str(entry.rank)
        placement = [p for p in r.placement or [] if p.rank != entry.rank] + [entry]
        keys = {**r.rank_keys, rank: RankCredential(hash=key_hash, client_id=entry.client_id, attempt=r.attempt)}
        fields = {"placement": sorted(placement, key=lambda p: p.rank), "rank_keys": keys}
        if not self.store.reserve_slots(self.id, [(slot_id, entry.rank)], fields, when=[JobStatus.RUNNING]):
            return False
        self.refresh()
        self._took(self.store.jobs.joined(self.id, {rank: DilocoJoin(client_id=entry.client_id, placed_at=now)}))
        going_on = sum(1 for i in range(r.world_size or 0) if str(i) == rank or (
            (s := self.record.ranks.get(str(i))) is None or s.status != RankStatus.DROPPED))
        self.append_timeline(TimelineEntry(status=self.status, at=now, attempt=r.attempt, world_size=going_on,
                                           reason=f"gpu client {entry.client_id} joined as rank {rank} (in the "
                                                  f"dropped worker's place; it starts from the global weights at "
                                                  f"the next round)"), when=_ACTIVE)
        return True

    def rendezvous(self, master: Master) -> bool:
        """Rank 0's GPU client offered where the ranks meet; only a job still starting takes it."""
        return self._took(self.store.jobs.rendezvous(self.id, master))

    # -- what ranks report -----------------------------------------------------------------
    def rank_running(self, rank: int, isolation: str | None = None, terms: dict[str, Any] | None = None) -> bool:
        """A rank started (how its slot keeps it: ``isolation``, a container's ``terms``); the
        first one moves the job starting -> running (True then)."""
        now = self.clock()
        entry = RankState(status=RankStatus.RUNNING, started_at=now, isolation=isolation, terms=terms)
        if not self._took(self.store.jobs.rank_states(self.id, {rank: entry})):
            return False
        return self._move(JobStatus.RUNNING, [JobStatus.STARTING], now, {"running_at": now},
                          attempt=self.record.attempt)

    def rank_layout(self, rank: int, layout: RankLayout) -> bool:
        """A running rank said what it holds of the model (``protocol.layout``); kept on its state.
        False: the rank is not running (it reports its layout after its start), or the job moved."""
        before = self.record.ranks.get(str(rank))
        if before is None or before.status != RankStatus.RUNNING:
            return False
        entry = before.model_copy(update={"layout": layout})
        return self._took(self.store.jobs.rank_states(self.id, {rank: entry}))

    def rank_completed(self, rank: int, fingerprint: str | None = None, results: dict[str, Any] | None = None,
                       final_loss: float | None = None, weights_artifact: str | None = None,
                       global_fingerprint: str | None = None) -> bool:
        """A rank reported its result (rank 0's carries the job's, or that of the rank that uploaded
        the weights: a DILOCO worker, when rank 0 was dropped); the job completes when every rank
        has, or was dropped (True then)."""
        now = self.clock()
        if rank == 0 or weights_artifact is not None:
            self._took(self.store.jobs.result(self.id, results or {}, final_loss, weights_artifact))
        before = self.record.ranks.get(str(rank))
        entry = RankState(status=RankStatus.COMPLETED, started_at=before.started_at if before else None,
                          ended_at=now, fingerprint=fingerprint, global_fingerprint=global_fingerprint,
                          isolation=before.isolation if before else None,
                          terms=before.terms if before else None, layout=before.layout if before else None)
        if not self._took(self.store.jobs.rank_states(self.id, {rank: entry})):
            return False
        return self.complete()

    def complete(self) -> bool:
        """starting|running -> completed, once every rank reported completion (a DILOCO job's
        dropped workers aside: at least one completed)."""
        r = self.record
        states = [(state.status if (state := r.ranks.get(str(i))) is not None else None) for i in range(r.world_size or 0)]
        done = RankStatus.COMPLETED in states and all(s in (RankStatus.COMPLETED, RankStatus.DROPPED) for s in states)
        if r.status not in _ACTIVE or not done:
            return False
        now = self.clock()
        return self._move(JobStatus.COMPLETED, _ACTIVE, now, {"ended_at": now})

    def drop(self, ranks: Collection[int], reason: str) -> bool:
        """DILOCO: these workers are gone (their GPU client lost, their process dead); the job
        goes on with the others, which are not waited for by later rounds. False (nothing
        changed) when no other worker is left running: the caller interrupts the job then."""
        r, now = self.record, self.clock()
        per = r.spec.diloco.ranks_per_worker if r.spec.diloco else 1
        gone = {str(rank) for rank in ranks}
        going_on = [i for i in range(r.world_size or 0) if str(i) not in gone and
                    (r.ranks.get(str(i)) is None or r.ranks[str(i)].status in (RankStatus.RUNNING,
                                                                               RankStatus.COMPLETED))]
        if r.status not in _ACTIVE or not gone or not going_on:
            return False
        running = [i for i in going_on if r.ranks.get(str(i)) is None or r.ranks[str(i)].status == RankStatus.RUNNING]
        if not running and r.weights_artifact is None:
            return False  # the others are done and none uploaded the weights: only a restart gives them
        entries = {rank: RankState(status=RankStatus.DROPPED, ended_at=now,
                                   started_at=(r.ranks[rank].started_at if rank in r.ranks else None)) for rank in gone}
        if not self._took(self.store.jobs.rank_states(self.id, entries)):
            return False
        self.append_timeline(TimelineEntry(status=self.status, at=now, attempt=r.attempt, world_size=len(going_on),
                                           reason=f"{reason}: rank(s) {', '.join(sorted(gone, key=int))} dropped, "
                                                  f"{len({i // per for i in going_on})} worker(s) go on"), when=_ACTIVE)
        self.complete()  # the others may all be done already
        return True

    def rank_failed(self, rank: int, error: str, traceback: str, collective: bool, exit_code: int | None = None,
                    check: StepCheck | None = None) -> bool:
        """A rank reported an exception. Its own (``collective`` False): the job is failing.
        From torch.distributed (a peer probably gone): the job is suspect. A script that
        exited badly (``exit_code``; its own error or a lost peer, zwdx cannot tell) makes it
        suspect too, with that as the reason it fails for if no GPU client turns out lost. On a
        job that failed already, the traceback is kept too. ``check``: the DDP step check that
        stopped it, kept with its failure until the attempt settles (``rules.step_verdict``).
        False: the job was not in a state to record it."""
        now = self.clock()
        kind = FailureKind.EXITED if exit_code is not None else \
            FailureKind.COLLECTIVE if collective else FailureKind.RAISED
        failure = RankFailure(traceback=traceback, at=now, kind=kind, check=check)
        if self.status == JobStatus.FAILED:
            return self._took(self.store.jobs.rank_failures(self.id, {rank: failure}, when=[JobStatus.FAILED]))
        if not self._took(self.store.jobs.rank_failures(self.id, {rank: failure})):
            return False
        if exit_code is not None:
            self._took(self.store.jobs.mark_suspect(self.id, now, f"rank {rank} failed: {error}"))
        elif collective:
            self._took(self.store.jobs.mark_suspect(self.id, now))
        else:
            self._took(self.store.jobs.mark_failing(self.id, now, f"rank {rank} failed: {error}"))
        return True

    def ranks_exited(self, exits: dict[str, int]) -> bool:
        """A GPU client's rank processes exited (rank -> exit code). A rank that exited badly
        without reporting a failure (nor its completion) makes the job suspect. True when a
        rank exited badly."""
        exits = {str(rank): int(code) for rank, code in exits.items()}
        self._took(self.store.jobs.rank_exits(self.id, exits))
        r = self.record
        bad = {rank: code for rank, code in exits.items() if code != 0 and
               not ((state := r.ranks.get(rank)) is not None and state.status in (RankStatus.COMPLETED,
                                                                                  RankStatus.DROPPED))}
        unreported = {rank: code for rank, code in bad.items() if rank not in r.failures}
        if unreported and r.status in _ACTIVE:
            now = self.clock()
            failures = {rank: RankFailure(traceback=f"rank process exited with code {code} before reporting", at=now,
                                          kind=FailureKind.EXITED) for rank, code in unreported.items()}
            reason = "rank process died (" + ", ".join(
                f"rank {rank} exit code {code}" for rank, code in sorted(unreported.items())) + ")"
            if self._took(self.store.jobs.rank_failures(self.id, failures)):
                self._took(self.store.jobs.mark_suspect(self.id, now))
                self._took(self.store.jobs.suspect_reason(self.id, reason))
        return bool(bad)

    # -- the end ---------------------------------------------------------------------------
    def fail(self, reason: str) -> bool:
        """queued|resuming|starting|running -> failed."""
        now = self.clock()
        return self._move(JobStatus.FAILED, _OPEN, now, {"ended_at": now, "reason": reason}, reason=reason)

    def cancel(self, reason: str) -> bool:
        """queued|resuming|starting|running -> cancelled."""
        now = self.clock()
        return self._move(JobStatus.CANCELLED, _OPEN, now, {"ended_at": now, "reason": reason}, reason=reason)

    def interrupt(self, reason: str) -> JobStatus | None:
        """A GPU client of the running job is gone: starting|running -> resuming (it goes on
        from its last checkpoint), or -> failed once it used its ``max_restarts``. The status
        it moved to, or None."""
        r = self.record
        if r.status not in _ACTIVE:
            return None
        if r.restarts >= r.spec.recovery.max_restarts:
            before = "; ".join(h.reason for h in r.restart_history)
            why = f"{reason}; gave up after {r.restarts} restart(s)" + (f" ({before})" if before else "")
            return JobStatus.FAILED if self.fail(why) else None
        now, checkpoint = self.clock(), r.latest_checkpoint
        history = RestartEntry(at=now, reason=reason, from_checkpoint=checkpoint,
                               failures={rank: f.traceback for rank, f in r.failures.items()})
        fields = {"restarts": r.restarts + 1, "waiting_reason": reason, "ranks": {}, "exits": {}, "failures": {},
                  "suspect_since": None, "suspect_reason": None, "failing_since": None, "failing_reason": None}
        moved = self._move(JobStatus.RESUMING, _ACTIVE, now, fields, history, reason=reason,
                           checkpoint=checkpoint.n if checkpoint else None)
        return JobStatus.RESUMING if moved else None

    def overdue(self, offline: Collection[str], client_timeout: float, assign_timeout: float) -> str | None:
        """Why this active job should fail now, or None (``rules.overdue``)."""
        return rules.overdue(self.record, self.clock(), offline, client_timeout, assign_timeout)

    def start_overdue(self, start_timeout: float) -> str | None:
        """Why this starting job's placement should be given up, or None (``rules.start_overdue``)."""
        return rules.start_overdue(self.record, self.clock(), start_timeout)

    def outputs_uploaded(self, artifact_id: str) -> bool:
        """Rank 0 of a script job uploaded what its script wrote under ``$ZWDX_OUTPUT_DIR``: the
        job's outputs now (an earlier attempt's are left to the sweeper). While the job runs,
        or just failed."""
        return self._took(self.store.jobs.outputs(self.id, artifact_id))

    # -- checkpoints ---------------------------------------------------------------------------
    def checkpoint_committed(self, entry: CheckpointEntry) -> list[CheckpointEntry] | None:
        """Rank 0 committed a checkpoint: it is the latest, and the job keeps the last
        ``keep_checkpoints``. Returns those kept; None when the job is not starting or running
        (nothing changed)."""
        keep = self.record.spec.recovery.keep_checkpoints
        if not self._took(self.store.jobs.add_checkpoint(self.id, entry, keep)):
            return None
        return self.record.checkpoints

