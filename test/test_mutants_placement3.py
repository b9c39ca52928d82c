"""zwdx/server/placement/plan.py and records.py, checked where mutation testing (bench/mutation.py)
found nothing looking: whole groups of gpus_per_client, TP and FSDP+TP group sizes as they set a
job's ranks, GPU clients that cannot reach each other (and the moment that says so), a mixed-devices
job, the fewest ranks of a resumed job, the order and load slots are taken by, what a waiting job
is told, and which records a plan builds. Through ``plan``, ``unschedulable``, ``room_slots`` and the
records' public functions, on plain documents; fast lane, in process."""
from __future__ import annotations

import time

import pytest

from test_placement_kept import built  # noqa: F401  (a fixture: the Client and Slot records a plan builds)
from zwdx import defaults
from zwdx.protocol import SlotKind
from zwdx.server.placement import Client, Need, Slot, online, plan, room_slots, tree, unschedulable
from zwdx.server.placement.records import Kept

GiB = 1 << 30
FAR = 4_000_000_000.0  # an ``until`` long after any test runs


def slot(cid, index=0, kind="cuda", total=16 * GiB, free=None, job_id=None, sid=None):
    return {"id": sid or f"{cid}:{index}", "client_id": cid, "index": index, "kind": kind, "memory_total": total,
            "memory_free": total if free is None else free, "job_id": job_id}


def client(cid, n=1, kind="cuda", apart=(), host=None, slots=None, status="online"):
    """A GPU client's document with ``n`` free slots (or ``slots``); ``apart``: (peer, until) pairs."""
    return {"id": cid, "status": status, "versions": {"python": "3.11.4"}, "hostname": f"h-{cid}", "host_id": host,
            "unreachable": [{"client_id": p, "until": u} for p, u in apart],
            "slots": slots if slots is not None else [slot(cid, i, kind) for i in range(n)]}


def by_id(*docs):
    return {c["id"]: c for c in docs}


def place(spec, *docs, job=None, **kw):
    clients = by_id(*docs)
    return plan({"spec": {"parallelism": "DDP", **spec}, **(job or {})}, room_slots(clients), clients, **kw)


def ids(docs):
    return None if docs is None else [s["id"] for s in docs]


# -- room_slots -----------------------------------------------------------------------------------
def test_room_slots_are_every_slot_by_client_then_index_as_a_number():
    clients = by_id(client("b", slots=[slot("b", 0, job_id="j")]), client("a", slots=[slot("a", 10), slot("a", 2)]))
    assert ids(room_slots(clients)) == ["a:2", "a:10", "b:0"]


# -- whole groups, TP and FSDP+TP -----------------------------------------------------------------
def test_gpus_per_client_takes_whole_groups_not_the_largest_clients_first_slots():
    chosen, why = place({"world_size": 4, "gpus_per_client": 2}, client("a", 3), client("b", 1), client("c", 2))
    assert (ids(chosen), why) == (["a:0", "a:1", "c:0", "c:1"], "")


def test_fsdp_tp_places_its_world_size_in_groups_of_its_tp_size():
    chosen, _ = place({"parallelism": "FSDP+TP", "world_size": 4, "gpus_per_client": 2}, client("a", 2), client("b", 2))
    assert ids(chosen) == ["a:0", "a:1", "b:0", "b:1"]  # not one group of 2: FSDP+TP has several


def test_fsdp_tp_without_a_size_takes_the_group_that_divides_its_world_size():
    chosen, _ = place({"parallelism": "FSDP+TP", "world_size": 4}, client("a", 3), client("b", 3))
    assert ids(chosen) == ["a:0", "a:1", "b:0", "b:1"]  # groups of 2, not a group of 3 and a stray rank


def test_tp_without_a_size_is_one_group_of_one_clients_slots():
    chosen, _ = place({"parallelism": "TP"}, client("a", 3), client("b", 3))
    assert ids(chosen) == ["a:0", "a:1", "a:2"]


def test_a_tp_record_without_gpus_per_client_waits_for_its_world_size():
    busy = [slot("a", i, job_id="other") for i in range(2)]
    chosen, why = place({"parallelism": "TP", "world_size": 2}, client("a", slots=busy))
    assert chosen is None
    assert why == "waiting for 2 free slot(s); 0 available (2 slot(s) busy or short of free memory)"


