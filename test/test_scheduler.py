"""Placement rules of the scheduler, on plain documents (no server needed)."""
from zwdx.server.scheduler import plan


def slot(client, index, free=8 << 30, total=16 << 30, kind="cuda", job=None):
    return {"id": f"{client}:{index}", "client_id": client, "index": index, "kind": kind, "memory_free": free,
            "memory_total": total, "job_id": job, "name": "GPU"}


def clients(*ids, python="3.11.7", status="online"):
    return {i: {"id": i, "status": status, "versions": {"python": python}} for i in ids}


def job(world_size=None, memory=0, python="3.11.2"):
    return {"spec": {"world_size": world_size, "memory_required": memory, "versions": {"python": python}}}


def test_memory_required_is_per_slot_free_memory_not_a_sum():
    slots = [slot("a", 0, free=6 << 30), slot("b", 0, free=6 << 30)]
    chosen, why = plan(job(world_size=2, memory=8 << 30), slots, clients("a", "b"))
    assert chosen is None and "short of free memory" in why  # 12 GiB in all is not 8 GiB each
    chosen, _ = plan(job(world_size=2, memory=5 << 30), slots, clients("a", "b"))
    assert [s["id"] for s in chosen] == ["a:0", "b:0"]


def test_busy_offline_and_other_python_slots_are_not_used():
    slots = [slot("a", 0, job="other"), slot("a", 1), slot("b", 0), slot("c", 0)]
    cl = {**clients("a", "b"), **clients("c", status="offline")}
    chosen, _ = plan(job(), slots, cl)
    assert [s["id"] for s in chosen] == ["a:1", "b:0"]
    chosen, why = plan(job(world_size=1, python="3.10.4"), slots, cl)
    assert chosen is None and "Python" in why and "3.10" in why


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
