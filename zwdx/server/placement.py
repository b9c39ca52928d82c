"""Which slots of a room can run a job, and what to tell its submitter when none can.

Pure functions over plain documents: a job (its ``spec``) and the room's GPU clients, each
with its ``slots`` as ``store.list_clients`` gives them. The scheduler asks ``plan`` at every
pass; ``POST /api/v1/jobs`` asks ``unschedulable`` at submit.

A slot can take a rank of a job when its GPU client is online, runs the submitter's Python
minor version (cloudpickled code needs it), can import every package the bundle refers to
(``required_modules``; a client that reported no module list is not checked), has
``memory_required`` bytes in all and free, and holds no rank already. CPU slots of one host
(GPU clients that report the same ``host_id``) share its RAM: the CPU ranks placed on a host
need at most its free RAM, and with the ranks other jobs hold there, at most its total RAM.
A script job (``kind: "script"``) runs on any Python; with ``gpus_per_client`` N, a job takes
N slots of each GPU client it runs on (torchrun's ``--nproc-per-node``). A job whose ranks meet
over TCP (DDP, FSDP, a script: all but DILOCO) goes only on GPU clients none of which is known
to be unable to reach another (``apart``: what their jobs found, ``reach.py``). A TP job's ranks
are one TP group on one GPU client; an FSDP+TP job's are whole groups of ``tp_size`` (or, left
out, of the most ranks every GPU client of the job can take alike): ``tp_groups``.

A job runs on slots of one kind (GPUs, or CPU slots), unless it asks for mixed devices
(``devices: "mixed"``): then GPU and CPU slots count together, GPUs first, and ``mixed`` says
what a placement of both kinds costs (``gpu_client/rank/strategies/mixed.py`` weighs each rank's batch by its
speed).
"""
from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict

from .. import defaults
from ..protocol import ClientStatus, JobStatus, python_minor
from ..protocol.flat import nest

GiB = 1024**3
#: How many GPU clients a reason names before it says "and N more".
NAMED = 3


def _n(value) -> int:
    """A count from a record: a number a bug or an older zwdx stored as something else counts 0."""
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def memory(slot: dict, field: str = "memory_total") -> int:
    """A slot's ``memory_total`` or ``memory_free`` as placement believes it: at most what its kind
    of device can have, and free at most total (a record stored before registers were checked
    for plausibility draws no job by a claim no hardware makes)."""
    bound = defaults.MAX_GPU_MEMORY if slot.get("kind", "cuda") == "cuda" else defaults.MAX_HOST_MEMORY
    total = min(_n(slot.get("memory_total")), bound)
    return total if field == "memory_total" else min(_n(slot.get(field)), total)


def _python(client: dict) -> str:
    """The Python version a GPU client reported ("?" if its record holds none)."""
    versions = client.get("versions")
    return str(versions.get("python", "?")) if isinstance(versions, dict) else "?"


def gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def host_of(client: dict) -> str:
    """The machine a GPU client runs on (one of its own when it did not say)."""
    return client.get("host_id") or f"client:{client['id']}"


def online(client: dict | None) -> bool:
    return bool(client) and client.get("status") == ClientStatus.ONLINE.value


def no_clients(clients) -> str:
    offline = sum(1 for c in clients if not online(c))
    return "the room has no GPU clients online" + (f" ({offline} offline)" if offline else "")


def tree(spec: dict) -> dict:
    """A spec document as the tree (``zwdx.protocol.spec``) with its mode named, whichever shape
    it has (a record of an earlier zwdx, a hand-made document, are flat)."""
    if "strategy" in spec or "code" in spec:
        return spec
    mode = {"parallelism": str(spec.get("parallelism") or "DDP").upper(), "kind": spec.get("kind") or "function"}
    return {**nest(spec), **mode}


def _part(spec: dict, name: str) -> dict:
    """One part of a spec's tree, as a document."""
    return tree(spec).get(name) or {}


def missing_modules(spec: dict, client: dict) -> list[str]:
    """The job's required modules the client cannot import (none when it did not say)."""
    need = _part(spec, "code").get("required_modules") or []
    if not need or client.get("modules") is None:
        return []
    have = set(client["modules"].split())
    return [m for m in need if m not in have]


