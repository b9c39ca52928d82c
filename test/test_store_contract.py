"""One suite of store behaviour, run against every backend: the embedded SQLite file and
MongoDB over its wire protocol (nx-27017, or the server ZWDX_TEST_MONGO_URI names).

    python -m pytest test/test_store_contract.py -q
    ZWDX_TEST_MONGO_URI=mongodb://localhost:27017 python -m pytest test/test_store_contract.py -q -k mongo
"""
from __future__ import annotations

import hashlib
import io
import os
import tracemalloc

import pytest

from store_backends import *  # noqa: F401,F403  (fixtures: backend, store, artifact_store)
from store_backends import job_record
from zwdx.errors import IntegrityError, PayloadTooLarge, SchemaVersionError, StoreError
from zwdx.protocol import JobStatus
from zwdx.protocol.job import PlacementEntry
from zwdx.server.store import SCHEMA_VERSION, base


# -- helpers -----------------------------------------------------------------------------------
def make_room(store, room_id="r1"):
    return store.create_room({"id": room_id, "name": f"room {room_id}", "created_at": 1.5})


def make_client(store, client_id="c1", room_id="r1", gpus=2, **extra):
    client = {"id": client_id, "room_id": room_id, "hostname": f"host-{client_id}", "status": "online",
              "last_seen": 10.0, "versions": {"python": "3.11.7"}, **extra}
    slots = [{"id": f"{client_id}:{i}", "client_id": client_id, "room_id": room_id, "index": i, "kind": "cuda",
              "name": "GPU", "memory_total": 80, "memory_free": 80, "utilization": 0} for i in range(gpus)]
    store.upsert_client(client, slots)
    return client, slots


def make_job(store, job_id, room_id="r1", status="queued", world_size=2):
    return store.create_job(job_record(job_id, room_id, status, world_size))


def held_by(store, room_id="r1"):
    return {s["id"]: (s["job_id"], s["rank"]) for s in store.list_slots(room_id)}


# -- lifecycle and schema ----------------------------------------------------------------------
def test_fresh_store_answers_and_records_the_schema_version(store):
    assert store.ping() is True
    assert store.schema_version() == SCHEMA_VERSION


def test_a_store_written_by_a_newer_zwdx_is_refused_with_a_clear_error(backend):
    backend.open().close()
    backend.set_schema_version(SCHEMA_VERSION + 1)
    with pytest.raises(SchemaVersionError) as err:
        backend.open()
    assert err.value.found == SCHEMA_VERSION + 1 and err.value.supported == SCHEMA_VERSION
    assert "upgrade zwdx" in str(err.value)


