"""The job's state machine (``zwdx.server.jobs.Job``), in-process on a real SQLite store in a
temporary directory, with a fake clock: every move, every refused move (wrong state, a race
lost to another handle on the same job), failing and suspect jobs, failure order, restarts."""
from __future__ import annotations

import pytest

from store_backends import job_record
from zwdx.protocol import FailureKind, JobStatus, RankStatus
from zwdx.protocol.job import CheckpointEntry, JobSpec, JobView, Master, PlacementEntry
from zwdx.server.jobs import FAILURE_GRACE, Job
from zwdx.server.store.sqlite import SQLiteStore

CLIENT_TIMEOUT = 8.0
ASSIGN_TIMEOUT = 25.0


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def store(tmp_path):
    store = SQLiteStore(str(tmp_path / "zwdx.sqlite3"))
    store.create_room({"id": "r1", "name": "room", "token_hash": "h", "created_at": 0.0})
    for cid in ("c1", "c2"):
        store.upsert_client({"id": cid, "room_id": "r1", "hostname": f"host-{cid}", "status": "online"},
                            [{"id": f"{cid}:0", "client_id": cid, "room_id": "r1", "index": 0, "kind": "cpu"}])
    yield store
    store.close()


def submit(store, clock, job_id="j1", **spec) -> Job:
    record = job_record(job_id)
    if spec:
        flat = {"world_size": 2, "versions": {"python": "3.11"}, "bundle_artifact": f"bundle-{job_id}",
                "bundle_sha256": "ab" * 32, **spec}  # the flat shape, read as the tree
        record = record.model_copy(update={"spec": JobSpec.model_validate(flat)})
    return Job.submit(store, record, clock)


def place(job: Job) -> bool:
    placement = [PlacementEntry(rank=rank, client_id=cid, hostname=f"host-{cid}", gpu_index=0, kind="cpu")
                 for rank, cid in enumerate(("c1", "c2"))]
    return job.start(placement, ["c1:0", "c2:0"], {0: "hash-of-key-0", 1: "hash-of-key-1"})


def running(store, clock) -> Job:
    job = submit(store, clock)
    assert place(job)
    assert job.rendezvous(Master(addr="10.0.0.1", port=29500))
    assert job.rank_running(0)
    assert not job.rank_running(1)  # the job is running already; the rank is recorded
    return job


def statuses(job: Job) -> list[str]:
    return [t.status.value for t in job.record.timeline]


def held(store) -> dict:
    return {s["id"]: s["job_id"] for s in store.list_slots("r1")}


def another(job: Job) -> Job:
    """A second handle on the same job, as another server or thread holds it."""
    return Job.load(job.store, job.id, job.clock)


# -- placing -----------------------------------------------------------------------------------
def test_start_takes_the_slots_and_begins_an_attempt(store, clock):
    job = submit(store, clock)
    stale = another(job)
    clock.advance(5)
    assert place(job)
    r = job.record
    assert (r.status, r.world_size, r.attempt, r.backend, r.started_at) == (JobStatus.STARTING, 2, 0, "gloo", 1005.0)
    assert {rank: (k.hash, k.client_id, k.attempt) for rank, k in r.rank_keys.items()} == \
        {"0": ("hash-of-key-0", "c1", 0), "1": ("hash-of-key-1", "c2", 0)}
    assert [p.client_id for p in r.placement] == ["c1", "c2"] and r.master is None
    assert r.timeline[-1].model_dump(mode="json") == {"status": "starting", "at": 1005.0, "attempt": 0, "world_size": 2}
    assert held(store) == {"c1:0": "j1", "c2:0": "j1"}
    assert store.get_job("j1") == r
    assert not place(stale)  # the race lost: the job is placed already
    other = submit(store, clock, "j2")
    assert not place(other) and other.status == JobStatus.QUEUED  # its slots are taken
    assert store.get_job("j2").status == JobStatus.QUEUED and statuses(other) == ["queued"]


def test_a_waiting_reason_is_written_only_when_it_changes(store, clock):
    job = submit(store, clock)
    assert job.wait("waiting for 2 free slot(s); 0 available")
    assert not job.wait("waiting for 2 free slot(s); 0 available")
    assert store.get_job("j1").waiting_reason == "waiting for 2 free slot(s); 0 available"
    assert place(job) and job.record.waiting_reason is None
    assert not job.wait("too late")  # it left the queue
    assert store.get_job("j1").waiting_reason is None