def _lacking(clients: list[dict], missing: dict) -> str:
    """'gpu client a on host x lacks package(s) foo; ...', grouped by what they lack."""
    groups = defaultdict(list)
    for c in clients:
        if missing.get(c["id"]):
            groups[tuple(missing[c["id"]])].append(f"{c['id']} on host {c.get('hostname') or '?'}")
    parts = []
    for lacks, names in groups.items():
        who = ", ".join(names[:NAMED]) + (f" and {len(names) - NAMED} more" if len(names) > NAMED else "")
        parts.append(f"gpu client{'s' if len(names) > 1 else ''} {who} lack{'' if len(names) > 1 else 's'} "
                     f"package(s) {', '.join(lacks)}")
    return "; ".join(parts) + (" (installed since the gpu client started? it looks again when asked, within "
                               f"{defaults.MODULES_REFRESH:g} s; on its machine `zwdx gpu-client --refresh` makes "
                               "it look at once)" if parts else "")


def _host_ram(slots: list[dict], clients: dict, held: dict) -> dict:
    """host -> (free, total, held, hostname): the RAM of each host's CPU slots, counted once,
    and what the ranks on them need (``held``: bytes per rank by job id)."""
    free, total, taken, names = {}, {}, Counter(), {}
    for slot in slots:
        client = clients.get(slot["client_id"])
        if client is None or slot.get("kind") != "cpu":
            continue
        host = host_of(client)
        names.setdefault(host, client.get("hostname") or client["id"])
        if slot.get("job_id"):
            taken[host] += _n(held.get(slot["job_id"]))
        if online(client):  # each of its GPU clients reports the same RAM: the least free, to be safe
            slot_free = memory(slot, "memory_free")
            free[host] = min(free.get(host, slot_free), slot_free)
            total[host] = max(total.get(host, 0), memory(slot))
    return {h: (free[h], total[h], taken[h], names[h]) for h in free}


def needs_python(spec: dict) -> str | None:
    """The Python minor version a job's code loads on: its bundle's (cloudpickled code needs the
    one that made it); a script job's, none (its script runs on the GPU client's Python)."""
    spec = tree(spec)
    return None if spec.get("kind") == "script" else python_minor(spec["code"]["versions"]["python"])


def whole_groups(order: list[dict], per: int) -> tuple[list[dict], int]:
    """``gpus_per_client``: of the slots in ``order``, the first ``per`` of each GPU client that
    has that many, in order; and how many GPU clients have fewer."""
    by_client = defaultdict(list)
    for slot in order:
        by_client[slot["client_id"]].append(slot)
    full = {c for c, held in by_client.items() if len(held) >= per}
    taken = Counter()
    kept = []
    for slot in order:
        if slot["client_id"] in full and taken[slot["client_id"]] < per:
            taken[slot["client_id"]] += 1
            kept.append(slot)
    return kept, len(by_client) - len(full)


TP_MODES = ("TP", "FSDP+TP")


def tp_groups(spec: dict, order: list[dict], want: int | None) -> int:
    """How many ranks of a TP or FSDP+TP job go on each GPU client (its TP group's size), from
    the slots in ``order``: ``gpus_per_client`` when the submit fixed it (TP: the world size;
    FSDP+TP: ``tp_size``); else TP's largest group of one GPU client, and FSDP+TP's largest group
    size (at least 2) that divides ``want`` and that enough GPU clients have (with no ``want``:
    the size that places the most ranks). 0: no such group."""
    fixed = _n(_part(spec, "resources").get("gpus_per_client"))
    if fixed:
        return fixed
    counts = Counter(s["client_id"] for s in order)
    if spec.get("parallelism") == "TP":
        return max(counts.values(), default=0)
    if want is None:
        sizes = [(p * sum(1 for n in counts.values() if n >= p), p) for p in set(counts.values()) if p >= 2]
        return max(sizes)[1] if sizes else 0
    fits = [p for p in range(want, 1, -1) if want % p == 0 and p * sum(1 for n in counts.values() if n >= p) >= want]
    return fits[0] if fits else min((p for p in range(2, want + 1) if want % p == 0), default=0)