def test_an_older_store_is_migrated_to_the_current_version(backend, monkeypatch):
    first = backend.open()
    make_room(first)
    first.close()
    step, ran = backend.migration_probe()
    monkeypatch.setattr(base, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    monkeypatch.setattr(backend.module, "MIGRATIONS", {SCHEMA_VERSION: step})
    store = backend.open()
    assert store.schema_version() == SCHEMA_VERSION + 1
    assert ran()
    assert store.get_room("r1")["name"] == "room r1"  # the data came along


def test_an_unreachable_mongodb_is_a_clear_error_that_hides_the_password():
    from procs import free_port
    from zwdx.errors import StoreError
    from zwdx.server.store import open_store
    port = free_port()
    with pytest.raises(StoreError) as err:
        open_store("", f"mongodb://zwdx:s3cret@127.0.0.1:{port}/jobs?serverSelectionTimeoutMS=300")
    assert f"cannot reach MongoDB at 127.0.0.1:{port}/jobs" in str(err.value)
    assert "s3cret" not in str(err.value)


def test_everything_written_is_there_when_the_store_is_opened_again(backend):
    store = backend.open()
    make_room(store)
    store.add_credential({"id": "k1", "room_id": "r1", "role": "submitter", "name": "", "hash": "h-r1",
                          "created_at": 1.5, "rotated_at": None, "revoked_at": None, "legacy": False})
    make_client(store)
    make_job(store, "j1")
    make_job(store, "j2")
    assert store.reserve_slots("j1", [("c1:0", 0)], {"status": "starting"})
    store.add_events("j1", [{"kind": "metric", "rank": 0, "key": "k1", "step": 0, "data": {"loss": 1.0}, "ts": 3.0}])
    store.add_artifact({"id": "a1", "room_id": "r1", "kind": "weights", "size": 3, "sha256": "x", "job_id": "j1",
                        "created_at": 4.0})
    store.close()

    again = backend.open()
    assert again.get_room("r1")["name"] == "room r1" and again.find_credential("h-r1")["room_id"] == "r1"
    assert [j.id for j in again.list_jobs("r1", ["queued"])] == ["j2"]
    assert again.get_job("j1").status == "starting"
    assert held_by(again)["c1:0"] == ("j1", 0)
    assert [e["data"] for e in again.get_events("j1")] == [{"loss": 1.0}]
    assert again.list_artifacts("j1")[0]["id"] == "a1"
    assert again.get_client("c1")["hostname"] == "host-c1"


def test_what_the_server_asks_often_is_indexed(backend):
    backend.open()

    def covered(table, *columns, unique=False):
        return any(keys[:len(columns)] == columns and (is_unique or not unique)
                   for keys, is_unique in backend.indexes(table).items())
    assert covered("jobs", "room_id", "status")
    assert covered("events", "job_id", "kind")
    assert covered("events", "job_id", "rank", "key", unique=True)
    assert covered("credentials", "hash", unique=True)
    assert covered("credentials", "room_id")
    assert covered("slots", "job_id")
    assert covered("artifacts", "job_id", "kind")
    if backend.name == "mongo":
        assert covered("events", "job_id", "kind", "step")  # metrics by job and step


# -- rooms -------------------------------------------------------------------------------------
def test_rooms_are_found_by_id(store):
    room = make_room(store, "r1")
    make_room(store, "r2")
    assert store.get_room("r1") == room and store.get_room("r2")["name"] == "room r2"
    assert store.get_room("nope") is None


def test_a_room_stored_twice_is_a_store_error_and_the_first_stays(store):
    make_room(store, "r1")
    with pytest.raises(StoreError):
        store.create_room({"id": "r1", "name": "again", "created_at": 2.0})
    assert store.get_room("r1")["name"] == "room r1"


def test_a_failed_statement_in_an_embedded_transaction_is_a_store_error_and_changes_nothing(tmp_path):
    from zwdx.server.store.sqlite import SQLiteStore
    store = SQLiteStore(str(tmp_path / "zwdx.sqlite3"))
    with pytest.raises(StoreError) as err:
        with store.db.tx() as db:
            db.execute("INSERT INTO rooms VALUES ('r1', '{}')")
            db.execute("INSERT INTO no_such_table VALUES (1)")
    assert "no such table" in str(err.value)
    assert store.get_room("r1") is None  # rolled back
    with store.db.tx() as db:  # the pooled connection is fine afterwards
        db.execute("INSERT INTO rooms VALUES ('r1', '{\"id\": \"r1\"}')")
    assert store.get_room("r1") == {"id": "r1"}
    store.close()


# -- GPU clients and slots ---------------------------------------------------------------------
def test_clients_are_listed_oldest_first_with_their_slots(store):
    make_client(store, "zz", "r1", gpus=1)
    make_client(store, "aa", "r1", gpus=2)
    make_client(store, "other", "r2", gpus=1)
    make_client(store, "zz", "r1", gpus=1)  # registers again: keeps its place
    clients = store.list_clients("r1")
    assert [c["id"] for c in clients] == ["zz", "aa"]
    assert [s["index"] for s in clients[1]["slots"]] == [0, 1]
    assert all(s["job_id"] is None and s["rank"] is None for c in clients for s in c["slots"])
    assert [c["id"] for c in store.list_clients(None)] == ["zz", "aa", "other"]
    assert store.get_client("aa")["hostname"] == "host-aa"
    assert "slots" not in store.get_client("aa")
    assert store.get_client("nope") is None


def test_clients_past_their_deadline_are_listed_without_the_others(store):
    make_client(store, "c1", "r1", gpus=2, lost_after=5.0)
    make_client(store, "c2", "r1", gpus=1, lost_after=50.0)
    make_client(store, "c3", "r1", gpus=1)  # no deadline: declared lost already
    make_client(store, "c4", "r2", gpus=1, lost_after=1.0)
    make_job(store, "j1")
    assert store.reserve_slots("j1", [("c1:1", 0)], {"status": "starting"})
    assert [c["id"] for c in store.list_clients(None, lost_before=10.0)] == ["c1", "c4"]
    (c1,) = store.list_clients("r1", lost_before=10.0)
    assert [(s["id"], s["job_id"]) for s in c1["slots"]] == [("c1:0", None), ("c1:1", "j1")]
    assert store.touch_client("c1", {"lost_after": 100.0}, [])
    assert [c["id"] for c in store.list_clients(None, lost_before=10.0)] == ["c4"]
    assert store.list_clients("r1", lost_before=1.0) == []


def test_update_client_sets_fields(store):
    make_client(store)
    store.update_client("c1", {"status": "offline", "sid": None, "last_seen": 99.5})
    client = store.get_client("c1")
    assert (client["status"], client["sid"], client["last_seen"], client["hostname"]) == \
        ("offline", None, 99.5, "host-c1")


def test_a_heartbeat_sets_the_client_and_its_slot_stats_by_index(store):
    make_client(store, lost_after=20.0)
    assert store.touch_client("c1", {"last_seen": 1732000000.125, "lost_after": 1732000008.125},
                              [{"index": 1, "memory_free": 7, "utilization": 55}, {"index": 9, "memory_free": 1}],
                              expect_status="online") is True
    client = store.get_client("c1")
    assert (client["last_seen"], client["lost_after"]) == (1732000000.125, 1732000008.125)
    assert (client["hostname"], client["versions"]) == ("host-c1", {"python": "3.11.7"})
    slots = {s["index"]: s for s in store.list_slots("r1")}
    assert (slots[1]["memory_free"], slots[1]["utilization"], slots[1]["name"]) == (7, 55, "GPU")
    assert (slots[0]["memory_free"], slots[0]["utilization"]) == (80, 0)
    assert sorted(slots) == [0, 1]  # no slot made up for index 9
    assert store.touch_client("c1", {}, [{"index": 0, "utilization": None}]) is True  # stats alone
    assert store.list_slots("r1")[0]["utilization"] is None


def test_a_heartbeat_of_a_client_not_in_the_expected_status_changes_nothing(store):
    make_client(store, gpus=1)
    make_client(store, "c2", gpus=1)
    store.update_client("c1", {"status": "offline"})
    assert store.touch_client("c1", {"last_seen": 50.0}, [{"index": 0, "memory_free": 1}],
                              expect_status="online") is False
    assert store.touch_client("nope", {"last_seen": 50.0}, [{"index": 0, "memory_free": 1}]) is False
    assert store.get_client("c1")["last_seen"] == 10.0
    assert [s["memory_free"] for s in store.list_slots("r1")] == [80, 80]
    assert store.touch_client("c1", {"last_seen": 50.0}, []) is True  # any status when none is expected
    assert store.get_client("c1")["last_seen"] == 50.0


def test_heartbeats_written_together_change_only_the_clients_in_the_expected_status(store):
    make_client(store, gpus=1)
    make_client(store, "c2", gpus=1)
    store.update_client("c2", {"status": "offline"})
    missed = store.touch_clients([("c1", {"last_seen": 50.0}, [{"index": 0, "memory_free": 3}]),
                                  ("c2", {"last_seen": 50.0}, [{"index": 0, "memory_free": 3}]),
                                  ("nope", {"last_seen": 50.0}, [])], expect_status="online")
    assert sorted(missed) == ["c2", "nope"]
    assert (store.get_client("c1")["last_seen"], store.get_client("c2")["last_seen"]) == (50.0, 10.0)
    assert {s["client_id"]: s["memory_free"] for s in store.list_slots("r1")} == {"c1": 3, "c2": 80}


def test_the_clients_of_a_dead_server_process_are_released_unless_registered_elsewhere(store):
    make_client(store, "c1", server="p1", sid="s1")
    make_client(store, "c2", server="p2", sid="s2")
    make_client(store, "c3", server="p1", sid="s3")
    store.update_client("c3", {"status": "offline"})  # disconnected already: left as it is
    assert store.release_clients_of("p1", {"status": "offline", "sid": None, "lost_after": 70.0}) == ["c1"]
    c1 = store.get_client("c1")
    assert (c1["status"], c1["sid"], c1["lost_after"], c1["hostname"]) == ("offline", None, 70.0, "host-c1")
    assert store.get_client("c2")["status"] == "online" and store.get_client("c3")["sid"] == "s3"
    assert store.release_clients_of("p1", {"status": "offline"}) == []


def test_registering_again_keeps_busy_slots_and_drops_free_ones_that_vanished(store):
    make_room(store)
    make_client(store, gpus=3)
    make_job(store, "j1")
    assert store.reserve_slots("j1", [("c1:2", 0)], {"status": "starting"})
    make_client(store, gpus=1, hostname="renamed")  # now offers only GPU 0
    assert held_by(store) == {"c1:0": (None, None), "c1:2": ("j1", 0)}
    assert store.get_client("c1")["hostname"] == "renamed"


def test_remove_clients_takes_only_the_rooms_offline_idle_ones_seen_before_the_time(store):
    make_room(store)
    make_client(store, "old")                       # offline since 10: goes
    make_client(store, "busy")                      # offline, but a slot still holds a rank: stays
    make_client(store, "recent", last_seen=50.0)    # offline since 50: stays
    make_client(store, "up")                        # online: stays
    make_client(store, "theirs", room_id="r2")      # another room's: stays
    for cid in ("old", "busy", "recent", "theirs"):
        store.update_client(cid, {"status": "offline"})
    make_job(store, "j1")
    assert store.reserve_slots("j1", [("busy:1", 0)], {"status": "starting"})
    assert store.remove_clients("r1", seen_before=20.0) == ["old"]
    assert store.get_client("old") is None and store.list_slots("r1", "old") == []
    assert sorted(c["id"] for c in store.list_clients(None)) == ["busy", "recent", "theirs", "up"]
    assert len(store.list_slots("r1", "busy")) == 2
    assert store.remove_clients("r1", seen_before=20.0) == []
    make_client(store, "old")  # it registers again: a client like any other
    assert store.get_client("old")["status"] == "online"


def test_update_room_sets_its_fields(store):
    make_room(store)
    assert store.update_room("r1", {"client_retention": 3600.0})["client_retention"] == 3600.0
    room = store.get_room("r1")
    assert (room["name"], room["created_at"], room["client_retention"]) == ("room r1", 1.5, 3600.0)
    assert store.update_room("nope", {"client_retention": 1.0}) is None
    assert store.get_room("nope") is None


def test_list_slots_by_room_or_all_or_one_client(store):
    make_client(store, "c1", "r1", gpus=2)
    make_client(store, "c2", "r2", gpus=1)
    assert [s["id"] for s in store.list_slots("r1")] == ["c1:0", "c1:1"]
    assert [s["id"] for s in store.list_slots(None)] == ["c1:0", "c1:1", "c2:0"]
    make_client(store, "c0", "r1", gpus=1)
    assert [s["id"] for s in store.list_slots("r1", "c1")] == ["c1:0", "c1:1"]
    assert [s["id"] for s in store.list_slots(None, "c2")] == ["c2:0"]
    assert store.list_slots("r2", "c1") == []


# -- reservations ------------------------------------------------------------------------------
def test_jobs_are_listed_by_mode_and_the_unsettled_alone_when_asked(store):
    from zwdx.protocol.job import JobSpec, Master
    make_room(store)
    spec = JobSpec(world_size=2, versions={"python": "3.11"}, bundle_artifact="b", bundle_sha256="ab" * 32,
                   parallelism="DILOCO")
    store.create_job(job_record("d1", status="running", spec=spec, master=Master(addr="10.0.0.1", port=1)))
    store.create_job(job_record("r1", status="running", master=Master(addr="10.0.0.1", port=2)))
    store.create_job(job_record("s1", status="starting"))                      # no rendezvous yet
    store.create_job(job_record("s2", status="starting", master=Master(addr="10.0.0.1", port=3)))
    store.create_job(job_record("f1", status="running", failing_since=5.0, master=Master(addr="10.0.0.1", port=4)))
    store.create_job(job_record("p1", status="running", suspect_since=6.0, master=Master(addr="10.0.0.1", port=5)))
    active = ["starting", "running"]
    assert [j.id for j in store.list_jobs(None, active, parallelism="DILOCO")] == ["d1"]
    assert [j.id for j in store.list_jobs("r1", active, parallelism="DDP")] == ["r1", "s1", "s2", "f1", "p1"]
    assert [j.id for j in store.list_jobs("r1", active, unsettled=True)] == ["s1", "f1", "p1"]
    assert [j.id for j in store.list_jobs("r1", ["running"], unsettled=True)] == ["f1", "p1"]


def test_reserve_slots_gives_the_slots_and_moves_the_job(store):
    make_client(store, "c1", gpus=2)
    make_client(store, "c2", gpus=1)
    make_job(store, "j1")
    placement = [PlacementEntry(rank=0, client_id="c1", gpu_index=0)]
    fields = {"status": JobStatus.STARTING, "world_size": 3, "placement": placement, "ranks": {}}
    assert store.reserve_slots("j1", [("c1:0", 0), ("c1:1", 1), ("c2:0", 2)], fields) is True
    assert held_by(store) == {"c1:0": ("j1", 0), "c1:1": ("j1", 1), "c2:0": ("j1", 2)}
    job = store.get_job("j1")
    assert (job.status, job.world_size, job.placement, job.ranks) == ("starting", 3, placement, {})
    assert store.list_jobs("r1", ["queued"]) == []


def test_reserve_slots_changes_nothing_when_one_slot_is_taken(store):
    make_client(store, gpus=3)
    make_job(store, "j1")
    make_job(store, "j2")
    assert store.reserve_slots("j1", [("c1:1", 0)], {"status": "starting"})
    assert store.reserve_slots("j2", [("c1:0", 0), ("c1:1", 1), ("c1:2", 2)], {"status": "starting"}) is False
    assert held_by(store) == {"c1:0": (None, None), "c1:1": ("j1", 0), "c1:2": (None, None)}
    assert store.get_job("j2").status == "queued"


def test_reserve_slots_changes_nothing_when_the_job_is_not_queued(store):
    make_client(store)
    make_job(store, "j1", status="cancelled")
    assert store.reserve_slots("j1", [("c1:0", 0)], {"status": "starting"}) is False
    assert store.reserve_slots("nope", [("c1:1", 0)], {"status": "starting"}) is False
    assert held_by(store) == {"c1:0": (None, None), "c1:1": (None, None)}
    assert store.get_job("j1").status == "cancelled"


def test_reserve_slots_takes_a_resuming_job_too(store):
    make_client(store)
    make_job(store, "j1", status="resuming")
    assert store.reserve_slots("j1", [("c1:1", 0)], {"status": "starting", "attempt": 1})
    assert (store.get_job("j1").status, held_by(store)["c1:1"]) == ("starting", ("j1", 0))


def test_a_job_is_reserved_once(store):
    make_client(store, gpus=2)
    make_job(store, "j1")
    assert store.reserve_slots("j1", [("c1:0", 0)], {"status": "starting"})
    assert store.reserve_slots("j1", [("c1:1", 0)], {"status": "starting"}) is False
    assert held_by(store)["c1:1"] == (None, None)


def test_release_slots_frees_the_jobs_slots_or_one_clients(store):
    make_client(store, "c1", gpus=2)
    make_client(store, "c2", gpus=1)
    make_job(store, "j1")
    assert store.reserve_slots("j1", [("c1:0", 0), ("c1:1", 1), ("c2:0", 2)], {"status": "starting"})
    assert store.release_slots("j1", "c2") == 1
    assert held_by(store)["c2:0"] == (None, None)
    assert store.release_slots("j1") == 2
    assert store.release_slots("j1") == 0
    assert set(held_by(store).values()) == {(None, None)}
    make_job(store, "j2")
    assert store.reserve_slots("j2", [("c1:0", 0)], {"status": "starting"})  # free again


# -- events ------------------------------------------------------------------------------------
def metric(rank, key, step, **data):
    return {"kind": "metric", "rank": rank, "key": key, "step": step, "data": data, "ts": 100.0 + step}


def test_events_get_increasing_seq_per_job_and_resent_ones_are_dropped(store):
    first = store.add_events("j1", [metric(0, "a", 0, loss=2.0), metric(1, "a", 0, loss=2.1)])
    assert [e["seq"] for e in first] == [1, 2]
    assert first[0] == {**metric(0, "a", 0, loss=2.0), "seq": 1}
    again = store.add_events("j1", [metric(0, "a", 0, loss=2.0), metric(0, "b", 1, loss=1.5),
                                    metric(0, "b", 1, loss=1.5)])
    assert [(e["key"], e["seq"]) for e in again] == [("b", 3)]
    assert store.add_events("j1", [metric(1, "a", 0, loss=9.9)]) == []
    other = store.add_events("j2", [metric(0, "a", 0, loss=5.0)])
    assert [e["seq"] for e in other] == [1]
    assert [(e["rank"], e["key"], e["data"]["loss"]) for e in store.get_events("j1")] == \
        [(0, "a", 2.0), (1, "a", 2.1), (0, "b", 1.5)]
    assert store.add_events("j1", []) == []


def test_event_batches_of_several_jobs_are_stored_once_each_in_order(store):
    stored = store.add_event_batches([("j1", [metric(0, "a", 0, loss=1.0)]), ("j2", [metric(0, "a", 0, loss=2.0)]),
                                      ("j1", [metric(0, "a", 0, loss=1.0), metric(0, "b", 1, loss=0.5)])])
    assert [[(e["key"], e["seq"]) for e in batch] for batch in stored] == [[("a", 1)], [("a", 1)], [("b", 2)]]
    assert [e["key"] for e in store.get_events("j1")] == ["a", "b"]
    assert store.add_event_batches([]) == []


def test_get_events_after_a_seq_by_kind_and_limited(store):
    events = []
    for i in range(6):
        events.append(metric(0, f"m{i}", i, loss=float(i)))
        events.append({"kind": "log", "rank": 0, "key": f"l{i}", "step": None, "data": {"text": f"line {i}"},
                       "ts": 1.0})
    store.add_events("j1", events)
    assert [e["seq"] for e in store.get_events("j1", after=9)] == [10, 11, 12]
    assert [e["data"]["text"] for e in store.get_events("j1", kind="log", after=4, limit=2)] == ["line 2", "line 3"]
    assert [e["step"] for e in store.get_events("j1", kind="metric")] == [0, 1, 2, 3, 4, 5]
    assert store.get_events("j1", after=12) == []
    assert store.get_events("nope") == []
    assert all("job_id" not in e for e in store.get_events("j1"))


def test_events_are_counted_to_their_jobs_room_once_each(store):
    from zwdx.server.store.base import event_bytes
    make_job(store, "j1")
    make_job(store, "j2", room_id="r2")
    assert store.room_event_usage("r1") == {"events": 0, "bytes": 0} and store.last_event_seq("j1") == 0
    stored = store.add_events("j1", [metric(0, "a", 0, loss=2.0), metric(0, "b", 1, loss="NaN", acc=None)])
    stored += store.add_events("j1", [metric(0, "a", 0, loss=2.0), metric(1, "a", 2, loss=1.0)])  # "a" of rank 0: again
    store.add_events("j2", [metric(0, "a", 0, loss=5.0)])
    assert store.room_event_usage("r1") == {"events": 3, "bytes": sum(map(event_bytes, stored))}
    assert store.room_event_usage("r2")["events"] == 1 and store.last_event_seq("j1") == 3
    assert store.add_events("nope", [metric(0, "a", 0, loss=1.0)])  # a job the store lacks: stored, counted nowhere
    assert store.room_event_usage("r1")["events"] == 3


# -- artifacts' metadata -----------------------------------------------------------------------
def artifact(artifact_id, job_id="j1", kind="checkpoint"):
    return {"id": artifact_id, "room_id": "r1", "kind": kind, "size": 10, "sha256": "ab" * 32, "job_id": job_id,
            "created_at": 5.0}


def test_artifact_metadata_is_added_listed_updated_and_deleted(store):
    for artifact_id, kind in (("b", "checkpoint"), ("a", "weights"), ("c", "checkpoint")):
        assert store.add_artifact(artifact(artifact_id, kind=kind)) == artifact(artifact_id, kind=kind)
    store.add_artifact(artifact("bundle", job_id=None, kind="bundle"))
    assert [a["id"] for a in store.list_artifacts("j1")] == ["b", "a", "c"]
    assert [a["id"] for a in store.list_artifacts("j1", "checkpoint")] == ["b", "c"]
    assert store.get_artifact("a") == artifact("a", kind="weights")
    store.update_artifact("bundle", {"job_id": "j1"})
    assert store.get_artifact("bundle")["job_id"] == "j1"
    assert [a["id"] for a in store.list_artifacts("j1", "bundle")] == ["bundle"]
    store.delete_artifact("b")
    assert store.get_artifact("b") is None
    assert [a["id"] for a in store.list_artifacts("j1")] == ["a", "c", "bundle"]
    assert store.get_artifact("nope") is None


def test_a_rooms_artifact_is_found_by_kind_and_sha256(store):
    """A script job's working dir is looked up by its bytes' sha256, in its own room only."""
    first = {**artifact("w1", job_id=None, kind="workdir"), "sha256": "cd" * 32}
    store.add_artifact(first)
    store.add_artifact({**first, "id": "w2"})  # the same bytes, uploaded twice at once: the older is found
    store.add_artifact({**first, "id": "w3", "room_id": "r2"})
    store.add_artifact(artifact("b1", job_id=None, kind="bundle"))
    assert store.find_artifact("r1", "workdir", "cd" * 32)["id"] == "w1"
    assert store.find_artifact("r2", "workdir", "cd" * 32)["id"] == "w3"
    assert store.find_artifact("r1", "bundle", "cd" * 32) is None
    assert store.find_artifact("r1", "workdir", "ef" * 32) is None
    assert store.find_artifact("r3", "workdir", "cd" * 32) is None
    assert [a["id"] for a in store.list_room_artifacts("r1", "workdir")] == ["w1", "w2"]
    assert [a["id"] for a in store.list_room_artifacts("r2", "workdir")] == ["w3"]
    assert store.list_room_artifacts("r1", "dataset") == []


# -- artifact bytes (files in the data dir, or GridFS) -----------------------------------------
#: A repeating pattern, 1 MiB and one period long: any 1 MiB window of the stream is a slice of it.
PATTERN = bytes(i % 251 for i in range(1024 * 1024 + 251))


class Chunked(io.RawIOBase):
    """``size`` bytes of a repeating pattern, made as they are read, never all at once."""

    def __init__(self, size: int):
        self.size, self.pos = size, 0

    def readable(self):
        return True

    def readinto(self, buf):
        n = min(len(buf), self.size - self.pos, 1024 * 1024)
        start = self.pos % 251
        buf[:n] = PATTERN[start:start + n]
        self.pos += n
        return n


def sha_of(size: int) -> str:
    digest, stream = hashlib.sha256(), Chunked(size)
    while block := stream.read(1 << 20):
        digest.update(block)
    return digest.hexdigest()


def test_artifact_bytes_round_trip_in_chunks(artifact_store):
    data = os.urandom(3 * 1024 * 1024 + 17)
    size, sha = artifact_store.store.save("a1", io.BytesIO(data), max_bytes=len(data),
                                          expected_sha256=hashlib.sha256(data).hexdigest().upper())
    assert (size, sha) == (len(data), hashlib.sha256(data).hexdigest())
    chunks = list(artifact_store.store.open("a1"))
    assert b"".join(chunks) == data
    assert len(chunks) > 1 and max(len(c) for c in chunks) <= 1024 * 1024
    assert b"".join(artifact_store.reopen().open("a1")) == data  # a restarted server reads it


def test_a_corrupt_upload_keeps_nothing(artifact_store):
    with pytest.raises(IntegrityError):
        artifact_store.store.save("a1", io.BytesIO(b"x" * 600_000), max_bytes=10**9, expected_sha256="0" * 64)
    with pytest.raises(FileNotFoundError):
        artifact_store.store.open("a1")
    assert artifact_store.held() == []


def test_an_upload_over_the_limit_keeps_nothing(artifact_store):
    with pytest.raises(PayloadTooLarge):
        artifact_store.store.save("a1", Chunked(3 * 1024 * 1024), max_bytes=2 * 1024 * 1024)
    with pytest.raises(FileNotFoundError):
        artifact_store.store.open("a1")
    assert artifact_store.held() == []


def test_deleted_bytes_are_gone_and_deleting_twice_is_fine(artifact_store):
    artifact_store.store.save("a1", io.BytesIO(b"abc"), max_bytes=10)
    artifact_store.store.save("a2", io.BytesIO(b""), max_bytes=10)
    assert b"".join(artifact_store.store.open("a2")) == b""
    artifact_store.store.delete("a1")
    artifact_store.store.delete("a1")
    with pytest.raises(FileNotFoundError):
        artifact_store.store.open("a1")
    assert artifact_store.held() == ["a2"]


def test_artifacts_stream_through_without_being_held_whole_in_memory(artifact_store):
    size = 24 * 1024 * 1024
    tracemalloc.start()
    try:
        saved = artifact_store.store.save("big", Chunked(size), max_bytes=size, expected_sha256=sha_of(size))
        _, peak_save = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        digest, total = hashlib.sha256(), 0
        for block in artifact_store.store.open("big"):
            digest.update(block)
            total += len(block)
        _, peak_read = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert saved == (size, digest.hexdigest()) and total == size
    assert peak_save < size / 3, f"saving {size} bytes peaked at {peak_save} bytes of Python memory"
    assert peak_read < size / 3, f"reading {size} bytes peaked at {peak_read} bytes of Python memory"


# -- leases (the scheduler's, across server processes) ----------------------------------------
def test_a_lease_has_one_holder_until_it_expires_or_is_given_up(store):
    assert store.lease_holder("scheduler", now=100.0) is None
    assert store.take_lease("scheduler", "a", ttl=10, now=100.0) == 110.0
    assert store.take_lease("scheduler", "b", ttl=10, now=105.0) is None  # a's, and not expired
    assert store.lease_holder("scheduler", now=105.0) == "a"
    assert store.take_lease("scheduler", "a", ttl=10, now=108.0) == 118.0  # renewed
    assert store.take_lease("scheduler", "b", ttl=10, now=117.0) is None
    assert store.take_lease("scheduler", "b", ttl=10, now=119.0) == 129.0  # expired: taken over
    assert store.lease_holder("scheduler", now=120.0) == "b"
    assert store.take_lease("scheduler", "a", ttl=10, now=120.0) is None  # a lost it for good
    assert store.take_lease("other", "a", ttl=10, now=120.0) == 130.0  # leases are independent
    assert not store.release_lease("scheduler", "a")  # not a's to give up
    assert store.release_lease("scheduler", "b")
    assert store.lease_holder("scheduler", now=120.0) is None
    assert store.take_lease("scheduler", "a", ttl=10, now=121.0) == 131.0  # free again


def test_holders_racing_for_an_expired_lease_get_it_once(backend):
    from concurrent.futures import ThreadPoolExecutor
    stores = [backend.open() for _ in range(4)]
    stores[0].take_lease("scheduler", "old", ttl=1, now=50.0)
    for round_ in range(5):
        now = 100.0 + 10 * round_
        with ThreadPoolExecutor(len(stores)) as pool:
            taken = list(pool.map(lambda i: stores[i].take_lease("scheduler", f"h{i}", ttl=5, now=now),
                                  range(len(stores))))
        winners = [i for i, t in enumerate(taken) if t is not None]
        assert len(winners) == 1, taken
        assert stores[0].lease_holder("scheduler", now=now) == f"h{winners[0]}"


def test_a_users_integers_past_64_bits_come_back_whole_or_are_refused_changing_nothing(store, backend):
    store.create_job(job_record("big", results={"n": 1}))
    big = 2 ** 70 + 1  # a float would lose the + 1
    if backend.name == "mongo":  # BSON has integers of up to 8 bytes: the write is refused whole
        with pytest.raises(OverflowError, match="8-byte ints"):  # the API answers it with a 400
            store.set_job("big", {"results": {"n": big}, "final_loss": 0.5})
        assert (store.get_job("big").results, store.get_job("big").final_loss) == ({"n": 1}, None)
        return
    store.set_job("big", {"results": {"n": big}})
    assert store.get_job("big").results == {"n": big}
    store.set_job("big", {"final_loss": 0.5})  # a later write keeps it whole
    assert store.get_job("big").results == {"n": big}
    store.add_events("big", [metric(0, "a", 0, loss=2.0, count=big)])
    assert store.get_events("big")[0]["data"]["count"] == big
