"""Placement's filters one by one (zwdx/server/placement/filters.py, groups.py): each says why a
slot, or a set of slots, cannot take the job's ranks; and ``plan`` and ``unschedulable``, which
run them both, agree on a room taken idle. Pure functions, fast lane."""
from __future__ import annotations

import random

import pytest

from zwdx.server.placement import Client, Need, Slot, eligible, filters, plan, unschedulable
from zwdx.server.placement.groups import Host, reachable, whole_groups, within_host_ram

GiB = 1 << 30


def doc(cid, n=1, python="3.11.4", modules=None, host=None, kind="cuda", total=16 * GiB, images=None,
        status="online", job_id=None, unreachable=None):
    slots = [{"id": f"{cid}:{i}", "client_id": cid, "index": i, "kind": kind, "memory_total": total,
              "memory_free": total, "job_id": job_id, **({"terms": {"allowed_images": images}} if images else {})}
             for i in range(n)]
    return {"id": cid, "status": status, "versions": {"python": python}, "modules": modules, "host_id": host,
            "hostname": f"h-{host or cid}", "slots": slots, "unreachable": unreachable or []}


def spec(world_size=1, memory=0, python="3.11.0", modules=(), image=None, per=None, parallelism="DDP",
         mixed=False, kind="function"):
    strategy = {"type": "mixed"} if mixed else {"type": parallelism.lower()}
    return {"code": {"versions": {"python": python}, "required_modules": list(modules)},
            "resources": {"world_size": world_size, "memory_required": memory, "image": image,
                          "gpus_per_client": per},
            "strategy": strategy, "recovery": {}, "parallelism": parallelism, "kind": kind}


def one(need, client_doc, check):
    client = Client.of(client_doc)
    return check(need, client, client.slots[0])


@pytest.mark.parametrize("check, asks, has, words", [
    (filters.avoided, {}, {}, "gpu client a held a placement of this job that did not start"),
    (filters.image, {"image": "x:1"}, {"images": ["y:2"]}, "slot a:0 does not run image x:1"),
    (filters.python, {"python": "3.12.1"}, {}, "gpu client a runs Python 3.11, the bundle needs 3.12"),
    (filters.packages, {"modules": ["numpy", "scipy"]}, {"modules": "numpy torch"},
     "gpu client a lacks package(s) scipy"),
    (filters.memory_total, {"memory": 20 * GiB}, {}, "slot a:0 has 16.0 GiB in all, the job needs 20.0 GiB"),
    (filters.busy, {}, {"job_id": "j1"}, "slot a:0 holds a rank of job j1"),
])
def test_each_filter_names_what_keeps_a_slot_from_the_job_and_lets_a_fitting_one_through(check, asks, has, words):
    job = {"spec": spec(**asks), "avoid": ["a"] if check is filters.avoided else []}
    assert one(Need.of(job["spec"], job), doc("a", **has), check) == words
    assert one(Need.of(spec()), doc("a"), check) is None  # asks nothing of it, or the slot has it


def test_a_slot_short_of_free_memory_is_busy_and_the_unsaid_cases_pass():
    short = doc("a")
    short["slots"][0]["memory_free"] = 2 * GiB
    assert one(Need.of(spec(memory=4 * GiB)), short, filters.busy) == "slot a:0 has 2.0 GiB free, the job needs 4.0 GiB"
    assert one(Need.of(spec(modules=["scipy"])), doc("a"), filters.packages) is None  # it did not say: not checked
    assert one(Need.of(spec(python="3.9.0", kind="script")), doc("a"), filters.python) is None  # any Python


def test_eligible_refuses_a_slot_by_its_first_filter_and_idle_skips_the_facts_of_the_moment():
    room = [Client.of(doc("a", python="3.10.1", job_id="j")), Client.of(doc("b", job_id="j")),
            Client.of(doc("c", 2)), Client.of(doc("d", status="offline"))]
    found = eligible(Need.of(spec()), room)
    assert [s.id for s in found.slots] == ["c:0", "c:1"]
    assert {k: [s.id for _, s, _ in v] for k, v in found.refused.items()} == {"python": ["a:0"], "busy": ["b:0"]}
    idle = eligible(Need.of(spec()), room, idle=True)
    assert [s.id for s in idle.slots] == ["b:0", "c:0", "c:1"] and list(idle.refused) == ["python"]
    assert [c.id for c in idle.online] == ["a", "b", "c"]