def test_unschedulable_counts_only_clients_with_a_whole_tp_group():
    docs = [client("a", 2), client("b", 2)]
    why = unschedulable({"parallelism": "FSDP+TP", "world_size": 8}, docs)
    assert why == ("world_size 8 is more than the 4 slot(s) this room could give the job even with every slot idle "
                   "(4 GPU slot(s); counting only GPU clients with 2 slots for it (FSDP+TP keeps a TP group of 2 on "
                   "one GPU client))")


def test_a_job_without_a_world_size_is_unschedulable_as_one_rank():
    why = unschedulable({"parallelism": "FSDP+TP", "gpus_per_client": 2}, [client("a", 1), client("b", 1)])
    assert why is not None and why.startswith("world_size 1 is more than the 0 slot(s)")


# -- GPU clients apart ----------------------------------------------------------------------------
def test_the_first_group_that_reach_each_other_with_enough_slots_is_taken():
    docs = client("a", 2, apart=[("b", FAR), ("c", FAR)]), client("b", 2), client("c", 1)
    chosen, why = place({"world_size": 2}, *docs, now=0)
    assert (ids(chosen), why) == (["a:0", "a:1"], "")  # a holds the job whole; b and c, larger together, not needed


def reach_reason(pair="gpu clients a (host h-a) and b (host h-b)"):
    return (f"waiting for 2 free slot(s); 1 available ({pair} cannot reach each other: DDP and FSDP need every "
            "GPU client of a job to reach the others (parallelism=\"DILOCO\" syncs through the server))")


def test_clients_apart_at_the_moment_given_are_not_placed_together_and_named():
    docs = client("a", apart=[("b", 1000.0)]), client("b")
    assert place({"world_size": 2}, *docs, now=500) == (None, reach_reason())
    assert ids(place({"world_size": 2}, *docs, now=2000)[0]) == ["a:0", "b:0"]  # apart no longer


def test_without_a_moment_given_apart_is_as_of_now():
    docs = client("a", apart=[("b", time.time() + 3600)]), client("b")
    assert place({"world_size": 2}, *docs) == (None, reach_reason())


def test_diloco_meets_through_the_server_so_clients_apart_do_not_matter():
    docs = client("a", apart=[("b", FAR)]), client("b")
    assert ids(place({"parallelism": "DILOCO", "world_size": 2}, *docs, now=0)[0]) == ["a:0", "b:0"]


def test_a_pair_apart_outside_the_slots_it_could_take_is_not_named():
    docs = client("a", apart=[("z", FAR)]), client("b"), client("z", slots=[slot("z", job_id="other")])
    chosen, why = place({"world_size": 3}, *docs, now=0)
    assert chosen is None
    assert why == "waiting for 3 free slot(s); 2 available (1 slot(s) busy or short of free memory)"


def test_what_the_gpu_pass_met_is_still_said_after_the_cpu_pass():
    docs = client("a", apart=[("b", FAR)]), client("b"), client("c", kind="cpu")
    chosen, why = place({"world_size": 3, "memory_required": GiB}, *docs, now=0)
    assert chosen is None
    assert why == ("waiting for 3 free slot(s) with 1.0 GiB free each; 1 available (gpu clients a (host h-a) and b "
                   "(host h-b) cannot reach each other: DDP and FSDP need every GPU client of a job to reach the "
                   "others (parallelism=\"DILOCO\" syncs through the server))")


# -- kinds, order, load, a resumed job ------------------------------------------------------------
def test_a_mixed_devices_job_takes_gpu_and_cpu_slots_together():
    chosen, why = place({"world_size": 2, "devices": "mixed"}, client("g", 1), client("c", kind="cpu"))
    assert (ids(chosen), why) == (["c:0", "g:0"], "")


@pytest.mark.parametrize("world", [None, 2])
def test_a_plan_is_in_index_order_whatever_the_slots_ids(world):
    docs = client("a", slots=[slot("a", 0, sid="z-gpu"), slot("a", 1, sid="y-gpu")])
    assert ids(place({"world_size": world}, docs)[0]) == ["z-gpu", "y-gpu"]


def test_a_job_one_client_holds_goes_on_the_smallest_that_does():
    assert ids(place({"world_size": 1}, client("a", 2), client("b", 1))[0]) == ["b:0"]


