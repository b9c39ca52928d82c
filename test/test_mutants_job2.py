"""zwdx/server/jobs/model.py, checked where mutation testing (bench/mutation.py) found nothing
looking: a rank's layout, what a completed rank keeps and whose result is the job's, a DILOCO
job's workers dropped at every corner, ranks that exited before reporting, restarts given up, and
each guarded move refused to a handle that lost a race. In-process on a real SQLite store with a
fake clock (test_job.py's fixtures)."""
from __future__ import annotations

from test_job import clock, place, store, submit  # noqa: F401  (clock, store: fixtures)
from zwdx.protocol import FailureKind, JobStatus, LayoutRole, RankStatus
from zwdx.protocol.job import PlacementEntry, RankState
from zwdx.protocol.layout import RankLayout
from zwdx.server.jobs import Job


def running(store, clock, world: int, ranks=None, **spec) -> Job:
    """A job of ``world`` ranks on one GPU client's CPU slots, ``ranks`` of them running (all)."""
    store.upsert_client({"id": "big", "room_id": "r1", "hostname": "host-big", "status": "online"},
                        [{"id": f"big:{i}", "client_id": "big", "room_id": "r1", "index": i, "kind": "cpu"}
                         for i in range(world)])
    job = submit(store, clock, world_size=world, **spec)
    placement = [PlacementEntry(rank=r, client_id="big", hostname="host-big", gpu_index=r, kind="cpu")
                 for r in range(world)]
    assert job.start(placement, [f"big:{r}" for r in range(world)], {r: f"hash-{r}" for r in range(world)})
    for rank in range(world) if ranks is None else ranks:
        job.rank_running(rank)
    return job


def diloco(store, clock, world: int, ranks=None, per: int = 1) -> Job:
    return running(store, clock, world, ranks, parallelism="DILOCO", diloco={"ranks_per_worker": per})


def stale(job: Job) -> Job:
    """A second handle on the job, whose record another one then ends."""
    other = Job.load(job.store, job.id, job.clock)
    assert other.cancel("stopped elsewhere")
    return job


# -- loading, undoing a placement ------------------------------------------------------------------
def test_a_loaded_job_keeps_the_clock_and_an_unknown_one_is_none(store, clock):
    submit(store, clock)
    assert Job.load(store, "nope", clock) is None
    loaded = Job.load(store, "j1", clock)
    clock.advance(5)
    assert loaded.cancel("stop") and store.get_job("j1").ended_at == 1005.0


def test_an_undone_placement_of_a_job_that_ran_resumes_and_says_why(store, clock):
    job = submit(store, clock)
    store.set_job("j1", {"restarts": 1})  # it ran before, and kept no checkpoint
    job.refresh()
    assert place(job)
    clock.advance(2)
    assert job.unplace("the server stopped")
    r = store.get_job("j1")
    assert (r.status, r.waiting_reason) == (JobStatus.RESUMING, "the server stopped")
    assert r.timeline[-1].model_dump(mode="json") == {"status": "resuming", "at": 1002.0, "reason": "the server stopped"}


def test_a_handle_that_lost_the_race_undoes_or_fails_no_placement(store, clock):
    job = submit(store, clock)
    assert place(job)
    assert stale(job).unplace("late") is False
    assert job.not_started("late", ["c1"], tries=0) is None
    assert job.complete() is False
    r = store.get_job("j1")
    assert (r.status, r.start_failures, r.avoid) == (JobStatus.CANCELLED, 0, [])


def test_a_stale_handle_completes_no_cancelled_job(store, clock):
    job = running(store, clock, 2)
    done = RankState(status=RankStatus.COMPLETED, started_at=1000.0, ended_at=1000.0)
    store.jobs.rank_states("j1", {0: done, 1: done})
    job.refresh()
    assert stale(job).complete() is False
    assert store.get_job("j1").status == JobStatus.CANCELLED