def tp_size(spec, placement) -> int | None:
    """The resolved TP group size of a placed TP or FSDP+TP job (``JobAssign.tp_size``): the
    submitted ``tp_size``, else how many ranks the placement put on rank 0's GPU client (every
    GPU client of the job holds as many); None for the other modes."""
    if spec.parallelism.value not in TP_MODES:
        return None
    if spec.tp is not None and spec.tp.size:
        return spec.tp.size
    first = placement[0].client_id
    return sum(1 for p in placement if p.client_id == first)


def apart_from(client: dict, now: float) -> list[str]:
    """The GPU clients this one is known not to reach, or not to be reached by, at ``now`` (its
    record's ``unreachable``: ``[{"client_id", "until"}]``, written by ``reach.py``)."""
    held = client.get("unreachable")
    if not isinstance(held, list):
        return []
    return sorted({e["client_id"] for e in held if isinstance(e, dict) and isinstance(e.get("client_id"), str)
                   and isinstance(e.get("until"), (int, float)) and e["until"] > now})


def apart(clients: dict, now: float) -> set[frozenset]:
    """Pairs of the room's GPU clients known not to reach each other at ``now``."""
    return {frozenset((cid, peer)) for cid, client in clients.items() for peer in apart_from(client, now)
            if peer != cid}


def mixes_devices(spec: dict) -> bool:
    """Whether the job may take GPU and CPU slots together (``devices: "mixed"``)."""
    return _part(spec, "strategy").get("type") == "mixed"


#: What a placement of GPU and CPU slots together costs, on its timeline and in the scheduler's log.
MIXED_COST = "gloo on every rank, gradients through host memory; each rank's batch weighted by its measured speed"


def mixed(kinds) -> str | None:
    """The line for a placement over these slot kinds when they differ ("mixed cuda+cpu: ..."), else None."""
    kinds = sorted(set(kinds), key=lambda k: (k != "cuda", k))
    return f"mixed {'+'.join(kinds)}: {MIXED_COST}" if len(kinds) > 1 else None


def meets_over_tcp(spec: dict) -> bool:
    """Whether the job's ranks open TCP to each other (all but DILOCO, which syncs through the server)."""
    return spec.get("parallelism") != "DILOCO"


def _reachable(order: list[dict], pairs: set[frozenset], want: int | None) -> list[dict]:
    """The slots of ``order`` on GPU clients that all reach each other: greedily from each GPU
    client in turn, the first group with ``want`` slots (or the largest one)."""
    clients = list(dict.fromkeys(s["client_id"] for s in order))
    best: list[dict] = []
    for first in clients:
        group = [first]
        for other in clients:
            if other != first and all(frozenset((other, g)) not in pairs for g in group):
                group.append(other)
        kept = [s for s in order if s["client_id"] in group]
        if len(kept) > len(best):
            best = kept
        if want is not None and len(best) >= want:
            break
    return best


def _pairs_named(pairs: set[frozenset], clients: dict) -> str:
    names = sorted(" and ".join(sorted(f"{c} (host {clients.get(c, {}).get('hostname') or '?'})" for c in pair))
                   for pair in pairs)
    shown = "; ".join(names[:NAMED]) + (f" and {len(names) - NAMED} more pair(s)" if len(names) > NAMED else "")
    return (f"gpu clients {shown} cannot reach each other: DDP and FSDP need every GPU client of a job to reach "
            f"the others (parallelism=\"DILOCO\" syncs through the server)")


