"""What placement tells a submitter: why a job waits now (``now``, ``waiting``) and why the room
could never run it (``never_eligible``, ``never``), from what the filters refused."""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ... import defaults
from ...protocol import SlotKind
from .filters import STANDING, Eligible, missing_modules
from .records import Client, Need, gib, online

if TYPE_CHECKING:
    from .plan import Choice

#: How many GPU clients a reason names before it says "and N more".
NAMED = 3
#: What a placement of GPU and CPU slots together costs, on its timeline and in the scheduler's log.
MIXED_COST = "gloo on every rank, gradients through host memory; each rank's batch weighted by its measured speed"
KINDS_NOTE = "a job runs on GPU slots or on CPU slots, not both, unless submitted with devices=\"mixed\""


def no_clients(clients: Iterable[dict]) -> str:
    offline = sum(1 for c in clients if not online(c))
    return "the room has no GPU clients online" + (f" ({offline} offline)" if offline else "")


def mixed(kinds) -> str | None:
    """The line for a placement over these slot kinds when they differ ("mixed cuda+cpu: ..."), else None."""
    kinds = sorted({getattr(k, "value", k) for k in kinds}, key=lambda k: (k != "cuda", k))
    return f"mixed {'+'.join(kinds)}: {MIXED_COST}" if len(kinds) > 1 else None


def lacking(clients: list[Client], need: Need) -> str:
    """'gpu client a on host x lacks package(s) foo; ...', grouped by what they lack."""
    groups = defaultdict(list)
    for c in clients:
        if lacks := missing_modules(need, c):
            groups[tuple(lacks)].append(c.name)
    parts = []
    for lacks, names in groups.items():
        who = ", ".join(names[:NAMED]) + (f" and {len(names) - NAMED} more" if len(names) > NAMED else "")
        parts.append(f"gpu client{'s' if len(names) > 1 else ''} {who} lack{'' if len(names) > 1 else 's'} "
                     f"package(s) {', '.join(lacks)}")
    return "; ".join(parts) + (" (installed since the gpu client started? it looks again when asked, within "
                               f"{defaults.MODULES_REFRESH:g} s; on its machine `zwdx gpu-client --refresh` makes "
                               "it look at once)" if parts else "")


def _images(found: Eligible) -> str:
    allowed: dict[str, tuple[str, ...]] = {}
    for c, s, _ in found.refused["image"]:
        allowed.setdefault(c.id, s.allowed_images)
    return "; ".join(f"gpu client {c} allows {', '.join(a)}" if a else f"gpu client {c} runs no containers"
                     for c, a in sorted(allowed.items()))


def now(found: Eligible, need: Need) -> list[str]:
    """What keeps the refused slots from the job, one line per filter, in the filters' order."""
    refused, why = found.refused, []
    if "avoided" in refused:
        why.append(f"gpu client(s) {', '.join(sorted(c.id for c in found.clients('avoided')))} held a placement "
                   "of this job that did not start")
    if "image" in refused:
        why.append(f"{len(refused['image'])} slot(s) do not run image {need.image} ({_images(found)})")
    if "python" in refused:
        wrong = Counter(f"{c.minor} (gpu client {c.id})" for c, _, _ in refused["python"])
        why.append(f"{sum(wrong.values())} slot(s) on Python {', '.join(sorted(wrong))} cannot load "
                   f"a bundle made with Python {need.python}")
    if "packages" in refused:
        why.append(lacking(found.clients("packages"), need))
    if "memory" in refused:
        why.append(f"{len(refused['memory'])} slot(s) have less than {gib(need.memory)} of memory in all")
    if "busy" in refused:
        why.append(f"{len(refused['busy'])} slot(s) busy or short of free memory")
    return why


def pairs_named(pairs: set[frozenset], clients: dict[str, Client]) -> str:
    host = {cid: c.hostname for cid, c in clients.items()}
    names = sorted(" and ".join(sorted(f"{c} (host {host.get(c) or '?'})" for c in pair)) for pair in pairs)
    shown = "; ".join(names[:NAMED]) + (f" and {len(names) - NAMED} more pair(s)" if len(names) > NAMED else "")
    return (f"gpu clients {shown} cannot reach each other: DDP and FSDP need every GPU client of a job to reach "
            f"the others (parallelism=\"DILOCO\" syncs through the server)")