# -- layouts and results -----------------------------------------------------------------------------
def test_a_running_ranks_layout_is_kept_and_others_are_refused(store, clock):
    job = running(store, clock, 3, ranks=[0, 1])
    layout = RankLayout(role=LayoutRole.REPLICA, text="the whole model", params=12)
    assert job.rank_layout(1, layout) is True
    r = store.get_job("j1")
    assert r.ranks["1"].layout == layout and r.ranks["1"].status == RankStatus.RUNNING
    assert r.ranks["0"].layout is None
    assert job.rank_layout(2, layout) is False  # not running yet
    job.rank_completed(0)
    assert job.rank_layout(0, layout) is False  # done
    assert store.get_job("j1").ranks["0"].layout is None
    assert stale(job).rank_layout(1, layout.model_copy(update={"params": 7})) is False
    assert store.get_job("j1").ranks["1"].layout.params == 12


def test_a_completed_rank_keeps_what_it_was_and_only_rank_0_or_the_weights_uploader_sets_the_result(store, clock):
    job = running(store, clock, 3, ranks=[])
    job.rank_running(0, isolation="user", terms={"gpus": 1})
    layout = RankLayout(role=LayoutRole.SHARD, text="a quarter")
    job.rank_layout(0, layout)
    clock.advance(3)
    assert job.rank_completed(0, "fp0", {"acc": 0.9}, 0.5, None, "gfp0") is False  # the others have not
    state = store.get_job("j1").ranks["0"]
    assert (state.status, state.started_at, state.ended_at, state.fingerprint, state.global_fingerprint) == \
        (RankStatus.COMPLETED, 1000.0, 1003.0, "fp0", "gfp0")
    assert (state.isolation, state.terms, state.layout) == ("user", {"gpus": 1}, layout)
    job.rank_completed(1, "fp1", {"acc": 0.1}, 9.0)  # not rank 0, no weights: not the job's result
    r = store.get_job("j1")
    assert (r.results, r.final_loss, r.weights_artifact) == ({"acc": 0.9}, 0.5, None)
    assert r.ranks["1"].started_at is None and r.ranks["1"].isolation is None
    assert job.rank_completed(2, "fp2", {"acc": 0.7}, 0.25, "weights-2") is True  # the uploader's
    r = store.get_job("j1")
    assert (r.status, r.results, r.final_loss, r.weights_artifact) == (JobStatus.COMPLETED, {"acc": 0.7}, 0.25,
                                                                       "weights-2")


def test_a_rank_that_completes_while_another_never_reported_does_not_complete_the_job(store, clock):
    job = submit(store, clock)
    assert place(job)
    assert job.rank_completed(0) is False
    assert store.get_job("j1").status == JobStatus.STARTING


# -- DILOCO's dropped workers -----------------------------------------------------------------------
def test_dropped_ranks_are_told_in_order_and_workers_counted_by_their_ranks(store, clock):
    job = diloco(store, clock, 12, per=2)
    assert job.drop([10, 2, 3], "gpu clients lost")
    r = store.get_job("j1")
    assert r.timeline[-1].reason == "gpu clients lost: rank(s) 2, 3, 10 dropped, 5 worker(s) go on"
    assert r.timeline[-1].world_size == 9


def test_a_dropped_or_silent_rank_is_not_counted_as_going_on(store, clock):
    job = diloco(store, clock, 3, ranks=[0, 1])  # rank 2 has said nothing yet
    assert job.drop([2], "gpu client lost")
    r = store.get_job("j1")
    assert (r.ranks["2"].status, r.ranks["2"].started_at) == (RankStatus.DROPPED, None)
    assert job.drop([1], "another lost")
    r = store.get_job("j1")
    assert (r.timeline[-1].world_size, r.timeline[-1].reason) == (1, "another lost: rank(s) 1 dropped, 1 worker(s) go on")
    entry = PlacementEntry(rank=1, client_id="c1", hostname="host-c1", gpu_index=0, kind="cpu")
    assert job.join(entry, "c1:0", "hash-new")
    assert store.get_job("j1").timeline[-1].world_size == 2  # rank 1 back; rank 2 still dropped


def test_no_worker_is_dropped_when_the_others_are_done_and_none_uploaded_the_weights(store, clock):
    job = diloco(store, clock, 3)
    job.rank_completed(0)
    job.rank_completed(1)
    assert job.drop([2], "lost") is False
    assert store.get_job("j1").ranks["2"].status == RankStatus.RUNNING