def test_a_job_one_client_holds_goes_on_the_least_loaded():
    a = client("a", slots=[slot("a", 0, job_id="other"), slot("a", 1)])
    assert ids(place({"world_size": 1}, a, client("b", 1))[0]) == ["b:0"]


def test_a_resumed_job_goes_on_with_its_fewest_ranks():
    job = {"status": "resuming", "world_size": 4}
    chosen, why = place({"world_size": 4, "min_world_size": 2}, client("a"), client("b"), job=job)
    assert (ids(chosen), why) == (["a:0", "b:0"], "")
    assert place({"world_size": 4, "min_world_size": 2}, client("a"), job=job)[0] is None


def test_clients_a_job_avoids_are_passed_over():
    chosen, _ = place({"world_size": 1}, client("a"), client("b", 2), job={"avoid": ["a"]})
    assert ids(chosen) == ["b:0"]


# -- the records a plan builds --------------------------------------------------------------------
def test_a_plan_reads_the_slots_it_is_given_not_the_clients_own(built):
    clients = by_id(client("a", 2), client("b", 2))
    given = [dict(s) for s in room_slots(clients)]  # the pass's copies
    assert ids(plan({"spec": {"world_size": 2}}, given, clients)[0]) == ["a:0", "a:1"]
    assert built == {"client": 2, "slot": 4}
    kept = Kept()
    assert ids(plan({"spec": {"world_size": 2}}, given, clients, kept=kept)[0]) == ["a:0", "a:1"]
    assert built == {"client": 4, "slot": 8}


def test_kept_records_are_built_once_for_plan_and_unschedulable(built):
    clients, kept = by_id(client("a", 2), client("b", 1)), Kept()
    for _ in range(2):
        assert ids(plan({"spec": {"world_size": 3}}, room_slots(clients), clients, kept=kept)[0]) == \
            ["a:0", "a:1", "b:0"]
    assert built == {"client": 2, "slot": 3}
    for _ in range(2):
        assert unschedulable({"world_size": 4}, list(clients.values()), kept=kept).startswith("world_size 4")
    assert built == {"client": 2, "slot": 3}


# -- records: a slot's and a client's documents, read once --------------------------------------
def test_a_slot_record_reads_every_field_of_its_document():
    doc = {"id": "gpu-7", "client_id": "a", "index": 3, "kind": "cuda", "memory_total": 16 * GiB,
           "memory_free": 8 * GiB, "job_id": "j", "terms": {"allowed_images": ["img"]}}
    assert Slot.of(doc) == Slot("gpu-7", "a", 3, SlotKind.CUDA, 16 * GiB, 8 * GiB, "j", ("img",), doc)
    bare = {"client_id": "a", "job_id": ""}
    assert Slot.of(bare) == Slot("a:0", "a", 0, SlotKind.CUDA, 0, 0, None, (), bare)
    assert Slot.of({"client_id": "a", "index": 2}).id == "a:2"


def test_a_slot_records_counts_and_kind_are_read_with_care():
    odd = Slot.of({"client_id": "a", "index": "x", "kind": ["cuda"], "memory_total": "junk", "memory_free": None})
    assert (odd.index, odd.kind, odd.memory_total, odd.memory_free) == (0, None, 0, 0)
    assert Slot.of({"client_id": "a", "kind": "tpu"}).kind is None and Slot.of({"client_id": "a", "kind": ""}).kind \
        == SlotKind.CUDA
    big, TiB = {"memory_total": 1024 * GiB, "memory_free": 2048 * GiB}, 1024 * GiB
    gpu, cpu, unsaid = (Slot.of({"client_id": "a", **kind, **big}) for kind in ({"kind": "cuda"}, {"kind": "cpu"}, {}))
    assert (gpu.memory_total, gpu.memory_free) == (defaults.MAX_GPU_MEMORY,) * 2  # no GPU has 1 TiB
    assert (unsaid.memory_total, unsaid.kind) == (defaults.MAX_GPU_MEMORY, SlotKind.CUDA)
    assert (cpu.memory_total, cpu.memory_free) == (TiB, TiB)  # a host may; free at most total


