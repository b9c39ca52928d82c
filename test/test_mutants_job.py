"""zwdx/server/jobs/model.py (job.py then), checked where mutation testing (bench/mutation.py) found nothing looking:
a placement that did not start (placed again elsewhere, or failed after its tries), DILOCO's
dropped and joining workers, each with the exact record and timeline it leaves. In-process on a
real SQLite store with a fake clock (test_job.py's fixtures)."""
from __future__ import annotations

from test_job import clock, place, statuses, store, submit  # noqa: F401  (clock, store: fixtures)
from zwdx.protocol import JobStatus, RankStatus
from zwdx.protocol.job import PlacementEntry
from zwdx.server.jobs import Job


def test_a_placement_that_did_not_start_waits_again_avoiding_its_clients(store, clock):
    job = submit(store, clock)
    assert place(job)
    clock.advance(7)
    assert job.not_started("no rank reported running", ["c2", "c1"], tries=3) == JobStatus.QUEUED
    r = store.get_job("j1")
    reason = "placed again, not on gpu client(s) c1, c2: no rank reported running"
    assert (r.status, r.start_failures, r.avoid, r.waiting_reason) == (JobStatus.QUEUED, 1, ["c1", "c2"], reason)
    assert (r.placement, r.world_size, r.rank_keys, r.started_at, r.master, r.ranks, r.exits, r.restarts) == \
        (None, None, {}, None, None, {}, {}, 0)
    assert r.timeline[-1].model_dump(mode="json") == {"status": "queued", "at": 1007.0, "reason": reason}
    assert job.not_started("again", ["c3"], tries=3) is None  # not starting any more: nothing changes
    assert store.get_job("j1").start_failures == 1


def test_the_avoided_clients_add_up_and_a_job_that_ran_resumes(store, clock):
    job = submit(store, clock)
    assert place(job)
    assert job.not_started("first", ["c1"], tries=0) == JobStatus.QUEUED
    store.release_slots("j1")  # the caller's part
    assert place(job)
    store.set_job("j1", {"restarts": 1})  # it ran before
    job.refresh()
    assert job.not_started("second", ["c2"], tries=0) == JobStatus.RESUMING  # 0 tries: never gives up
    r = store.get_job("j1")
    assert (r.status, r.start_failures, r.avoid) == (JobStatus.RESUMING, 2, ["c1", "c2"])
    assert r.waiting_reason == "placed again, not on gpu client(s) c1, c2: second"


def test_the_last_try_fails_the_job_saying_how_many_it_took(store, clock):
    job = submit(store, clock)
    assert place(job)
    assert job.not_started("one", ["c1"], tries=2) == JobStatus.QUEUED
    store.release_slots("j1")
    assert place(job)
    clock.advance(3)
    assert job.not_started("two", ["c2"], tries=2) == JobStatus.FAILED
    r = store.get_job("j1")
    why = "two; gave up after 2 placement(s) that did not start"
    assert (r.status, r.reason, r.ended_at, r.start_failures, r.avoid) == (JobStatus.FAILED, why, 1003.0, 2,
                                                                           ["c1", "c2"])
    assert r.timeline[-1].model_dump(mode="json") == {"status": "failed", "at": 1003.0, "reason": why}
    assert statuses(job) == ["queued", "starting", "queued", "starting", "failed"]


def test_a_lost_race_to_fail_a_placement_says_none(store, clock):
    job = submit(store, clock)
    assert place(job)
    stale = Job.load(store, "j1", clock)
    assert job.cancel("stop")
    assert stale.not_started("late", ["c1"], tries=1) is None
    assert store.get_job("j1").status == JobStatus.CANCELLED


def diloco_running(store, clock, world_size: int = 3) -> Job:
    for cid in ("c3", "c4"):
        store.upsert_client({"id": cid, "room_id": "r1", "hostname": f"host-{cid}", "status": "online"},
                            [{"id": f"{cid}:0", "client_id": cid, "room_id": "r1", "index": 0, "kind": "cpu"}])
    job = submit(store, clock)
    clients = ["c1", "c2", "c3"][:world_size]
    placement = [PlacementEntry(rank=r, client_id=c, hostname=f"host-{c}", gpu_index=0, kind="cpu")
                 for r, c in enumerate(clients)]
    assert job.start(placement, [f"{c}:0" for c in clients], {r: f"hash-{r}" for r in range(world_size)})
    for rank in range(world_size):
        assert job.rank_running(rank) or job.status == JobStatus.RUNNING
    return job


def test_dropping_a_worker_marks_it_and_says_who_goes_on(store, clock):
    job = diloco_running(store, clock)
    clock.advance(4)
    assert job.drop([2], "gpu client c3 lost")
    r = store.get_job("j1")
    assert r.status == JobStatus.RUNNING
    assert (r.ranks["2"].status, r.ranks["2"].ended_at) == (RankStatus.DROPPED, 1004.0)
    assert r.ranks["2"].started_at == 1000.0
    assert {k: v.status for k, v in r.ranks.items()} == {"0": RankStatus.RUNNING, "1": RankStatus.RUNNING,
                                                         "2": RankStatus.DROPPED}
    assert r.timeline[-1].model_dump(mode="json") == {
        "status": "running", "at": 1004.0, "attempt": 0, "world_size": 2,
        "reason": "gpu client c3 lost: rank(s) 2 dropped, 2 worker(s) go on"}
    assert job.drop([1, 0], "x") is False  # nobody would go on: the caller interrupts instead
    assert store.get_job("j1").ranks["0"].status == RankStatus.RUNNING


def test_nothing_is_dropped_from_a_job_that_is_not_running_or_for_no_rank(store, clock):
    job = diloco_running(store, clock)
    assert job.drop([], "nobody") is False
    assert job.cancel("stop")
    assert job.drop([1], "late") is False
    assert store.get_job("j1").ranks["1"].status != RankStatus.DROPPED


def test_a_worker_joins_in_a_dropped_ranks_place(store, clock):
    job = diloco_running(store, clock)
    assert job.drop([1], "gpu client c2 lost")
    clock.advance(9)
    entry = PlacementEntry(rank=1, client_id="c4", hostname="host-c4", gpu_index=0, kind="cpu")
    assert job.join(entry, "c4:0", "hash-new")
    r = store.get_job("j1")
    assert [(p.rank, p.client_id) for p in r.placement] == [(0, "c1"), (1, "c4"), (2, "c3")]
    assert (r.rank_keys["1"].hash, r.rank_keys["1"].client_id, r.rank_keys["1"].attempt) == ("hash-new", "c4", 0)
    assert r.rank_keys["0"].hash == "hash-0"
    assert (r.joins["1"].client_id, r.joins["1"].placed_at) == ("c4", 1009.0)
    assert r.timeline[-1].model_dump(mode="json") == {
        "status": "running", "at": 1009.0, "attempt": 0, "world_size": 3,
        "reason": "gpu client c4 joined as rank 1 (in the dropped worker's place; it starts from the global "
                  "weights at the next round)"}
    assert {s["id"]: s["job_id"] for s in store.list_slots("r1")}["c4:0"] == "j1"
    taken = PlacementEntry(rank=1, client_id="c1", hostname="host-c1", gpu_index=0, kind="cpu")
    assert not job.join(taken, "c1:0", "hash-other")  # that slot is the job's rank 0's
    assert store.get_job("j1").rank_keys["1"].hash == "hash-new"