def test_the_set_filters_keep_whole_groups_a_hosts_ram_and_clients_that_reach_each_other():
    slots = [Slot.of(s) for c in (doc("a", 3), doc("b", 1), doc("c", 2)) for s in c["slots"]]
    kept, fewer = whole_groups(slots, 2)
    assert [s.id for s in kept] == ["a:0", "a:1", "c:0", "c:1"] and fewer == 1
    cpu = {c: Client.of(doc(c, 2, kind="cpu", host="box")) for c in ("x", "y")}
    order = [s for c in cpu.values() for s in c.slots]
    kept, short = within_host_ram(order, 4 * GiB, {"box": Host("h-box", 16 * GiB, 16 * GiB, 4 * GiB)}, cpu)
    assert [s.id for s in kept] == ["x:0", "x:1", "y:0"]  # 12 GiB left: three ranks of 4 GiB
    assert [(s.name, s.room, s.slots, s.fits) for s in short] == [("h-box", 12 * GiB, 4, 3)]
    assert [s.id for s in reachable(slots, {frozenset(("a", "c"))}, 4)] == ["a:0", "a:1", "a:2", "b:0"]


def _room(rng: random.Random) -> list[dict]:
    out = []
    for i in range(rng.randint(0, 4)):
        kind = rng.choice(["cuda", "cuda", "cpu"])
        out.append(doc(f"c{i}", rng.randint(1, 4), python=rng.choice(["3.11.4", "3.11.9", "3.10.2"]),
                       modules=rng.choice([None, "numpy torch", "torch"]), kind=kind,
                       host=rng.choice([None, "box"]) if kind == "cpu" else None,
                       total=rng.choice([8, 16, 24]) * GiB, images=rng.choice([None, ["x:1"]]),
                       status=rng.choice(["online", "online", "online", "offline"])))
    return out


def _job(rng: random.Random) -> dict:
    parallelism = rng.choice(["DDP", "DDP", "FSDP", "DILOCO", "TP", "FSDP+TP"])
    return spec(world_size=rng.choice([None, 1, 2, 3, 4, 6, 8]), memory=rng.choice([0, 4, 8, 12, 20]) * GiB,
                python=rng.choice(["3.11.0", "3.10.0"]), modules=rng.choice([(), ("numpy",)]),
                image=rng.choice([None, None, "x:1"]), per=rng.choice([None, None, 2]),
                parallelism=parallelism, mixed=parallelism == "DDP" and rng.random() < 0.3)


def test_plan_and_unschedulable_agree_on_an_idle_room():
    rng, seen = random.Random(32), {True: 0, False: 0}
    for _ in range(3000):
        room, asked = _room(rng), _job(rng)
        never = unschedulable(asked, room)
        chosen, why = plan({"spec": asked}, [s for c in room for s in c["slots"]], {c["id"]: c for c in room})
        assert (never is None) == (chosen is not None), (asked, room, never, why)
        seen[chosen is not None] += 1
    assert min(seen.values()) > 300, seen  # both answers drawn often


def test_an_image_no_slot_runs_is_never_schedulable_and_another_python_is_said_first():
    room = [doc("a", images=["x:1"]), doc("b")]
    assert unschedulable(spec(image="y:2"), room) == \
        "no slot of a GPU client online runs image y:2 (gpu client a allows x:1; gpu client b runs no containers)"
    assert unschedulable(spec(image="x:1"), room) is None
    assert unschedulable(spec(image="y:2", python="3.12.0"), room).startswith(
        "no GPU client online runs Python 3.12, the submitter's (they run 3.11 (gpu client a), 3.11 (gpu client b))")
