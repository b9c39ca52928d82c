"""zwdx/server/placement/groups.py (and two corners of filters.py), checked where mutation testing
(bench/mutation.py) found nothing looking: the order slots are taken in, a host's RAM over its
CPU slots, the size of FSDP+TP and TP groups at every boundary, the GPU clients that reach each
other. Pure functions on typed records, fast lane."""
from __future__ import annotations

from collections import Counter

from zwdx.server.placement import Client, Need, Slot, filters
from zwdx.server.placement.groups import Host, apart, hosts_ram, reachable, spread, tp_groups, within_host_ram

GiB = 1 << 30


def slots_of(cid, n=1, kind="cuda", total=16 * GiB, free=None, job_id=None):
    return [Slot.of({"id": f"{cid}:{i}", "client_id": cid, "index": i, "kind": kind, "memory_total": total,
                     "memory_free": total if free is None else free, "job_id": job_id}) for i in range(n)]


def client(cid, host=None, status="online", unreachable=()):
    return Client.of({"id": cid, "status": status, "versions": {"python": "3.11.4"}, "host_id": host,
                      "hostname": f"h-{host or cid}",
                      "unreachable": [{"client_id": p, "until": u} for p, u in unreachable]}, with_slots=False)


def ids(slots):
    return [s.id for s in slots]


def need(parallelism="FSDP+TP", per=0):
    return Need(python=None, modules=(), memory=0, image=None, want=None, least=None, per=per,
                parallelism=parallelism, mixed=False)


def counts(**n):
    """Slots in order, ``n[cid]`` of each GPU client."""
    return [s for cid, k in n.items() for s in slots_of(cid, k)]


# -- filters.py ---------------------------------------------------------------------------------
def test_every_missing_package_is_named_with_a_comma_between():
    c = Client.of({"id": "a", "status": "online", "modules": "torch", "slots": [slots_of("a")[0].doc]})
    n = Need(python=None, modules=("numpy", "torch", "scipy"), memory=0, image=None, want=1, least=None, per=0,
             parallelism="DDP", mixed=False)
    assert filters.packages(n, c, c.slots[0]) == "gpu client a lacks package(s) numpy, scipy"


def test_the_clients_of_a_filter_that_refused_nothing_are_none():
    found = filters.eligible(need("DDP"), [client("a")], slots_of("a"))
    assert found.refused == {} and found.clients("busy") == [] and found.clients("nonesuch") == []


# -- spread ---------------------------------------------------------------------------------------
def test_a_job_no_client_holds_whole_fills_the_largest_client_first():
    order = counts(a=1, b=3, c=2)
    assert ids(spread(order, 4, Counter())) == ["b:0", "b:1", "b:2", "c:0", "c:1", "a:0"]
    assert ids(spread(order, None, Counter())) == ["b:0", "b:1", "b:2", "c:0", "c:1", "a:0"]
    # one that fits on a client whole goes on the least loaded, then the smallest, of those that hold it
    assert ids(spread(order, 2, Counter(b=1)))[:2] == ["c:0", "c:1"]
    assert ids(spread(order, 2, Counter(c=1)))[:2] == ["b:0", "b:1"]


# -- hosts_ram ------------------------------------------------------------------------------------
def test_a_hosts_ram_is_its_cpu_slots_least_free_largest_total_and_the_ranks_held_there():
    clients = {"x": client("x", host="box"), "y": client("y", host="box"), "g": client("g", host="gpu")}
    slots = (slots_of("x", 1, "cpu", total=32 * GiB, free=10 * GiB, job_id="j1")
             + slots_of("y", 1, "cpu", total=30 * GiB, free=12 * GiB, job_id="j1")
             + slots_of("g", 1, "cuda"))
    hosts = hosts_ram(slots, clients, {"j1": 3 * GiB})
    assert hosts == {"box": Host("h-box", 10 * GiB, 32 * GiB, 6 * GiB)}  # no GPU slot's host
    assert hosts["box"].room == 10 * GiB
    reverse = hosts_ram(slots[1::-1], clients, {"j1": 3 * GiB})
    assert reverse == {"box": Host("h-box", 10 * GiB, 32 * GiB, 6 * GiB)}  # whichever slot comes first
    assert hosts_ram(slots, clients, {}) == {"box": Host("h-box", 10 * GiB, 32 * GiB, 0)}  # held: unknown job
    assert hosts_ram(slots, clients, {"j1": 3 * GiB}, idle=True) == {"box": Host("h-box", 30 * GiB, 32 * GiB, 0)}


