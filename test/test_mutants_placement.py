"""zwdx/server/placement/, checked where mutation testing (bench/mutation.py) found nothing
looking: which free slots a job may take and the exact words for each slot it may not (clients it
avoids, images, Python, packages, memory in all and free), memory's plausibility bounds, a
client's Python. Pure functions, fast lane."""
from __future__ import annotations

from zwdx import defaults
from zwdx.server import placement
from zwdx.server.placement import GiB, memory
from zwdx.server.placement import free_slots as _eligible, python_of as _python


def client(cid, python="3.11.4", status="online", modules=None, hostname=None):
    return {"id": cid, "status": status, "versions": {"python": python}, "modules": modules,
            "hostname": hostname or f"h-{cid}"}


def slot(cid, index=0, total=16 * GiB, free=None, kind="cuda", job_id=None, images=None):
    out = {"id": f"{cid}:{index}", "client_id": cid, "index": index, "kind": kind, "memory_total": total,
           "memory_free": total if free is None else free, "job_id": job_id}
    if images is not None:
        out["terms"] = {"allowed_images": images}
    return out


def job(memory_required=0, python="3.11.0", avoid=None, image=None, modules=None, kind=None):
    spec = {"memory_required": memory_required, "versions": {"python": python}}
    if image:
        spec["image"] = image
    if modules:
        spec["required_modules"] = modules
    if kind:
        spec["kind"] = kind
    return {"spec": spec, "avoid": avoid}


def ids(slots):
    return [s["id"] for s in slots]


def test_every_free_fitting_slot_is_eligible_and_nothing_is_said():
    clients = {c: client(c) for c in ("a", "b")}
    slots = [slot("a", 0), slot("a", 1), slot("b", 0)]
    assert _eligible(job(8 * GiB), slots, clients) == (slots, [])


def test_offline_and_unknown_clients_are_skipped_silently_not_the_rest():
    clients = {"a": client("a", status="offline"), "b": client("b")}
    ok, why = _eligible(job(), [slot("a"), slot("x"), slot("b")], clients)
    assert ids(ok) == ["b:0"] and why == []


def test_avoided_clients_are_named_and_the_others_still_looked_at():
    clients = {c: client(c) for c in ("a", "b", "c")}
    ok, why = _eligible(job(avoid=["c", "a"]), [slot("c"), slot("a"), slot("a", 1), slot("b")], clients)
    assert ids(ok) == ["b:0"]
    assert why == ["gpu client(s) a, c held a placement of this job that did not start"]


def test_an_image_runs_only_where_its_donor_allows_it_and_each_slot_counts():
    clients = {c: client(c) for c in ("a", "b", "c")}
    slots = [slot("a", 0, images=["x:1"]), slot("a", 1, images=["x:1"]), slot("b", images=["y:2", "z:3"]),
             slot("c", images=[])]
    ok, why = _eligible(job(image="y:2"), slots + [slot("b", 1)], clients)
    assert ids(ok) == ["b:0"]
    assert why == ["4 slot(s) do not run image y:2 (gpu client a allows x:1; gpu client b runs no containers; "
                   "gpu client c runs no containers)"]
    ok, why = _eligible(job(), slots, clients)  # no image: the terms do not matter
    assert ids(ok) == ids(slots) and why == []


def test_the_wrong_python_is_counted_per_version_and_client():
    clients = {"a": client("a", "3.10.2"), "b": client("b", "3.12.1"), "c": client("c", "3.11.9")}
    ok, why = _eligible(job(python="3.11.1"), [slot("a", 0), slot("a", 1), slot("b"), slot("c")], clients)
    assert ids(ok) == ["c:0"]
    assert why == ["3 slot(s) on Python 3.10 (gpu client a), 3.12 (gpu client b) cannot load a bundle made with "
                   "Python 3.11"]
    assert _eligible(job(python="3.11.1", kind="script"), [slot("a")], clients) == ([slot("a")], [])


def test_missing_packages_are_named_per_client():
    clients = {"a": client("a", modules="numpy torch"), "b": client("b", modules="numpy torch transformers")}
    ok, why = _eligible(job(modules=["transformers"]), [slot("a", 0), slot("a", 1), slot("b")], clients)
    assert ids(ok) == ["b:0"] and len(why) == 1
    assert why[0].startswith("gpu client a on host h-a lacks package(s) transformers (installed since")


def test_memory_in_all_and_free_are_told_apart_at_their_bounds():
    clients = {"a": client("a")}
    need = 8 * GiB
    slots = [slot("a", 0, total=need - 1), slot("a", 1, total=need), slot("a", 2, total=need, free=need - 1),
             slot("a", 3, total=need, job_id="other"), slot("a", 4, total=need, free=need)]
    ok, why = _eligible(job(need), slots, clients)
    assert ids(ok) == ["a:1", "a:4"]
    assert why == ["1 slot(s) have less than 8.0 GiB of memory in all", "2 slot(s) busy or short of free memory"]
    ok, why = _eligible(job(0), slots, clients)  # no memory asked: only the busy one is kept out
    assert ids(ok) == ["a:0", "a:1", "a:2", "a:4"] and why == ["1 slot(s) busy or short of free memory"]


def test_every_reason_comes_in_its_order():
    clients = {c: client(c) for c in "acef"}
    clients.update(b=client("b", "3.9.1"), d=client("d", modules="x"))
    slots = [slot("a"), slot("b", images=["i"]), slot("c", images=["i"], total=GiB), slot("d", images=["i"]),
             slot("e", images=["i"]), slot("e", 1, images=["i"], job_id="j"), slot("f", images=["other"])]
    ok, why = _eligible({**job(2 * GiB, image="i", modules=["y"]), "avoid": ["a"]}, slots, clients)
    assert ids(ok) == ["e:0"]
    fragments = ["held a placement", "do not run image i (gpu client f allows other)", "on Python 3.9 (gpu client b)",
                 "gpu client d on host h-d lacks package(s) y", "1 slot(s) have less than 2.0 GiB",
                 "1 slot(s) busy"]
    assert len(why) == len(fragments) and all(f in w for f, w in zip(fragments, why)), why


def test_memory_is_bounded_by_what_its_kind_of_device_can_have():
    huge = 10**18
    assert memory({"kind": "cuda", "memory_total": huge}) == defaults.MAX_GPU_MEMORY
    assert memory({"memory_total": huge}) == defaults.MAX_GPU_MEMORY  # no kind: a GPU's bound
    assert memory({"kind": "cpu", "memory_total": huge}) == defaults.MAX_HOST_MEMORY
    assert defaults.MAX_HOST_MEMORY != defaults.MAX_GPU_MEMORY
    assert memory({"kind": "cpu", "memory_total": 5, "memory_free": 9}, "memory_free") == 5  # free <= total
    assert memory({"kind": "cpu", "memory_total": 5, "memory_free": 3}, "memory_free") == 3
    assert memory({"kind": "cpu", "memory_total": 5, "memory_free": 3}) == 5
    assert memory({"kind": "cpu", "memory_total": "lots"}) == 0


def test_a_clients_python_is_what_it_reported_or_a_question_mark():
    assert _python({"versions": {"python": "3.12.1"}}) == "3.12.1"
    assert _python({"versions": {}}) == "?"
    assert _python({"versions": None}) == "?"
    assert _python({}) == "?"
    assert _python({"versions": ["3.12"]}) == "?"


def test_no_clients_counts_the_offline_ones():
    assert placement.no_clients([]) == "the room has no GPU clients online"
    assert placement.no_clients([client("a", status="offline"), client("b", status="lost")]) == \
        "the room has no GPU clients online (2 offline)"