def _eligible(job: dict, slots: list[dict], clients: dict) -> tuple[list[dict], list[str]]:
    """Free slots that can run the job, and what keeps the others from it."""
    spec = tree(job["spec"])
    need_py = needs_python(spec)
    mem = _n(_part(spec, "resources").get("memory_required"))
    ok, too_small, busy, wrong_py, missing = [], 0, 0, Counter(), {}
    image, no_image = _part(spec, "resources").get("image"), {}
    avoid, avoided = set(job.get("avoid") or []), set()
    for slot in slots:
        client = clients.get(slot["client_id"])
        if not online(client):
            continue
        if client["id"] in avoid:  # it held a placement of this job that did not start
            avoided.add(client["id"])
            continue
        allowed = (slot.get("terms") or {}).get("allowed_images") or []
        if image and image not in allowed:  # a container's image only its donor allows
            no_image.setdefault(client["id"], [0, allowed])[0] += 1
            continue
        have_py = python_minor(_python(client))
        if need_py is not None and have_py != need_py:
            wrong_py[f"{have_py} (gpu client {client['id']})"] += 1
            continue
        if client["id"] not in missing:
            missing[client["id"]] = missing_modules(spec, client)
        if missing[client["id"]]:
            continue
        if mem and memory(slot) < mem:
            too_small += 1
        elif slot.get("job_id") or (mem and memory(slot, "memory_free") < mem):
            busy += 1
        else:
            ok.append(slot)
    why = []
    if avoided:
        why.append(f"gpu client(s) {', '.join(sorted(avoided))} held a placement of this job that did not start")
    if no_image:
        theirs = "; ".join(f"gpu client {c} allows {', '.join(a)}" if a else f"gpu client {c} runs no containers"
                           for c, (_, a) in sorted(no_image.items()))
        why.append(f"{sum(n for n, _ in no_image.values())} slot(s) do not run image {image} ({theirs})")
    if wrong_py:
        why.append(f"{sum(wrong_py.values())} slot(s) on Python {', '.join(sorted(wrong_py))} cannot load "
                   f"a bundle made with Python {need_py}")
    if any(missing.values()):
        why.append(_lacking([clients[i] for i in missing], missing))
    if too_small:
        why.append(f"{too_small} slot(s) have less than {gib(mem)} of memory in all")
    if busy:
        why.append(f"{busy} slot(s) busy or short of free memory")
    return ok, why


def _spread(of_kind: list[dict], want: int | None, load: Counter) -> list[dict]:
    """The slots in the order to take them. A job that one GPU client can hold whole goes on
    one: the one with the fewest busy slots, then the fewest free (jobs spread over the room,
    and a big client stays free for a big job, rather than the largest client drawing every
    job); a larger one fills whole GPU clients first, the largest first (fewer hosts, more
    ranks over local links)."""
    free = Counter(s["client_id"] for s in of_kind)

    def key(slot):
        c = slot["client_id"]
        if want and free[c] >= want:
            return 0, load[c], free[c], c, slot["index"]
        return 1, 0, -free[c], c, slot["index"]
    return sorted(of_kind, key=key)


def _within_host_ram(order: list[dict], mem: int, hosts: dict, clients: dict) -> tuple[list[dict], list[str]]:
    """The CPU slots of ``order`` that fit their host's RAM, in order, and which hosts fell short."""
    count, kept, short = Counter(), [], {}
    for slot in order:
        host = host_of(clients[slot["client_id"]])
        free, total, taken, name = hosts[host]
        room = max(0, min(free, total - taken))
        if (count[host] + 1) * mem <= room:
            count[host] += 1
            kept.append(slot)
        else:
            short[host] = (name, room)
    why = [f"the CPU slots of host {name} share its RAM: {gib(room)} left, room for {room // mem} "
           f"rank(s) of {gib(mem)}" for name, room in short.values()]
    return kept, why