def test_a_client_record_reads_every_field_of_its_document():
    doc = {"id": "a", "status": "online", "versions": {"python": "3.11.4"}, "modules": "torch numpy",
           "hostname": "box", "host_id": "h1", "slots": [{"client_id": "a", "index": 0}],
           "unreachable": [{"client_id": "b", "until": 5}, {"client_id": 7, "until": 5}, "junk",
                           {"client_id": "c", "until": "soon"}, {"client_id": "d"}]}
    c = Client.of(doc)
    assert (c.id, c.online, c.python, c.minor, c.modules, c.hostname, c.host, c.doc) == \
        ("a", True, "3.11.4", "3.11", "torch numpy", "box", "h1", doc)
    assert c.unreachable == (("b", 5.0),) and c.apart_from(4) == ["b"] and c.apart_from(5) == []
    assert [s.id for s in c.slots] == ["a:0"] and Client.of(doc, with_slots=False).slots == ()
    lone = Client.of({"id": "z", "status": "offline"})
    assert (lone.online, lone.host, lone.python, lone.unreachable, lone.slots) == (False, "client:z", "?", (), ())
    assert not online(None) and not online({}) and online({"status": "online"})


def test_a_need_reads_the_record_of_a_resuming_job_only():
    spec = {"world_size": 4, "min_world_size": 2, "gpus_per_client": 2}
    assert (Need.of(spec).want, Need.of(spec).least, Need.of(spec).per) == (4, None, 2)
    assert (Need.of(spec, {"status": "queued", "world_size": 2}).want,
            Need.of(spec, {"status": "queued", "world_size": 2}).least) == (4, None)
    resumed = Need.of(spec, {"status": "resuming", "world_size": 3})
    assert (resumed.want, resumed.least) == (3, 2)
    assert Need.of(spec, {"status": "resuming", "world_size": 0}).want == 4


def test_a_flat_spec_is_read_as_the_tree_and_a_tree_as_it_is():
    for doc in ({"strategy": {"type": "tp"}}, {"code": {"versions": {"python": "3.11.4"}}}):
        assert tree(doc) is doc
    flat = tree({})
    assert (flat["parallelism"], flat["kind"]) == ("DDP", "function")
    assert tree({"parallelism": "fsdp+tp", "kind": "script"})["parallelism"] == "FSDP+TP"


# -- Kept: the room view's records, built once ----------------------------------------------------
def room_docs():
    return [client("a", 2), client("b", slots=[slot("b", 0, job_id="j")])]


def test_kept_records_are_built_once_per_document():
    kept, (a, b) = Kept(), room_docs()
    first = kept.client(a, with_slots=False)
    assert first.slots == () and kept.client(a, with_slots=False) is first
    whole = kept.client(a)
    assert whole.id == "a" and [s.id for s in whole.slots] == ["a:0", "a:1"]
    assert all(kept.slot(s) is r for s, r in zip(a["slots"], whole.slots))
    busy = kept.slot(b["slots"][0])
    assert busy.job_id == "j" and kept.slot(b["slots"][0]) is busy


def test_kept_reads_a_slot_again_when_its_job_is_written_in_place():
    kept, (a, _) = Kept(), room_docs()
    doc = a["slots"][0]
    free = kept.slot(doc)
    doc["job_id"] = ""
    assert kept.slot(doc) is free  # "" is no job, as None
    doc["job_id"] = "j"
    assert kept.slot(doc).job_id == "j"
    doc["job_id"] = None
    assert kept.slot(doc).job_id is None


def test_kept_forgets_and_retains_by_document():
    kept, (a, b) = Kept(), room_docs()
    old = {id(d): (kept.client(d, with_slots=False), [kept.slot(s) for s in d["slots"]]) for d in (a, b)}
    kept.forget([None, client("never-seen")])  # nothing to drop: no error
    kept.retain(d for d in (a,))
    assert kept.client(a, with_slots=False) is old[id(a)][0] and kept.slot(a["slots"][1]) is old[id(a)][1][1]
    assert kept.client(b, with_slots=False) is not old[id(b)][0] and kept.slot(b["slots"][0]) is not old[id(b)][1][0]
    kept.forget([a])
    assert kept.client(a, with_slots=False) is not old[id(a)][0] and kept.slot(a["slots"][1]) is not old[id(a)][1][1]
