"""The store's job verbs, run against every backend (the embedded SQLite file and MongoDB
over its wire protocol): typed records written whole once, then top-level fields, per-rank
entries and list items, each write applying only in the statuses it names. And a store left
by an earlier layout (schema version 1) opens, migrated, and shows the same jobs; its room's
token is the room's legacy credential.

    python -m pytest test/test_store_jobs.py -q
"""
from __future__ import annotations

import json
import math
import os

import pytest

from store_backends import *  # noqa: F401,F403  (fixtures: backend, store)
from store_backends import job_record
from zwdx.errors import StoreError
from zwdx.protocol import FailureKind, JobStatus, RankStatus
from zwdx.protocol.job import CheckpointEntry, JobView, RankFailure, RankState, RestartEntry, TimelineEntry
from zwdx.protocol.flat import PARTS
from zwdx.server.store import SCHEMA_VERSION

V1 = os.path.join(os.path.dirname(__file__), "data", "store_v1.json")


def make_job(store, job_id, room_id="r1", status="queued", **fields):
    return store.create_job(job_record(job_id, room_id, status, **fields))


def checkpoint(n: int) -> CheckpointEntry:
    return CheckpointEntry(n=n, epoch=n, format="torch", files={"state.pt": f"a{n}"}, at=float(n))


def test_jobs_get_increasing_queue_positions_and_list_in_submission_order(store):
    seqs = [make_job(store, f"j{i}", room_id="r2" if i == 2 else "r1").seq for i in range(5)]
    assert seqs == sorted(seqs) and len(set(seqs)) == 5
    assert [j.id for j in store.list_jobs("r1")] == ["j0", "j1", "j3", "j4"]
    assert [j.id for j in store.list_jobs()] == ["j0", "j1", "j2", "j3", "j4"]
    assert [j.id for j in store.list_jobs("r1", limit=2)] == ["j0", "j1"]
    store.set_job("j1", {"status": JobStatus.RUNNING})
    assert [j.id for j in store.list_jobs("r1", [JobStatus.QUEUED])] == ["j0", "j3", "j4"]
    assert [j.id for j in store.list_jobs(None, iter(["running", "nope"]))] == ["j1"]
    assert store.get_job("j2").room_id == "r2"
    assert store.get_job("nope") is None


def test_count_jobs_gives_a_queued_jobs_place_in_line(store):
    jobs = {f"j{i}": make_job(store, f"j{i}", room_id="r2" if i == 2 else "r1") for i in range(5)}
    store.set_job("j1", {"status": "running"})
    queued = [JobStatus.QUEUED]
    assert store.count_jobs("r1", queued) == 3  # j0, j3, j4
    assert [store.count_jobs("r1", queued, before_seq=jobs[j].seq) for j in ("j0", "j3", "j4")] == [0, 1, 2]
    assert store.count_jobs("r1", ["queued", "running"], before_seq=jobs["j3"].seq) == 2
    assert store.count_jobs("r2", queued) == 1
    assert store.count_jobs("r3", queued) == 0
    assert store.count_jobs("r1", []) == 0
    assert store.job_counts() == {("r1", "queued"): 3, ("r1", "running"): 1, ("r2", "queued"): 1}


def test_a_job_record_round_trips_unchanged(store):
    job = job_record("j1", name="naïve — ünïcode ✓", results={"nested": [1, 2.5, None, True, "x", {"deep": []}],
                                                               "big": 2**40}, final_loss=0.125)
    created = store.create_job(job)
    assert created.seq is not None and created.model_copy(update={"seq": None}) == job
    assert store.get_job("j1") == created


def test_a_diverged_loss_is_kept(store):
    """NaN and infinities are kept, as the strings JSON carries them as ("NaN", "Infinity"), in
    the store too (so nx-27017, which keeps JSON documents, holds them as MongoDB does)."""
    store.create_job(job_record("j1", results={"loss": float("inf"), "curve": [1.0, float("-inf")]},
                                final_loss=float("nan")))
    job = store.get_job("j1")
    assert math.isnan(job.final_loss) and job.results == {"loss": float("inf"), "curve": [1.0, float("-inf")]}
    for view in (JobView.of(job).model_dump_json(), json.dumps(JobView.of(job).model_dump(mode="json"),
                                                               allow_nan=False)):
        assert '"final_loss":"NaN"' in view.replace(" ", "") and '"loss":"Infinity"' in view.replace(" ", "")
        assert '"-Infinity"' in view