def test_the_rendezvous_is_taken_only_while_starting(store, clock):
    job = submit(store, clock)
    assert not job.rendezvous(Master(addr="10.0.0.1", port=1))  # not placed
    assert place(job)
    cancelled = another(job)
    assert cancelled.cancel("by the submitter")
    assert not job.rendezvous(Master(addr="10.0.0.1", port=1))
    assert store.get_job("j1").master is None


# -- ranks -------------------------------------------------------------------------------------
def test_ranks_running_then_completed_complete_the_job(store, clock):
    job = running(store, clock)
    assert job.status == JobStatus.RUNNING and job.record.running_at == 1000.0
    clock.advance(10)
    assert not job.rank_completed(1, fingerprint="f")
    assert job.status == JobStatus.RUNNING
    clock.advance(1)
    assert job.rank_completed(0, fingerprint="f", results={"accuracy": 0.9, "final_loss": 0.25}, final_loss=0.25,
                              weights_artifact="w1")
    r = store.get_job("j1")
    assert (r.status, r.ended_at, r.final_loss, r.results, r.weights_artifact) == \
        (JobStatus.COMPLETED, 1011.0, 0.25, {"accuracy": 0.9, "final_loss": 0.25}, "w1")
    assert r.ranks["0"].model_dump(mode="json") == {"status": "completed", "started_at": 1000.0, "ended_at": 1011.0,
                                                    "fingerprint": "f"}
    assert statuses(job) == ["queued", "starting", "running", "completed"]
    assert not job.rank_completed(0)  # a finished job takes no more reports
    assert not job.rank_running(1)
    assert not job.cancel("too late") and not job.fail("too late") and job.interrupt("too late") is None
    assert store.get_job("j1") == r


def test_a_rank_that_raised_makes_the_job_failing_and_the_first_names_it(store, clock):
    job = running(store, clock)
    clock.advance(1)
    assert job.rank_failed(1, "ValueError: boom", "Traceback 1", collective=False)
    clock.advance(0.5)
    assert job.rank_failed(0, "ValueError: bang", "Traceback 0", collective=False)
    r = job.record
    assert (r.failing_since, r.failing_reason) == (1001.0, "rank 1 failed: ValueError: boom")
    assert r.status == JobStatus.RUNNING  # it fails when settled
    reason = job.overdue(set(), CLIENT_TIMEOUT, ASSIGN_TIMEOUT)  # every rank reported
    assert reason == "rank 1 failed: ValueError: boom"
    assert job.fail(reason) and job.status == JobStatus.FAILED
    assert job.overdue(set(), CLIENT_TIMEOUT, ASSIGN_TIMEOUT) is None
    view = JobView.of(store.get_job("j1"))
    assert view.failures == {"1": "Traceback 1", "0": "Traceback 0"} and view.failure_order == ["1", "0"]
    assert view.reason == reason and statuses(job)[-1] == "failed"


def test_a_failing_job_waits_for_the_other_ranks_at_most_the_grace(store, clock):
    job = running(store, clock)
    assert job.rank_failed(1, "ValueError: boom", "Traceback 1", collective=False)
    assert job.overdue(set(), CLIENT_TIMEOUT, ASSIGN_TIMEOUT) is None
    clock.advance(FAILURE_GRACE + 0.1)
    assert job.overdue(set(), CLIENT_TIMEOUT, ASSIGN_TIMEOUT) == "rank 1 failed: ValueError: boom"


def test_a_failed_job_keeps_the_traceback_of_a_rank_that_reports_late(store, clock):
    job = running(store, clock)
    assert job.rank_failed(1, "ValueError: boom", "Traceback 1", collective=False)
    assert job.fail("rank 1 failed")
    assert job.rank_failed(0, "RuntimeError: peer gone", "Traceback 0", collective=True)
    assert set(store.get_job("j1").failures) == {"0", "1"}
    assert store.get_job("j1").status == JobStatus.FAILED
    cancelled = submit(store, clock, "j2")
    assert cancelled.cancel("by the submitter")
    assert not cancelled.rank_failed(0, "x", "Traceback", collective=False)  # never placed, nothing to keep
    assert store.get_job("j2").failures == {}


