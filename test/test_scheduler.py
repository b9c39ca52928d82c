"""Placement rules of the scheduler, on plain documents (no server needed)."""
from zwdx.server.placement import plan, room_totals, unschedulable

GiB = 1 << 30


def slot(client, index, free=8 << 30, total=16 << 30, kind="cuda", job=None):
    return {"id": f"{client}:{index}", "client_id": client, "index": index, "kind": kind, "memory_free": free,
            "memory_total": total, "job_id": job, "name": "GPU"}


def clients(*ids, python="3.11.7", status="online", host=None, modules=None):
    return {i: {"id": i, "status": status, "versions": {"python": python}, "hostname": f"box-{host or i}",
                "host_id": host, "modules": modules} for i in ids}


def job(world_size=None, memory=0, python="3.11.2", modules=(), min_world_size=None):
    return {"spec": {"world_size": world_size, "memory_required": memory, "versions": {"python": python},
                     "required_modules": list(modules), "min_world_size": min_world_size}}


def room(cl: dict, slots: list) -> list[dict]:
    """The GPU clients with their slots, as store.list_clients gives them."""
    return [{**c, "slots": [s for s in slots if s["client_id"] == c["id"]]} for c in cl.values()]


def test_memory_required_is_per_slot_free_memory_not_a_sum():
    slots = [slot("a", 0, free=6 << 30), slot("b", 0, free=6 << 30)]
    chosen, why = plan(job(world_size=2, memory=8 << 30), slots, clients("a", "b"))
    assert chosen is None and "short of free memory" in why  # 12 GiB in all is not 8 GiB each
    assert "with 8.0 GiB free each" in why
    chosen, _ = plan(job(world_size=2, memory=5 << 30), slots, clients("a", "b"))
    assert [s["id"] for s in chosen] == ["a:0", "b:0"]


def test_busy_offline_and_other_python_slots_are_not_used():
    slots = [slot("a", 0, job="other"), slot("a", 1), slot("b", 0), slot("c", 0)]
    cl = {**clients("a", "b"), **clients("c", status="offline")}
    chosen, _ = plan(job(), slots, cl)
    assert [s["id"] for s in chosen] == ["a:1", "b:0"]
    chosen, why = plan(job(world_size=1, python="3.10.4"), slots, cl)
    assert chosen is None and "Python 3.11" in why and "Python 3.10" in why


def test_ranks_fill_whole_clients_first():
    slots = [slot("a", 0), slot("b", 0), slot("b", 1)]
    chosen, _ = plan(job(world_size=2), slots, clients("a", "b"))
    assert [s["id"] for s in chosen] == ["b:0", "b:1"]


def test_cpu_and_gpu_slots_are_not_mixed():
    slots = [slot("a", 0, kind="cpu"), slot("b", 0)]
    chosen, _ = plan(job(world_size=2), slots, clients("a", "b"))
    assert chosen is None
    chosen, _ = plan(job(), slots, clients("a", "b"))
    assert [s["kind"] for s in chosen] == ["cuda"]


def test_a_room_without_gpu_clients_says_so_in_words():
    chosen, why = plan(job(world_size=2, memory=3 << 30), [], {})
    assert chosen is None and why == "the room has no GPU clients online"
    chosen, why = plan(job(world_size=2), [slot("a", 0)], clients("a", status="offline"))
    assert chosen is None and why == "the room has no GPU clients online (1 offline)"
    assert unschedulable(job(world_size=1)["spec"], []) == "the room has no GPU clients online"


def test_cpu_slots_of_one_host_share_its_ram():
    ram = dict(kind="cpu", free=12 * GiB, total=16 * GiB)
    slots = [slot("a", 0, **ram), slot("b", 0, **ram)]
    same_host = clients("a", "b", host="h1")
    chosen, why = plan(job(world_size=2, memory=10 * GiB), slots, same_host)
    assert chosen is None
    assert "waiting for 2 free slot(s) with 10.0 GiB free each; 1 available" in why
    assert "the CPU slots of host box-h1 share its RAM: 12.0 GiB left, room for 1 rank(s) of 10.0 GiB" in why
    chosen, _ = plan(job(world_size=None, memory=10 * GiB), slots, same_host)  # every slot it can: one
    assert len(chosen) == 1
    chosen, _ = plan(job(world_size=2, memory=5 * GiB), slots, same_host)  # 2 x 5 GiB fit 12 GiB
    assert len(chosen) == 2
    chosen, _ = plan(job(world_size=2, memory=10 * GiB), slots, {**clients("a", host="h1"), **clients("b", host="h2")})
    assert len(chosen) == 2  # two machines, two RAMs