def test_a_job_stored_twice_is_a_store_error_and_the_first_stays(store):
    make_job(store, "j1")
    with pytest.raises(StoreError):
        make_job(store, "j1", room_id="r2")
    assert [(j.id, j.room_id) for j in store.list_jobs()] == [("j1", "r1")]


def test_set_job_applies_only_in_the_statuses_it_names(store):
    make_job(store, "j1")
    assert store.set_job("j1", {"status": JobStatus.RUNNING}, when=[JobStatus.STARTING]) is None
    assert store.get_job("j1").status == "queued"
    moved = store.set_job("j1", {"status": JobStatus.CANCELLED, "reason": "by user", "ended_at": 3.0},
                          when=[JobStatus.QUEUED, "starting"])
    assert (moved.status, moved.reason, moved.ended_at) == ("cancelled", "by user", 3.0)
    assert store.get_job("j1") == moved
    assert store.set_job("j1", {"status": "queued"}, when=["queued"]) is None
    assert [j.id for j in store.list_jobs(statuses=["cancelled"])] == ["j1"]
    assert store.set_job("nope", {"reason": "x"}) is None


def test_set_job_unless_set_writes_only_the_first_time(store):
    make_job(store, "j1", status="running")
    first = store.set_job("j1", {"failing_since": 5.0, "failing_reason": "rank 1 failed"}, unless_set="failing_since")
    assert (first.failing_since, first.failing_reason) == (5.0, "rank 1 failed")
    assert store.set_job("j1", {"failing_since": 6.0, "failing_reason": "rank 0 failed"},
                         unless_set="failing_since") is None
    assert (store.get_job("j1").failing_since, store.get_job("j1").failing_reason) == (5.0, "rank 1 failed")


def test_job_verbs_refuse_unknown_fields_and_wrong_values_and_change_nothing(store):
    make_job(store, "j1")
    for bad in ({"no_such_field": 1}, {"id": "j2"}, {"seq": 7}, {"world_size": "many"},
                {"status": "finished"}, {"placement": [{"rank": 0}]}):
        with pytest.raises(ValueError):
            store.set_job("j1", bad)
    with pytest.raises(ValueError):
        store.put_job_entries("j1", "timeline", {"0": {}})  # not a per-rank map
    with pytest.raises(ValueError):
        store.put_job_entries("j1", "ranks", {"0": {"status": "sleeping"}})
    with pytest.raises(ValueError):
        store.append_job("j1", {"ranks": {}})  # not a list
    with pytest.raises(ValueError):
        store.set_job("j1", {"reason": "x"}, unless_set="nope")
    assert store.get_job("j1") == store.list_jobs()[0] and store.get_job("j1").reason is None


def test_put_job_entries_sets_ranks_entries_keeping_the_others(store):
    make_job(store, "j1", status="running")
    store.put_job_entries("j1", "ranks", {0: RankState(status=RankStatus.RUNNING, started_at=5.0)})
    job = store.put_job_entries("j1", "ranks", {"1": RankState(status="running", started_at=6.0)})
    assert job.ranks == {"0": RankState(status="running", started_at=5.0), "1": RankState(status="running", started_at=6.0)}
    job = store.put_job_entries("j1", "ranks", {0: RankState(status="completed", started_at=5.0, ended_at=9.0,
                                                              fingerprint="f")})
    assert (job.ranks["0"].status, job.ranks["0"].fingerprint, job.ranks["1"].status) == ("completed", "f", "running")
    job = store.put_job_entries("j1", "exits", {"0": 0, "1": -9})
    assert job.exits == {"0": 0, "1": -9}
    job = store.put_job_entries("j1", "failures", {1: RankFailure(traceback="Traceback ...", at=7.0, kind="raised")})
    assert job.failures["1"].kind == FailureKind.RAISED
    assert store.put_job_entries("j1", "exits", {"2": 1}, when=["queued"]) is None
    assert store.get_job("j1") == job
    assert store.put_job_entries("nope", "exits", {"0": 0}) is None