def plan(job: dict, slots: list[dict], clients: dict, held: dict | None = None,
         now: float | None = None) -> tuple[list[dict] | None, str]:
    """Choose the slots for a job, rank order grouped by GPU client; or None and the reason.
    ``held``: bytes per rank of the jobs holding slots (those on CPU slots count against their
    host's RAM)."""
    spec = tree(job["spec"])
    pairs = apart(clients, time.time() if now is None else now) if meets_over_tcp(spec) else set()
    if not any(online(c) for c in clients.values()):
        return None, no_clients(clients.values())
    eligible, why = _eligible(job, slots, clients)
    mem = _n(_part(spec, "resources").get("memory_required"))
    by_kind = defaultdict(list)
    for slot in eligible:
        by_kind[slot.get("kind", "cuda")].append(slot)
    want = _part(spec, "resources").get("world_size")
    least = None  # a new job waits for its world size; one resuming may go on with min_world_size
    if job.get("status") == JobStatus.RESUMING.value and job.get("world_size"):
        want, least = job["world_size"], _part(spec, "recovery").get("min_world_size")  # the size it ran at, or at least that
    load = Counter(s["client_id"] for s in slots if s.get("job_id"))
    have, kinds_apart = 0, []
    for kinds in ([("cuda", "cpu")] if mixes_devices(spec) else [("cuda",), ("cpu",)]):
        chosen = []
        for kind in kinds:
            of_kind = by_kind.get(kind) or []
            of_kind = _spread(of_kind, want, load)
            if kind == "cpu" and mem and of_kind:
                of_kind, short = _within_host_ram(of_kind, mem, _host_ram(slots, clients, held or {}), clients)
                why += short
            chosen += of_kind  # a mixed job: GPUs first
        tp = spec.get("parallelism") in TP_MODES
        per = tp_groups(spec, chosen, want) if tp and chosen else _n(_part(spec, "resources").get("gpus_per_client"))
        if tp and per and spec.get("parallelism") == "TP":
            want = per  # one group: the job's ranks
        if per and chosen:
            chosen, fewer = whole_groups(chosen, per)
            if fewer and tp:
                why.append(f"{spec['parallelism']} keeps a TP group of {per} rank(s) on one GPU client: {fewer} gpu "
                           f"client(s) have fewer than {per} such slot(s) free")
            elif fewer:
                why.append(f"{fewer} gpu client(s) have fewer than {per} such slot(s) free (gpus_per_client {per})")
        if pairs and chosen:
            group = _reachable(chosen, pairs, want)
            if len(group) < len(chosen):
                among = {s["client_id"] for s in chosen}
                why.append(_pairs_named({p for p in pairs if p <= among}, clients))
                chosen = group
        have = max(have, len(chosen))
        kinds_apart.append(len(chosen))
        if not chosen:
            continue
        if want is None:
            return sorted(chosen, key=lambda s: (s["client_id"], s["index"])), ""
        if len(chosen) < want and least and len(chosen) >= least:
            want = len(chosen)  # whole groups of gpus_per_client still: chosen holds only those
        if len(chosen) >= want:
            return sorted(chosen[:want], key=lambda s: (s["client_id"], s["index"])), ""
    each = f" with {gib(mem)} free each" if mem else ""
    slots_of = "GPU or CPU slot(s), together (devices \"mixed\")" if mixes_devices(spec) else "slot(s)"
    reason = f"waiting for {want or 1} free {slots_of}{each}; {have} available"
    if len(kinds_apart) == 2 and all(kinds_apart) and sum(kinds_apart) >= (want or 1):
        why.append(f"{kinds_apart[0]} GPU and {kinds_apart[1]} CPU slot(s) free: a job runs on one kind, unless "
                   f"submitted with devices=\"mixed\"")
    return None, reason + (f" ({'; '.join(why)})" if why else "")


class RecentClients:
    """Each room's GPU clients for the submit-time ``unschedulable`` hint: from the placement view
    (``views``, ``roomview.py``: current, and read in proportion to what changed); without one,
    as read at most ``ttl`` seconds ago (per server process), so that a room of thousands of
    clients that takes many submits a second is read once a ``ttl``, not once a submit (a hint
    that refuses the job, ``fail_if_unschedulable``, reads the store itself)."""

    def __init__(self, store, ttl: float = 5.0, views=None):
        self.store, self.ttl, self.views = store, ttl, views
        self._held: dict[str, tuple[float, list[dict]]] = {}
        self._lock = threading.Lock()

    def of(self, room_id: str, fresh: bool = False) -> list[dict]:
        if self.views is not None:
            return list(self.views.of(room_id).values())
        now = time.monotonic()
        with self._lock:
            held = self._held.get(room_id)
        if fresh or held is None or held[0] < now - self.ttl:
            held = (now, self.store.list_clients(room_id))
            with self._lock:
                if len(self._held) > 10_000:  # rooms without end: forget, do not grow
                    self._held.clear()
                self._held[room_id] = held
        return held[1]

    def forget(self, room_id: str) -> None:
        """A client of the room registered or left through this process: the next hint reads anew."""
        with self._lock:
            self._held.pop(room_id, None)