def test_ranks_of_other_jobs_count_against_a_hosts_ram():
    ram = dict(kind="cpu", free=12 * GiB, total=16 * GiB)
    slots = [slot("a", 0, job="other", **ram), slot("b", 0, **ram)]
    same_host = clients("a", "b", host="h1")
    chosen, why = plan(job(world_size=1, memory=8 * GiB), slots, same_host, held={"other": 10 * GiB})
    assert chosen is None and "6.0 GiB left" in why  # 16 GiB in all, 10 GiB held by the other job
    chosen, _ = plan(job(world_size=1, memory=6 * GiB), slots, same_host, held={"other": 10 * GiB})
    assert [s["id"] for s in chosen] == ["b:0"]


def test_gpu_clients_lacking_a_package_are_passed_over_and_named():
    slots = [slot("a", 0), slot("b", 0)]
    cl = {**clients("a", modules="numpy torch"), **clients("b", modules="numpy torch extrapkg")}
    chosen, _ = plan(job(world_size=1, modules=["extrapkg"]), slots, cl)
    assert [s["id"] for s in chosen] == ["b:0"]
    chosen, why = plan(job(world_size=2, modules=["extrapkg"]), slots, cl)
    assert chosen is None and "gpu client a on host box-a lacks package(s) extrapkg" in why
    unknown = clients("a", "b")  # clients that reported no module list are not checked
    chosen, _ = plan(job(world_size=2, modules=["extrapkg"]), slots, unknown)
    assert len(chosen) == 2


def test_unschedulable_names_what_the_room_can_never_give():
    slots = [slot("a", 0, total=16 * GiB), slot("b", 0, total=24 * GiB, job="busy")]
    cl = clients("a", "b", modules="numpy")
    spec = lambda **kw: job(**kw)["spec"]  # noqa: E731
    assert unschedulable(spec(world_size=2), room(cl, slots)) is None  # busy slots free up
    why = unschedulable(spec(world_size=3), room(cl, slots))
    assert why.startswith("world_size 3 is more than the 2 slot(s)") and "(2 GPU slot(s))" in why
    assert unschedulable(spec(world_size=3, min_world_size=2), room(cl, slots))  # a new job needs world_size
    why = unschedulable(spec(world_size=1, memory=40 * GiB), room(cl, slots))
    assert "40.0 GiB per rank" in why and "the largest has 24.0 GiB" in why
    assert unschedulable(spec(world_size=2, memory=20 * GiB), room(cl, slots)).startswith("world_size 2")
    why = unschedulable(spec(world_size=1, python="3.12.1"), room(cl, slots))
    assert "Python 3.12" in why and "3.11" in why
    why = unschedulable(spec(world_size=1, modules=["numpy", "extrapkg"]), room(cl, slots))
    assert "gpu clients a on host box-a, b on host box-b lack package(s) extrapkg" in why
    cpu = [slot("a", 0, kind="cpu", total=16 * GiB), slot("b", 0, kind="cpu", total=16 * GiB)]
    why = unschedulable(spec(world_size=2, memory=10 * GiB), room(clients("a", "b", host="h1"), cpu))
    assert why and "the 2 CPU slots of host box-h1 share its 16.0 GiB of RAM, room for 1 rank(s)" in why
    assert unschedulable(spec(world_size=1, memory=10 * GiB), room(clients("a", "b", host="h1"), cpu)) is None


def test_room_totals_count_a_hosts_ram_once():
    cpu = dict(kind="cpu", free=12 * GiB, total=16 * GiB)
    slots = [slot("a", 0, **cpu), slot("b", 0, **cpu), slot("c", 0, free=70 * GiB, total=80 * GiB, job="j")]
    cl = {**clients("a", "b", host="h1"), **clients("c", host="h2")}
    totals = room_totals(room(cl, slots))
    assert totals == {"clients_online": 3, "hosts": 2, "slots": 3, "slots_busy": 1,
                      "memory_total": 96 * GiB, "memory_free": 82 * GiB}
