"""Garbage collection of artifacts: what no job needs is deleted, bytes and record.

Every ``SWEEP_INTERVAL`` seconds (0: never), in a background thread of the server, one pass
(``Sweeper.sweep``) deletes:

- bundles uploaded and never attached to a job, once ``UNATTACHED_GRACE`` old (the SDK submits
  its job right after the upload; the record goes first, in one conditional write, so a
  submit that attaches the bundle meanwhile keeps it);
- script jobs' working dirs (the room's, ``scripts.py``) that no job of the room names (but a
  job whose artifacts went after ``ARTIFACT_RETENTION``), once uploaded and last used
  ``UNATTACHED_GRACE`` ago;
- (never a room dataset's chunks or versions: they stay until ``zwdx data rm``, ``datasets.py``)
- what an upload cut short left (a temporary file, GridFS chunks with no file), and bytes that
  no record names (a server stopped between the two), once ``UNATTACHED_GRACE`` old;
- of a finished job, the artifacts its record does not name: weights it uploaded but never
  reported, checkpoint files never committed or no longer kept (its bundle, its reported
  weights and its committed checkpoints stay);
- with ``ARTIFACT_RETENTION`` set (seconds), every artifact of a job that ended longer ago
  (its record stays; its weights are then gone: 404).

Each deletion forgets the record first and then the bytes: a reader finds either both or no
artifact. What was deleted counts no more against the room's quota (``limits.py``).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter

from ..protocol import FINISHED, ArtifactKind, JobKind
from ..protocol.job import Job as JobRecord
from . import clients

log = logging.getLogger(__name__)

#: A room's datasets: its chunks and versions stay until removed (``zwdx data rm``).
DATASETS = (ArtifactKind.DATASET.value, ArtifactKind.DATASET_CHUNK.value)


def referenced(job: JobRecord) -> set[str]:
    """The artifacts a finished job's record names: its bundle, its weights, a script job's
    outputs, the files of its committed checkpoints."""
    keep = {job.spec.code.bundle_artifact}
    keep |= {a for a in (job.weights_artifact, job.outputs_artifact) if a}
    for entry in [*job.checkpoints, *([job.latest_checkpoint] if job.latest_checkpoint else [])]:
        keep |= set(entry.files.values())
    return keep


class Sweeper:
    """One server's artifact sweeps: ``start()`` runs them on the clock, ``sweep()`` one now."""

    def __init__(self, ctx):
        self.ctx = ctx
        self._thread: threading.Thread | None = None
        #: finished job id -> whether its artifacts are past retention (and so all deleted already)
        self._done: dict[str, bool] = {}

    def start(self) -> None:
        interval = self.ctx.settings.sweep_interval
        if interval > 0:
            self._thread = threading.Thread(target=self._loop, args=(interval,), name="zwdx-sweeper", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.ctx.stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self, interval: float) -> None:
        while not self.ctx.stopping.wait(interval):
            if not self.ctx.lease.held():
                continue  # another server process sweeps (lease.py)
            try:
                self.sweep()
            except Exception:  # the next pass tries again
                log.exception("sweeper: pass failed")
            try:  # GPU clients offline past their room's retention (clients.py)
                clients.drop_expired(self.ctx)
            except Exception:
                log.exception("sweeper: offline gpu clients not dropped")

    def _delete(self, artifact: dict, if_unattached: bool = False) -> bool:
        if not self.ctx.store.delete_artifact(artifact["id"], if_unattached=if_unattached):
            return False
        self.ctx.artifacts.delete(artifact["id"])
        return True

    def _workdir_in_use(self, artifact: dict, in_use: dict, expired_before: float | None) -> bool:
        """Whether a job of the working dir's room names it (but a job that ended before
        ``expired_before``: its retention is over). The room's jobs are read once per pass; a
        room whose records do not read keeps its working dirs."""
        room_id = artifact["room_id"]
        if room_id not in in_use:
            try:
                in_use[room_id] = {job.spec.code.bundle_artifact for job in self.ctx.store.list_jobs(room_id)
                                   if job.spec.kind == JobKind.SCRIPT and not (
                                       expired_before and job.ended_at and job.ended_at < expired_before)}
            except Exception:
                log.exception("sweeper: the working dirs of room %s not swept", room_id)
                in_use[room_id] = None
        return in_use[room_id] is None or artifact["id"] in in_use[room_id]

    def sweep(self, now: float | None = None) -> Counter:
        """One pass; returns how many of each kind were deleted (``unattached``, ``partial``,
        ``orphaned``, ``unreferenced``, ``retention``)."""
        now = time.time() if now is None else now
        grace, retention = self.ctx.settings.unattached_grace, self.ctx.settings.artifact_retention
        gone = self._unattached(now, grace, retention)
        gone["partial"] += self.ctx.artifacts.discard_partial(now - grace)
        stored = self.ctx.artifacts.stored(now - grace)
        for artifact_id in set(stored) - self.ctx.store.known_artifacts(stored):
            self.ctx.artifacts.delete(artifact_id)
            gone["orphaned"] += 1
        for room_id in self.ctx.store.job_rooms(FINISHED):  # room by room: one room's unreadable record stops no other's
            try:
                jobs = self.ctx.store.list_jobs(room_id, statuses=list(FINISHED))
            except Exception:
                log.exception("sweeper: the finished jobs of room %s not swept", room_id)
                continue
            for job in jobs:
                gone += self._finished(job, now, grace, retention)
        if sum(gone.values()):
            log.info("sweeper: deleted %s", ", ".join(f"{n} {what}" for what, n in sorted(gone.items()) if n))
        return +gone  # what was deleted, none of the zeros

    def _unattached(self, now: float, grace: float, retention: float) -> Counter:
        """Uploads no job took within the grace (a room's datasets and working dirs in use kept)."""
        gone: Counter = Counter()
        in_use: dict[str, set[str] | None] = {}  # room id -> the working dirs its jobs name
        for artifact in self.ctx.store.list_unattached_artifacts(now - grace):
            if artifact.get("kind") in DATASETS:
                continue  # the room's until zwdx data rm (datasets.py)
            if artifact.get("kind") == ArtifactKind.WORKDIR.value:
                if float(artifact.get("used_at") or 0) >= now - grace or \
                        self._workdir_in_use(artifact, in_use, now - retention if retention else None):
                    continue
            gone["unattached"] += self._delete(artifact, if_unattached=True)
        return gone

    def _finished(self, job, now: float, grace: float, retention: float) -> Counter:
        """A finished job's artifacts it no longer names, or all of them past the retention."""
        gone: Counter = Counter()
        if self._done.get(job.id):
            return gone
        ended = job.ended_at or now
        expired = bool(retention) and ended < now - retention
        if job.id in self._done and not expired and ended < now - grace:
            return gone  # swept since it ended, and too long ago for a late upload to come
        keep = set() if expired else referenced(job)
        for artifact in self.ctx.store.list_artifacts(job.id):
            if artifact["id"] not in keep:
                gone["retention" if expired else "unreferenced"] += self._delete(artifact)
        self._done[job.id] = expired
        return gone