def test_a_worker_dropped_after_the_others_uploaded_the_weights_completes_the_job(store, clock):
    job = diloco(store, clock, 3)
    job.rank_completed(0)
    job.rank_completed(1, weights_artifact="weights-1")
    assert job.drop([2], "lost") is True
    r = store.get_job("j1")
    assert (r.status, r.ranks["2"].status, r.weights_artifact) == (JobStatus.COMPLETED, RankStatus.DROPPED, "weights-1")


def test_a_stale_handle_drops_nothing(store, clock):
    job = diloco(store, clock, 3)
    assert stale(job).drop([2], "lost") is False
    assert store.get_job("j1").ranks["2"].status == RankStatus.RUNNING


# -- ranks that exited, restarts given up ------------------------------------------------------------
def test_ranks_that_exited_before_reporting_make_the_job_suspect_naming_each(store, clock):
    job = running(store, clock, 3)
    clock.advance(5)
    assert job.ranks_exited({"1": 9, "0": 1, "2": 0}) is True
    r = store.get_job("j1")
    assert r.suspect_since == 1005.0
    assert r.suspect_reason == "rank process died (rank 0 exit code 1, rank 1 exit code 9)"
    assert {k: (f.at, f.kind, f.traceback) for k, f in r.failures.items()} == {
        "0": (1005.0, FailureKind.EXITED, "rank process exited with code 1 before reporting"),
        "1": (1005.0, FailureKind.EXITED, "rank process exited with code 9 before reporting")}


def test_a_job_out_of_restarts_fails_naming_each_earlier_one(store, clock):
    job = running(store, clock, 2, max_restarts=2)
    assert job.interrupt("first") == JobStatus.RESUMING
    job = running_again(job)
    assert job.interrupt("second") == JobStatus.RESUMING
    job = running_again(job)
    assert job.interrupt("third") == JobStatus.FAILED
    assert store.get_job("j1").reason == "third; gave up after 2 restart(s) (first; second)"


def running_again(job: Job) -> Job:
    job.store.release_slots(job.id)
    job.refresh()
    placement = [PlacementEntry(rank=r, client_id="big", hostname="host-big", gpu_index=r, kind="cpu") for r in range(2)]
    assert job.start(placement, ["big:0", "big:1"], {0: "h0", 1: "h1"})
    job.rank_running(0)
    return job


def test_a_job_with_no_restarts_fails_at_once_without_a_history(store, clock):
    job = running(store, clock, 2, max_restarts=0)
    assert job.interrupt("lost") == JobStatus.FAILED
    assert store.get_job("j1").reason == "lost; gave up after 0 restart(s)"


# -- a move's own words, and what it says of a race lost halfway -------------------------------------
def test_a_placement_on_gpus_meets_over_nccl_and_its_note_is_on_the_timeline(store, clock):
    job = submit(store, clock)
    placement = [PlacementEntry(rank=r, client_id=c, hostname=f"host-{c}", gpu_index=0, kind="cuda")
                 for r, c in enumerate(("c1", "c2"))]
    assert job.start(placement, ["c1:0", "c2:0"], {0: "h0", 1: "h1"}, note="two GPUs")
    r = store.get_job("j1")
    assert r.backend == "nccl"
    assert r.timeline[-1].model_dump(mode="json") == {"status": "starting", "at": 1000.0, "attempt": 0,
                                                      "world_size": 2, "reason": "two GPUs"}


def cancelled_after(monkeypatch, owner, name: str) -> None:
    """``owner.name`` (a store's method, or a JobVerbs one) does its write, then another server
    cancels the job: a race lost halfway."""
    original = getattr(owner, name)

    def then_cancel(*args, **kwargs):
        out = original(*args, **kwargs)
        Job.load(args[0].store if isinstance(owner, type) else owner, "j1").cancel("stopped elsewhere")
        return out
    monkeypatch.setattr(owner, name, then_cancel)


def test_a_job_cancelled_as_it_was_placed_keeps_its_slots_and_says_it_is_cancelled(store, clock, monkeypatch):
    job = submit(store, clock)
    cancelled_after(monkeypatch, store, "reserve_slots")
    assert place(job) is True  # the slots are its: the caller lets them go
    assert job.status == JobStatus.CANCELLED
    assert [t.status.value for t in store.get_job("j1").timeline] == ["queued", "cancelled"]