def test_a_suspect_job_fails_when_no_gpu_client_is_lost_within_the_timeout(store, clock):
    job = running(store, clock)
    assert job.rank_failed(0, "RuntimeError: connection reset", "Traceback 0", collective=True)
    assert job.record.suspect_since == 1000.0 and job.record.failing_since is None
    clock.advance(CLIENT_TIMEOUT)
    assert job.overdue(set(), CLIENT_TIMEOUT, ASSIGN_TIMEOUT) is None  # its clients may still be found lost
    clock.advance(1.5)
    assert job.overdue({"c2"}, CLIENT_TIMEOUT, ASSIGN_TIMEOUT) is None  # one is offline: the reaper decides
    assert job.overdue(set(), CLIENT_TIMEOUT, ASSIGN_TIMEOUT) == "a rank lost its peers and no GPU client was lost"


def test_a_suspect_job_whose_ranks_all_exited_fails_at_once(store, clock):
    job = running(store, clock)
    assert job.rank_failed(0, "RuntimeError: connection reset", "Traceback 0", collective=True)
    assert job.ranks_exited({"0": 1})  # exited badly, having reported why: not a silent death
    assert job.record.failures["0"].kind == FailureKind.COLLECTIVE and job.record.suspect_reason is None
    assert job.overdue(set(), CLIENT_TIMEOUT, ASSIGN_TIMEOUT) is None
    assert job.ranks_exited({"1": -9})
    r = job.record
    assert r.failures["1"].kind == FailureKind.EXITED and "exited with code -9" in r.failures["1"].traceback
    assert r.suspect_since == 1000.0 and r.suspect_reason == "rank process died (rank 1 exit code -9)"
    assert job.overdue(set(), CLIENT_TIMEOUT, ASSIGN_TIMEOUT) == "rank process died (rank 1 exit code -9)"


def test_a_rank_that_completed_may_exit_with_any_code(store, clock):
    job = running(store, clock)
    assert not job.rank_completed(1, fingerprint="f")
    assert not job.ranks_exited({"1": 137, "0": 0})
    r = store.get_job("j1")
    assert r.exits == {"1": 137, "0": 0} and r.failures == {} and r.suspect_since is None
    assert r.ranks["1"].status == RankStatus.COMPLETED


def test_a_suspect_job_whose_client_is_lost_resumes_from_its_last_checkpoint(store, clock):
    job = running(store, clock)
    kept = []
    for n in range(3):
        kept = job.checkpoint_committed(CheckpointEntry(n=n, epoch=n, format="torch", world_size=2, at=1000.0 + n))
    assert [c.n for c in kept] == [1, 2] and job.record.latest_checkpoint.n == 2  # keep_checkpoints: 2
    assert job.rank_failed(0, "RuntimeError: connection reset", "Traceback 0", collective=True)
    clock.advance(3)
    assert job.interrupt("gpu client c2 (host-c2) lost: no heartbeat for 8.0 s") == JobStatus.RESUMING
    r = store.get_job("j1")
    assert (r.status, r.restarts, r.waiting_reason) == \
        (JobStatus.RESUMING, 1, "gpu client c2 (host-c2) lost: no heartbeat for 8.0 s")
    assert (r.ranks, r.exits, r.failures, r.suspect_since) == ({}, {}, {}, None)
    history = r.restart_history[0]
    assert (history.at, history.failures, history.from_checkpoint.n) == (1003.0, {"0": "Traceback 0"}, 2)
    assert r.timeline[-1].model_dump(mode="json") == {"status": "resuming", "at": 1003.0, "checkpoint": 2,
                                                      "reason": "gpu client c2 (host-c2) lost: no heartbeat for 8.0 s"}
    assert job.interrupt("again") is None  # once
    store.release_slots("j1")
    clock.advance(1)
    assert place(job) and job.record.attempt == 1 and job.record.started_at == 1004.0
    assert [t.status.value for t in store.get_job("j1").timeline] == \
        ["queued", "starting", "running", "resuming", "starting"]