def waiting(need: Need, choice: Choice, why: list[str], clients: dict[str, Client]) -> str:
    """Why a job that has no placement now waits: how many slots it waits for, and what kept the others."""
    for what, fact in choice.met:
        if what == "short":
            mem = need.memory
            why.append(f"the CPU slots of host {fact.name} share its RAM: {gib(fact.room)} left, room for "
                       f"{fact.room // mem} rank(s) of {gib(mem)}")
        elif what == "fewer":
            fewer, per = fact
            why.append(f"{need.parallelism} keeps a TP group of {per} rank(s) on one GPU client: {fewer} gpu "
                       f"client(s) have fewer than {per} such slot(s) free" if need.tp else
                       f"{fewer} gpu client(s) have fewer than {per} such slot(s) free (gpus_per_client {per})")
        else:
            why.append(pairs_named(fact, clients))
    each = f" with {gib(need.memory)} free each" if need.memory else ""
    slots_of = "GPU or CPU slot(s), together (devices \"mixed\")" if need.mixed else "slot(s)"
    reason = f"waiting for {choice.want or 1} free {slots_of}{each}; {choice.have} available"
    apart = [sum(k.values()) for k in choice.kinds]
    if len(apart) == 2 and all(apart) and sum(apart) >= (choice.want or 1):
        why.append(f"{apart[0]} GPU and {apart[1]} CPU slot(s) free: a job runs on one kind, unless "
                   f"submitted with devices=\"mixed\"")
    return reason + (f" ({'; '.join(why)})" if why else "")


def never_eligible(found: Eligible, need: Need) -> str | None:
    """The standing filter that refused every slot left to it, said as a reason the room can never
    run the job; None when some slot passed them all (or the room has no slots)."""
    left = len(found.slots) + sum(len(r) for r in found.refused.values())
    for f in STANDING:
        refused = found.refused.get(f.name) or []
        left -= len(refused)
        if not refused or left:
            continue
        if f.name == "image":
            return f"no slot of a GPU client online runs image {need.image} ({_images(found)})"
        if f.name == "python":
            theirs = sorted({f"{c.minor} (gpu client {c.id})" for c in found.clients("python")})
            return (f"no GPU client online runs Python {need.python}, the submitter's (they run {', '.join(theirs)}); "
                    f"a bundle loads only on the Python minor version that made it")
        if f.name == "packages":
            return f"no GPU client online can import the packages the job uses: {lacking(found.clients('packages'), need)}"
        largest = max(s.memory_total for _, s, _ in refused)
        return (f"memory_required ({gib(need.memory)} per rank) is above every slot's total memory "
                f"(the largest has {gib(largest)})")
    return None


def never(need: Need, choice: Choice) -> str:
    """Why the room, every slot idle, holds fewer of the job's ranks than it asks."""
    gpus = max((k[SlotKind.CUDA] for k in choice.kinds), default=0)
    cpus = max((k[SlotKind.CPU] for k in choice.kinds), default=0)
    kinds = [f"{n} {kind} slot(s)" for n, kind in ((gpus, "GPU"), (cpus, "CPU")) if n]
    notes = [f"the {s.slots} CPU slots of host {s.name} share its {gib(s.room)} of RAM, room for {s.fits} rank(s) "
             f"of {gib(need.memory)}" for what, s in choice.met if what == "short"]
    if len(kinds) == 2 and not need.mixed:
        notes.append(KINDS_NOTE)
    per = need.per or (choice.per if need.tp else 0)
    if per:
        notes.append(f"counting only GPU clients with {per} slots for it ({need.parallelism} keeps a TP group of "
                     f"{per} on one GPU client)" if need.tp else
                     f"counting only GPU clients with {per} slots for it (gpus_per_client)")
    return (f"world_size {need.want} is more than the {choice.have} slot(s) this room could give the job even with "
            f"every slot idle ({' and '.join(kinds) or 'none'}{''.join('; ' + n for n in notes)})")
