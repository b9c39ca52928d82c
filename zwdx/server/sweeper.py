"""Garbage collection of artifacts: what no job needs is deleted, bytes and record.

Every ``SWEEP_INTERVAL`` seconds (0: never), in a background thread of the server, one pass
(``Sweeper.sweep``) deletes:

- bundles uploaded and never attached to a job, once ``UNATTACHED_GRACE`` old (the SDK submits
  its job right after the upload; the record goes first, in one conditional write, so a
  submit that attaches the bundle meanwhile keeps it);
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

from ..protocol import FINISHED
from ..protocol.job import Job as JobRecord

log = logging.getLogger(__name__)


def referenced(job: JobRecord) -> set[str]:
    """The artifacts a finished job's record names: its bundle, its weights, the files of its
    committed checkpoints."""
    keep = {job.spec.bundle_artifact}
    if job.weights_artifact:
        keep.add(job.weights_artifact)
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
        interval = float(self.ctx.config.get("SWEEP_INTERVAL") or 0)
        if interval > 0:
            self._thread = threading.Thread(target=self._loop, args=(interval,), name="zwdx-sweeper", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.ctx.stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self, interval: float) -> None:
        while not self.ctx.stopping.wait(interval):
            try:
                self.sweep()
            except Exception:  # the next pass tries again
                log.exception("sweeper: pass failed")

    def _delete(self, artifact: dict, if_unattached: bool = False) -> bool:
        if not self.ctx.store.delete_artifact(artifact["id"], if_unattached=if_unattached):
            return False
        self.ctx.artifacts.delete(artifact["id"])
        return True

    def sweep(self, now: float | None = None) -> Counter:
        """One pass; returns how many of each kind were deleted (``unattached``, ``partial``,
        ``orphaned``, ``unreferenced``, ``retention``)."""
        cfg, store, now = self.ctx.config, self.ctx.store, time.time() if now is None else now
        grace = float(cfg.get("UNATTACHED_GRACE") or 0)
        retention = float(cfg.get("ARTIFACT_RETENTION") or 0)
        gone = Counter()
        for artifact in store.list_unattached_artifacts(now - grace):
            gone["unattached"] += self._delete(artifact, if_unattached=True)
        gone["partial"] += self.ctx.artifacts.discard_partial(now - grace)
        stored = self.ctx.artifacts.stored(now - grace)
        for artifact_id in set(stored) - store.known_artifacts(stored):
            self.ctx.artifacts.delete(artifact_id)
            gone["orphaned"] += 1
        for room_id in store.job_rooms(FINISHED):  # room by room: one room's unreadable record stops no other's
            try:
                jobs = store.list_jobs(room_id, statuses=list(FINISHED))
            except Exception:
                log.exception("sweeper: the finished jobs of room %s not swept", room_id)
                continue
            for job in jobs:
                if self._done.get(job.id):
                    continue
                ended = job.ended_at or now
                expired = bool(retention) and ended < now - retention
                if job.id in self._done and not expired and ended < now - grace:
                    continue  # swept since it ended, and too long ago for a late upload to come
                keep = set() if expired else referenced(job)
                for artifact in store.list_artifacts(job.id):
                    if artifact["id"] not in keep:
                        gone["retention" if expired else "unreferenced"] += self._delete(artifact)
                self._done[job.id] = expired
        if sum(gone.values()):
            log.info("sweeper: deleted %s", ", ".join(f"{n} {what}" for what, n in sorted(gone.items()) if n))
        return +gone  # what was deleted, none of the zeros
