"""A job's writes, named after what happened (``store.jobs.mark_suspect(...)``), for the job's
moves (``zwdx.server.jobs.Job``) to say what they write instead of how.

Each verb is one write of the backend's own (``set_job``, ``put_job_entries``, ``append_job``),
so it is as atomic as that write on every backend, across threads and processes: it applies
only while the job's status is one the verb names (or the caller's ``when``), and a verb that
keeps the first value (``mark_suspect``, ``mark_failing``) keeps it however many race. Each
returns the record after the write, or None: nothing changed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Collection, Mapping

from ...protocol import ACTIVE, JobStatus
from ...protocol.job import CheckpointEntry, DilocoJoin, Job as JobRecord, Master, RankFailure, RankState, \
    RestartEntry, TimelineEntry

if TYPE_CHECKING:
    from .base import Store

_ACTIVE = tuple(ACTIVE)


class JobVerbs:
    """The job verbs of ``store`` (``Store.jobs``)."""

    def __init__(self, store: Store):
        self.store = store

    # -- status and timeline -----------------------------------------------------------------
    def move(self, job_id: str, to: JobStatus, entry: TimelineEntry, when: Collection[JobStatus],
             fields: Mapping[str, Any] | None = None, history: RestartEntry | None = None) -> JobRecord | None:
        """The job moves to ``to`` from one of ``when`` (with ``fields``), ``entry`` on its
        timeline and ``history`` on its restarts, in one write."""
        items: dict[str, Any] = {"timeline": entry}
        if history is not None:
            items["restart_history"] = history
        return self.store.append_job(job_id, items, fields={"status": to, **(fields or {})}, when=when)

    def note(self, job_id: str, entry: TimelineEntry, when: Collection[JobStatus] | None = None) -> JobRecord | None:
        """``entry`` on the timeline, the status unchanged."""
        return self.store.append_job(job_id, {"timeline": entry}, when=when)

    def wait(self, job_id: str, reason: str, status: JobStatus) -> JobRecord | None:
        """A job still ``status`` (a waiting one) says why it waits."""
        return self.store.set_job(job_id, {"waiting_reason": reason}, when=[status])

    def rendezvous(self, job_id: str, master: Master) -> JobRecord | None:
        """Where a starting job's ranks meet."""
        return self.store.set_job(job_id, {"master": master}, when=[JobStatus.STARTING])

    # -- what its ranks report ---------------------------------------------------------------
    def rank_states(self, job_id: str, states: Mapping[Any, RankState]) -> JobRecord | None:
        """These ranks' states (running, completed, dropped) of an active job."""
        return self.store.put_job_entries(job_id, "ranks", states, when=_ACTIVE)

    def rank_failures(self, job_id: str, failures: Mapping[Any, RankFailure],
                      when: Collection[JobStatus] = _ACTIVE) -> JobRecord | None:
        """These ranks' failures (tracebacks), kept beside the others'."""
        return self.store.put_job_entries(job_id, "failures", failures, when=when)

    def rank_exits(self, job_id: str, exits: Mapping[str, int]) -> JobRecord | None:
        """These rank processes of an active job exited (rank -> exit code)."""
        return self.store.put_job_entries(job_id, "exits", exits, when=_ACTIVE)

    def joined(self, job_id: str, joins: Mapping[Any, DilocoJoin]) -> JobRecord | None:
        """DILOCO: workers placed in dropped ranks' places."""
        return self.store.put_job_entries(job_id, "joins", joins, when=_ACTIVE)

    def result(self, job_id: str, results: dict[str, Any], final_loss: float | None,
               weights_artifact: str | None) -> JobRecord | None:
        """What an active job returns: its results, final loss and weights."""
        return self.store.set_job(job_id, {"results": results, "final_loss": final_loss,
                                           "weights_artifact": weights_artifact}, when=_ACTIVE)

    def outputs(self, job_id: str, artifact_id: str) -> JobRecord | None:
        """A script job's outputs, while it runs or just failed."""
        return self.store.set_job(job_id, {"outputs_artifact": artifact_id}, when=(*_ACTIVE, JobStatus.FAILED))

    def warnings(self, job_id: str, warnings: list[str]) -> JobRecord | None:
        """The job's warnings (what its page shows beside its status), now these."""
        return self.store.set_job(job_id, {"warnings": warnings})

    # -- failing and suspect -------------------------------------------------------------------
    def mark_failing(self, job_id: str, at: float, reason: str) -> JobRecord | None:
        """An active job's rank raised: failing since ``at``, for ``reason``; the first one is kept."""
        return self.store.set_job(job_id, {"failing_since": at, "failing_reason": reason}, when=_ACTIVE,
                                  unless_set="failing_since")

    def mark_suspect(self, job_id: str, at: float, reason: str | None = None) -> JobRecord | None:
        """An active job's rank lost its peers: suspect since ``at`` (with ``reason``, what it
        fails for if no GPU client turns out lost); the first one is kept."""
        fields: dict[str, Any] = {"suspect_since": at}
        if reason is not None:
            fields["suspect_reason"] = reason
        return self.store.set_job(job_id, fields, when=_ACTIVE, unless_set="suspect_since")

    def suspect_reason(self, job_id: str, reason: str) -> JobRecord | None:
        """What an active suspect job fails for if no GPU client turns out lost (the latest said)."""
        return self.store.set_job(job_id, {"suspect_reason": reason}, when=_ACTIVE)

    # -- checkpoints ---------------------------------------------------------------------------
    def add_checkpoint(self, job_id: str, entry: CheckpointEntry, keep: int) -> JobRecord | None:
        """An active job's latest checkpoint; it keeps its last ``keep``."""
        return self.store.append_job(job_id, {"checkpoints": entry}, fields={"latest_checkpoint": entry},
                                     when=_ACTIVE, keep_last=keep)