def test_a_job_cancelled_as_a_worker_was_dropped_or_joined_gets_no_running_note(store, clock, monkeypatch):
    from zwdx.server.store.job_verbs import JobVerbs
    job = diloco(store, clock, 3)
    with monkeypatch.context() as m:
        cancelled_after(m, JobVerbs, "rank_states")
        assert job.drop([2], "lost")
    assert store.get_job("j1").timeline[-1].status == JobStatus.CANCELLED
    store.set_job("j1", {"status": JobStatus.RUNNING})  # as if it had not been
    job.refresh()
    cancelled_after(monkeypatch, JobVerbs, "joined")
    entry = PlacementEntry(rank=2, client_id="c1", hostname="host-c1", gpu_index=0, kind="cpu")
    assert job.join(entry, "c1:0", "hash-new")
    assert [t.status.value for t in store.get_job("j1").timeline][-2:] == ["cancelled", "cancelled"]


def test_a_rank_running_notes_the_attempt_and_a_cancel_its_reason(store, clock):
    job = running(store, clock, 1)
    assert store.get_job("j1").timeline[-1].model_dump(mode="json") == {"status": "running", "at": 1000.0,
                                                                         "attempt": 0}
    assert job.cancel("the submitter said so")
    assert store.get_job("j1").timeline[-1].model_dump(mode="json") == {"status": "cancelled", "at": 1000.0,
                                                                         "reason": "the submitter said so"}


def test_a_script_that_exited_badly_makes_the_job_suspect_with_its_reason(store, clock):
    job = running(store, clock, 2)
    clock.advance(2)
    assert job.rank_failed(1, "exit code 3", "the script's stderr", collective=False, exit_code=3)
    r = store.get_job("j1")
    assert (r.failures["1"].kind, r.failures["1"].at) == (FailureKind.EXITED, 1002.0)
    assert (r.suspect_since, r.suspect_reason, r.failing_since) == (1002.0, "rank 1 failed: exit code 3", None)


def test_a_placement_whose_ranks_never_ran_is_overdue_after_the_start_timeout(store, clock):
    from zwdx.protocol.job import Master
    job = submit(store, clock)
    assert place(job) and job.rendezvous(Master(addr="10.0.0.1", port=29500))
    clock.advance(31)
    assert job.start_overdue(30) == "no rank reported running within 30 s of its placement"
    assert job.start_overdue(40) is None and job.start_overdue(0) is None


def test_a_scripts_outputs_are_kept_while_it_runs_and_not_once_cancelled(store, clock):
    job = running(store, clock, 1)
    assert job.outputs_uploaded("outputs-1") is True
    assert store.get_job("j1").outputs_artifact == "outputs-1"
    assert stale(job).outputs_uploaded("outputs-2") is False
    assert store.get_job("j1").outputs_artifact == "outputs-1"


def test_a_stale_handle_out_of_restarts_says_none(store, clock):
    job = running(store, clock, 2, max_restarts=0)
    assert stale(job).interrupt("lost") is None
    assert store.get_job("j1").status == JobStatus.CANCELLED


def test_a_placement_with_a_shadow_counts_only_the_workers_in_its_world_size(store, clock):
    from zwdx.protocol.job import Shadow
    store.upsert_client({"id": "c3", "room_id": "r1", "hostname": "host-c3", "status": "online"},
                        [{"id": "c3:0", "client_id": "c3", "room_id": "r1", "index": 0, "kind": "cpu"}])
    job = submit(store, clock, parallelism="DILOCO")
    placement = [PlacementEntry(rank=r, client_id=c, hostname=f"host-{c}", gpu_index=0, kind="cpu")
                 for r, c in enumerate(("c1", "c2", "c3"))]
    shadows = {"2": Shadow(of=0, client_id="c3")}
    assert job.start(placement, ["c1:0", "c2:0", "c3:0"], {0: "h0", 1: "h1", 2: "h2"}, shadows=shadows)
    r = store.get_job("j1")
    assert (r.world_size, r.shadows, sorted(r.rank_keys)) == (2, shadows, ["0", "1", "2"])
    assert r.timeline[-1].world_size == 2