def unschedulable(spec: dict, clients: list[dict]) -> str | None:
    """Why the room as it is now could never run the job, even with every slot idle (more ranks
    than its eligible slots, more memory than any slot has, no GPU client at all, none on the
    submitter's Python, a package missing on every one); None when it could. Jobs wait anyway:
    GPU clients may join."""
    spec = tree(spec)
    alive = [c for c in clients if online(c)]
    if not alive:
        return no_clients(clients)
    need_py = needs_python(spec)
    runs = [c for c in alive if need_py is None or python_minor(_python(c)) == need_py]
    if not runs:
        theirs = sorted({f"{python_minor(_python(c))} (gpu client {c['id']})" for c in alive})
        return (f"no GPU client online runs Python {need_py}, the submitter's (they run {', '.join(theirs)}); "
                f"a bundle loads only on the Python minor version that made it")
    missing = {c["id"]: missing_modules(spec, c) for c in runs}
    fit = [c for c in runs if not missing[c["id"]]]
    if not fit:
        return f"no GPU client online can import the packages the job uses: {_lacking(runs, missing)}"
    mem = _n(_part(spec, "resources").get("memory_required"))
    slots = [s for c in fit for s in c["slots"]]
    big = [s for s in slots if memory(s) >= mem]
    if not big:
        largest = max((memory(s) for s in slots), default=0)
        return (f"memory_required ({gib(mem)} per rank) is above every slot's total memory "
                f"(the largest has {gib(largest)})")
    per = _n(_part(spec, "resources").get("gpus_per_client"))
    cuda = [s for s in big if s.get("kind", "cuda") == "cuda"]
    gpus = len(whole_groups(cuda, per)[0] if per else cuda)
    cpu_hosts = defaultdict(list)
    by_id = {c["id"]: c for c in fit}
    for s in big:
        if s.get("kind") == "cpu":
            cpu_hosts[host_of(by_id[s["client_id"]])].append(s)
    cpus, shared = 0, []
    for host, host_slots in cpu_hosts.items():
        fits = len(host_slots)
        if mem:
            ram = max(memory(s) for s in host_slots)
            fits = min(fits, ram // mem)
            if fits < len(host_slots):
                name = by_id[host_slots[0]["client_id"]].get("hostname") or host
                shared.append(f"the {len(host_slots)} CPU slots of host {name} share its {gib(ram)} of RAM, "
                              f"room for {fits} rank(s) of {gib(mem)}")
        if per:  # whole groups of gpus_per_client on each of the host's GPU clients
            fits = min(fits, len(whole_groups(host_slots, per)[0]))
        cpus += fits
    need = _part(spec, "resources").get("world_size") or 1  # min_world_size only lets a resumed job go on with fewer ranks
    most = gpus + cpus if mixes_devices(spec) else max(gpus, cpus)
    if most >= need:
        return None
    kinds = [f"{n} {kind} slot(s)" for n, kind in ((gpus, "GPU"), (cpus, "CPU")) if n]
    tp = spec.get("parallelism") in TP_MODES
    kinds_note = "a job runs on GPU slots or on CPU slots, not both, unless submitted with devices=\"mixed\""
    notes = shared + ([kinds_note] if len(kinds) == 2 and not mixes_devices(spec) else []) + \
        ([f"counting only GPU clients with {per} slots for it ({spec.get('parallelism')} keeps a TP group of {per} "
          f"on one GPU client)" if tp else f"counting only GPU clients with {per} slots for it (gpus_per_client)"]
         if per else [])
    return (f"world_size {need} is more than the {most} slot(s) this room could give the job even with "
            f"every slot idle ({' and '.join(kinds) or 'none'}{''.join('; ' + n for n in notes)})")


def room_totals(clients: list[dict]) -> dict:
    """What the room's online GPU clients offer: slots, busy slots, memory total and free, the
    RAM of CPU slots counted once per host."""
    slots = busy = total = free = 0
    cpu_ram = {}
    for client in clients:
        if not online(client):
            continue
        for slot in client["slots"]:
            slots += 1
            busy += 1 if slot.get("job_id") else 0
            slot_total, slot_free = memory(slot), memory(slot, "memory_free")
            if slot.get("kind") == "cpu":  # one host's RAM, whichever of its GPU clients reports it
                t, f = cpu_ram.get(host_of(client), (slot_total, slot_free))
                cpu_ram[host_of(client)] = (max(t, slot_total), min(f, slot_free))
            else:
                total += slot_total
                free += slot_free
    for t, f in cpu_ram.values():
        total += t
        free += f
    return {"clients_online": sum(1 for c in clients if online(c)), "slots": slots, "slots_busy": busy,
            "memory_total": total, "memory_free": free, "hosts": len({host_of(c) for c in clients if online(c)})}