def test_a_host_without_memory_has_none_and_a_slot_of_an_unknown_client_is_passed_over():
    clients = {"x": client("x", host="box")}
    slots = slots_of("x", 1, "cpu", total=0) + slots_of("ghost", 1, "cpu")
    assert hosts_ram(slots, clients, {}) == {"box": Host("h-box", 0, 0, 0)}


def test_a_host_that_fits_every_rank_is_not_short():
    clients = {"x": client("x", host="box")}
    order = slots_of("x", 2, "cpu")
    kept, short = within_host_ram(order, 4 * GiB, {"box": Host("h-box", 8 * GiB, 8 * GiB)}, clients)
    assert ids(kept) == ["x:0", "x:1"] and short == []


# -- tp_groups ------------------------------------------------------------------------------------
def test_a_tp_group_is_the_largest_on_one_client_or_none():
    assert tp_groups(need("TP"), counts(a=2, b=3), 4) == 3
    assert tp_groups(need("TP"), [], 4) == 0
    assert tp_groups(need("TP", per=2), counts(a=4), 4) == 2  # fixed at submit


def test_fsdp_tp_without_a_world_size_takes_the_size_that_places_the_most_ranks():
    assert tp_groups(need(), counts(a=2, b=2, c=4), None) == 2  # 6 ranks by 2, 4 by 4
    assert tp_groups(need(), counts(a=2, b=4), None) == 4  # 4 ranks either way: the larger group
    assert tp_groups(need(), counts(a=2, b=2), None) == 2
    assert tp_groups(need(), counts(a=1, b=1), None) == 0  # no group of two anywhere
    assert tp_groups(need(), [], None) == 0


def test_fsdp_tp_with_a_world_size_takes_its_largest_divisor_enough_clients_have():
    assert tp_groups(need(), counts(a=3, b=3), 6) == 3  # an odd group size
    assert tp_groups(need(), counts(a=3), 6) == 2  # 3 fits one client only: the smallest divisor
    assert tp_groups(need(), counts(a=4, b=4), 8) == 4
    assert tp_groups(need(), [], 4) == 2
    assert tp_groups(need(), [], 2) == 2
    assert tp_groups(need(), [], 9) == 3
    assert tp_groups(need(), counts(a=2), 1) == 0  # one rank: no group


# -- apart, reachable -----------------------------------------------------------------------------
def test_the_pairs_apart_are_those_not_expired_and_never_a_client_with_itself():
    clients = {"a": client("a", unreachable=[("b", 100.0), ("c", 40.0)]), "b": client("b"),
               "c": client("c", unreachable=[("c", 100.0)])}
    assert apart(clients, 50.0) == {frozenset(("a", "b"))}
    assert apart(clients, 30.0) == {frozenset(("a", "b")), frozenset(("a", "c"))}
    assert apart(clients, 100.0) == set()


def test_reachable_stops_at_the_first_group_with_enough_slots():
    order = counts(a=1, b=2, c=1)
    pairs = {frozenset(("a", "b")), frozenset(("a", "c"))}
    assert ids(reachable(order, pairs, 3)) == ["b:0", "b:1", "c:0"]  # a alone is too few: b's group
    assert ids(reachable(order, pairs, 1)) == ["a:0"]  # a alone is enough
    assert ids(reachable(order, pairs, None)) == ["b:0", "b:1", "c:0"]  # the largest
    order = counts(a=2, b=3)
    assert ids(reachable(order, {frozenset(("a", "b"))}, 2)) == ["a:0", "a:1"]
    assert ids(reachable(counts(a=1, b=1), {frozenset(("a", "b"))}, None)) == ["a:0"]  # a tie: the first