def test_append_job_appends_sets_fields_and_keeps_the_last_n_in_one_write(store):
    make_job(store, "j1", status="starting")
    job = store.append_job("j1", {"timeline": TimelineEntry(status="running", at=6.0, attempt=0)},
                           fields={"status": JobStatus.RUNNING, "running_at": 6.0}, when=[JobStatus.STARTING])
    assert (job.status, job.running_at) == ("running", 6.0)
    assert [(t.status, t.at) for t in job.timeline] == [("starting", 2.0), ("running", 6.0)]
    assert store.append_job("j1", {"timeline": TimelineEntry(status="running", at=7.0)},
                            fields={"status": "running"}, when=["starting"]) is None
    assert len(store.get_job("j1").timeline) == 2
    for n in range(4):
        job = store.append_job("j1", {"checkpoints": checkpoint(n)}, fields={"latest_checkpoint": checkpoint(n)},
                               keep_last=2)
    assert [c.n for c in job.checkpoints] == [2, 3] and job.latest_checkpoint.n == 3
    job = store.append_job("j1", {"timeline": TimelineEntry(status="resuming", at=8.0, reason="lost", checkpoint=3),
                                  "restart_history": RestartEntry(at=8.0, reason="lost", from_checkpoint=checkpoint(3))},
                           fields={"status": JobStatus.RESUMING, "restarts": 1}, when=["running"])
    assert (job.status, job.restarts, job.restart_history[0].from_checkpoint.n) == ("resuming", 1, 3)
    assert job.timeline[-1].model_dump(mode="json") == {"status": "resuming", "at": 8.0, "reason": "lost",
                                                        "checkpoint": 3}
    assert store.get_job("j1") == job
    assert store.append_job("nope", {"timeline": TimelineEntry(status="queued", at=1.0)}) is None


# -- the previous layout -----------------------------------------------------------------------
def old_view(doc: dict) -> dict:
    """What the previous zwdx showed of a stored job: the document without its job key hash."""
    return {k: v for k, v in doc.items() if k != "job_key_hash"}


def test_a_store_written_by_the_previous_layout_opens_migrated_and_shows_the_same_jobs(backend):
    with open(V1) as fh:
        v1 = json.load(fh)
    assert v1["schema_version"] == 1 and SCHEMA_VERSION == 3
    backend.write_raw(v1["rooms"], v1["jobs"], schema_version=1)
    store = backend.open()
    assert store.schema_version() == SCHEMA_VERSION
    jobs = {j.name: j for j in store.list_jobs()}
    assert [j.status.value for j in jobs.values()] == ["completed", "failed", "completed", "cancelled", "queued"]
    for doc in v1["jobs"]:
        view = JobView.of(store.get_job(doc["id"])).model_dump(mode="json")
        shown = old_view(doc)
        if isinstance(shown.get("spec"), dict):  # the flat spec of then, each field in its part of the tree now
            part = {k: name for name, keys in PARTS.items() for k in keys}
            view["spec"] = {k: view["spec"][part[k]][k] if k in part else view["spec"][k] for k in shown["spec"]}
        assert {k: view[k] for k in shown} == shown, doc["name"]  # every field the old zwdx showed, unchanged
    failed = jobs["failed"]
    assert set(failed.failures) == {"0", "1"} and all(f.kind == FailureKind.RAISED for f in failed.failures.values())
    assert JobView.of(failed).failure_order == ["1", "0"]  # rank 1 raised first
    resumed = jobs["resumed"]
    assert resumed.restarts == 1 and resumed.restart_history[0].from_checkpoint.format == "torch"
    room = v1["rooms"][0]
    legacy = store.find_credential(room["token_hash"])
    assert (legacy["room_id"], legacy["role"], legacy["legacy"], legacy["revoked_at"]) == \
        (room["id"], "submitter", True, None)
    assert store.list_credentials(room["id"]) == [legacy] and "token_hash" not in store.get_room(room["id"])
    # The old jobs take new writes, and the queued one keeps its place in line.
    queued = jobs["queued"]
    assert store.count_jobs(queued.room_id, ["queued"], before_seq=queued.seq) == 0
    later = make_job(store, "later", room_id=queued.room_id)
    assert later.seq > queued.seq
    assert store.set_job(queued.id, {"status": "cancelled"}, when=["queued"]).status == "cancelled"
    store.close()
    again = backend.open()  # opening it again migrates nothing twice
    assert again.schema_version() == SCHEMA_VERSION and again.get_job(failed.id) == failed
    assert again.list_credentials(room["id"]) == [legacy]
