"""Placement's records of the room view's documents (``placement.records.Kept``, ``RoomViews.kept``):
built once per document, not at every plan and submit; a document the view replaces gets a record
of its own and the old one is dropped; a slot the scheduler marks in place is read again. Plans
with and without them agree. Fast lane, in process."""
from __future__ import annotations

import pytest

from zwdx.server.placement import plan, records, unschedulable
from zwdx.server.roomview import RoomViews, observe
from zwdx.server.store import open_store

SPEC = {"parallelism": "DDP", "kind": "function", "world_size": 2, "memory_required": 0}


def add_clients(store, n, room="r1"):
    for i in range(n):
        cid = f"c{i}"
        store.upsert_client({"id": cid, "room_id": room, "hostname": cid, "status": "online"},
                            [{"id": f"{cid}:{g}", "client_id": cid, "room_id": room, "index": g, "kind": "cuda",
                              "memory_total": 80 << 30, "memory_free": 80 << 30} for g in range(2)])


@pytest.fixture
def views(tmp_path):
    opened = open_store(str(tmp_path / "data"), None)
    kept = RoomViews(opened)
    observe(opened, kept)
    add_clients(opened, 6)
    yield kept
    opened.close()


@pytest.fixture
def built(monkeypatch):
    """How many Client and Slot records were built."""
    counts = {"client": 0, "slot": 0}
    for name, cls in (("client", records.Client), ("slot", records.Slot)):
        made = cls.of.__func__

        def counted(c, *args, _made=made, _name=name, **kwargs):
            counts[_name] += 1
            return _made(c, *args, **kwargs)
        monkeypatch.setattr(cls, "of", classmethod(counted))
    return counts


def slots_of(clients):
    return sorted((s for c in clients.values() for s in c["slots"]), key=lambda s: (s["client_id"], s["index"]))


def test_a_second_plan_over_the_view_builds_no_record_and_agrees(views, built):
    clients = views.of("r1")
    job = {"spec": SPEC, "status": "queued"}
    first = plan(job, slots_of(clients), clients, kept=views.kept)
    assert built == {"client": 6, "slot": 12}
    assert plan(job, slots_of(clients), clients, kept=views.kept) == first == plan(job, slots_of(clients), clients)
    assert unschedulable(SPEC, list(clients.values()), views.kept) is None
    assert built == {"client": 6 + 6, "slot": 12 + 12}  # only the plan without them built any


def test_a_slot_marked_in_place_and_a_client_the_view_read_again_get_new_records(views, built):
    clients = views.of("r1")
    job = {"spec": SPEC, "status": "queued"}
    chosen, _ = plan(job, slots_of(clients), clients, kept=views.kept)
    for rank, slot in enumerate(chosen):  # as the scheduler marks what it reserved, in the pass's view
        slot["job_id"], slot["rank"] = "j1", rank
    again, _ = plan(job, slots_of(clients), clients, kept=views.kept)
    assert not {s["id"] for s in again} & {s["id"] for s in chosen}  # not the slots taken
    assert again == plan(job, slots_of(clients), clients)[0]
    views.store.update_client("c5", {"status": "offline"})
    old = clients["c5"]
    clients = views.of("r1")  # c5 read again: a new document
    assert clients["c5"] is not old and id(old) not in views.kept._clients
    assert not any(id(s) in views.kept._slots for s in old["slots"])
    taken = {s["id"] for s in chosen}
    left, _ = plan(job, [s for s in slots_of(clients) if s["id"] not in taken], clients, kept=views.kept)
    assert left is not None and all(s["client_id"] != "c5" for s in left)  # offline now


def test_a_view_read_whole_keeps_only_the_records_of_what_it_holds(views):
    clients = views.of("r1")
    plan({"spec": SPEC, "status": "queued"}, slots_of(clients), clients, kept=views.kept)
    stray = {"id": "gone", "room_id": "r1", "status": "online", "slots": []}
    views.kept.client(stray)  # a pass that asked for a document the view dropped meanwhile
    views.rebuild()
    fresh = views.of("r1")
    assert set(views.kept._clients) <= {id(c) for c in fresh.values()}
