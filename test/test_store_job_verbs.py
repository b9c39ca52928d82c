"""The job's writes named after what happened (``store.jobs``: ``zwdx/server/store/job_verbs.py``),
against every backend: each applies only in the statuses it names, the first failing or suspect
mark is kept however many come, a checkpoint keeps the last N, and a move's timeline entry and
status are one write.

    python -m pytest test/test_store_job_verbs.py -q
"""
from __future__ import annotations

from store_backends import *  # noqa: F401,F403  (fixtures: backend, store)
from store_backends import job_record
from zwdx.protocol import FailureKind, JobStatus, RankStatus
from zwdx.protocol.job import CheckpointEntry, Master, RankFailure, RankState, RestartEntry, TimelineEntry

ACTIVE = [JobStatus.STARTING, JobStatus.RUNNING]


def make(store, job_id: str, status: str = "running"):
    return store.create_job(job_record(job_id, "r1", status))


def test_a_move_changes_the_status_and_the_timeline_in_one_write_and_only_from_its_statuses(store):
    make(store, "j1", "running")
    entry = TimelineEntry(status=JobStatus.RESUMING, at=5.0, reason="lost")
    history = RestartEntry(at=5.0, reason="lost")
    assert store.jobs.move("j1", JobStatus.FAILED, entry, [JobStatus.QUEUED]) is None  # not from running
    after = store.jobs.move("j1", JobStatus.RESUMING, entry, ACTIVE, {"restarts": 1}, history)
    assert after.status == JobStatus.RESUMING and after.restarts == 1
    assert after.timeline[-1].reason == "lost" and [h.reason for h in after.restart_history] == ["lost"]
    assert store.get_job("j1") == after
    assert store.jobs.note("j1", TimelineEntry(status=JobStatus.RESUMING, at=6.0), ACTIVE) is None


def test_the_first_failing_and_suspect_marks_are_kept(store):
    make(store, "j1")
    assert store.jobs.mark_failing("j1", 1.0, "rank 1 failed").failing_since == 1.0
    assert store.jobs.mark_failing("j1", 2.0, "rank 0 failed") is None
    assert store.get_job("j1").failing_reason == "rank 1 failed"
    assert store.jobs.mark_suspect("j1", 3.0, "rank 0 exited").suspect_reason == "rank 0 exited"
    assert store.jobs.mark_suspect("j1", 4.0) is None
    assert store.jobs.suspect_reason("j1", "rank process died").suspect_since == 3.0
    make(store, "queued", "queued")
    assert store.jobs.mark_failing("queued", 1.0, "x") is None and store.jobs.mark_suspect("queued", 1.0) is None


def test_rank_reports_land_only_on_an_active_job(store):
    make(store, "j1")
    state = RankState(status=RankStatus.RUNNING, started_at=1.0)
    failure = RankFailure(traceback="boom", at=2.0, kind=FailureKind.RAISED)
    assert store.jobs.rank_states("j1", {0: state}).ranks["0"].status == RankStatus.RUNNING
    assert store.jobs.rank_failures("j1", {1: failure}).failures["1"].traceback == "boom"
    assert store.jobs.rank_exits("j1", {"1": -9}).exits == {"1": -9}
    assert store.jobs.result("j1", {"acc": 0.5}, 0.25, None).final_loss == 0.25
    make(store, "done", "completed")
    assert store.jobs.rank_states("done", {0: state}) is None and store.jobs.rank_exits("done", {"0": 0}) is None
    make(store, "failed", "failed")
    assert store.jobs.rank_failures("failed", {0: failure}) is None
    assert store.jobs.rank_failures("failed", {0: failure}, when=[JobStatus.FAILED]).failures["0"].at == 2.0
    assert store.jobs.outputs("failed", "art1").outputs_artifact == "art1"


def test_a_rendezvous_only_for_a_starting_job_and_a_wait_only_in_its_status(store):
    make(store, "j1", "starting")
    assert store.jobs.rendezvous("j1", Master(addr="10.0.0.1", port=29500)).master.port == 29500
    make(store, "j2", "running")
    assert store.jobs.rendezvous("j2", Master(addr="10.0.0.1", port=29500)) is None
    make(store, "j3", "queued")
    assert store.jobs.wait("j3", "no slot", JobStatus.RESUMING) is None
    assert store.jobs.wait("j3", "no slot", JobStatus.QUEUED).waiting_reason == "no slot"


def test_a_checkpoint_is_the_latest_and_the_job_keeps_the_last_n(store):
    make(store, "j1")
    for n in range(1, 5):
        after = store.jobs.add_checkpoint("j1", CheckpointEntry(n=n, epoch=n, format="torch", files={"s.pt": f"a{n}"},
                                                                at=float(n)), keep=2)
    assert [c.n for c in after.checkpoints] == [3, 4] and after.latest_checkpoint.n == 4
    assert store.jobs.warnings("j1", ["differ"]).warnings == ["differ"]