def test_a_job_that_used_its_restarts_fails_naming_them(store, clock):
    job = submit(store, clock, max_restarts=1)
    assert place(job)
    assert job.interrupt("gpu client c1 lost") == JobStatus.RESUMING
    store.release_slots("j1")
    assert place(job) and job.rank_running(0)
    assert job.interrupt("gpu client c2 lost") == JobStatus.FAILED
    r = store.get_job("j1")
    assert r.status == JobStatus.FAILED and r.restarts == 1
    assert r.reason == "gpu client c2 lost; gave up after 1 restart(s) (gpu client c1 lost)"
    assert statuses(job) == ["queued", "starting", "resuming", "starting", "running", "failed"]


def test_failure_order_puts_ranks_whose_code_raised_first_then_by_time(store, clock):
    job = submit(store, clock)
    assert store.set_job("j1", {"status": JobStatus.RUNNING, "world_size": 4})  # as if placed on 4 slots
    job.refresh()
    clock.now = 10.0
    job.rank_failed(0, "lost", "tb 0", collective=True)  # heard of first, but only a knock-on
    clock.now = 11.0
    assert job.ranks_exited({"2": -9})
    clock.now = 11.5
    job.rank_failed(3, "ValueError", "tb 3", collective=False)
    clock.now = 12.0
    job.rank_failed(1, "ValueError", "tb 1", collective=False)
    view = JobView.of(store.get_job("j1"))
    assert view.failure_order == ["3", "1", "0", "2"]
    assert view.failure_info["0"].model_dump(mode="json") == {"at": 10.0, "kind": "collective"}
    assert view.model_dump(mode="json")["failures"]["3"] == "tb 3"


# -- the end -----------------------------------------------------------------------------------
def test_two_handles_racing_to_end_a_job_end_it_once(store, clock):
    job = running(store, clock)
    other = another(job)
    assert job.cancel("by the submitter")
    assert not other.cancel("by the submitter") and not other.fail("a rank failed")
    assert other.interrupt("gpu client lost") is None
    r = store.get_job("j1")
    assert (r.status, r.reason) == (JobStatus.CANCELLED, "by the submitter")
    assert statuses(job).count("cancelled") == 1 and "failed" not in statuses(job)


def test_queued_jobs_can_be_cancelled_or_failed_but_not_moved_otherwise(store, clock):
    job = submit(store, clock)
    assert not job.rank_running(0) and not job.rank_completed(0) and not job.complete()
    job.ranks_exited({"0": 1})
    assert job.interrupt("gpu client lost") is None
    r = store.get_job("j1")
    assert (r.status, r.exits, r.failures, r.ranks, statuses(job)) == (JobStatus.QUEUED, {}, {}, {}, ["queued"])
    assert job.fail("refused")
    assert statuses(job) == ["queued", "failed"] and job.record.timeline[-1].reason == "refused"


def test_a_placement_no_gpu_client_was_told_of_is_undone_and_the_job_waits_again(store, clock):
    job = submit(store, clock)
    assert place(job)
    clock.advance(ASSIGN_TIMEOUT + 1)
    assert job.unplace("placed again: the server stopped")
    store.release_slots("j1")
    r = store.get_job("j1")
    assert (r.status, r.placement, r.restarts, r.waiting_reason) == (
        JobStatus.QUEUED, None, 0, "placed again: the server stopped")
    assert statuses(job) == ["queued", "starting", "queued"] and set(held(store).values()) == {None}
    assert place(job) and store.get_job("j1").status == JobStatus.STARTING  # placed again, as any queued job
    assert job.rendezvous(Master(addr="10.0.0.1", port=29500))
    assert not job.unplace("too late: its clients were told")


def test_a_starting_job_no_gpu_client_was_told_of_is_overdue(store, clock):
    job = submit(store, clock)
    assert place(job)
    clock.advance(ASSIGN_TIMEOUT - 1)
    assert job.overdue(set(), CLIENT_TIMEOUT, ASSIGN_TIMEOUT) is None
    clock.advance(2)
    assert "no rendezvous address came" in job.overdue(set(), CLIENT_TIMEOUT, ASSIGN_TIMEOUT)
    assert job.rendezvous(Master(addr="10.0.0.1", port=29500))
    assert job.overdue(set(), CLIENT_TIMEOUT, ASSIGN_TIMEOUT) is None
