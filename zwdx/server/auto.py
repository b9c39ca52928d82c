"""``parallelism="AUTO"``: the mode chosen as the job is placed, from what one replica needs, each
idle slot's free memory, which GPU clients reach each other and how fast their links are.

``decide`` is the rule, a pure function over plain values (``Need``, ``Place``, ``Rules``); it
returns a ``Choice`` whose ``reason`` says why in figures. In order:

1. DILOCO when the job would span GPU clients that cannot all reach each other (``placement.apart``,
   remembered by ``reach.py``) or on several hosts whose slowest measured link to the server
   (``links.py``) is below ``AUTO_MIN_LINK`` bytes/s: it syncs through the server, not peer to peer;
   a replica must fit one slot.
2. DDP when a replica (parameters + gradients + optimizer state + activations) fits every slot
   with ``AUTO_MARGIN`` of its free memory to spare.
3. FSDP when it does not fit one slot but the state sharded over the ranks (plus a rank's
   activations) does.
4. FSDP+TP when every GPU client holds several slots and TP over each client's slots (which also
   divides the activations) makes it fit.
5. PIPELINE when even sharded it does not fit: the model cut into one stage a rank, each holding
   its share of the state and the activations.
6. Otherwise nothing fits: the job waits, saying so (GPU clients may join).

``resolve`` applies it to a waiting AUTO job (the scheduler calls it before placing): the stored
spec's strategy becomes the mode chosen (a resumed job keeps it) and ``Job.auto`` says what and
why; the job's log says so too. Where the figures come from: docs/modes/auto.md.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from .. import defaults
from ..protocol import EventKind, Parallelism
from ..protocol.job import AutoChoice, Job as JobRecord
from ..protocol.spec import DDP, FSDP, Auto, Diloco, Pipeline, TensorParallel
from . import jobs, notify
from .placement import apart, host_of, memory

log = logging.getLogger(__name__)
GiB = 1024**3


@dataclass(frozen=True)
class Need:
    """What one replica of the model needs, in bytes."""
    state: int        # parameters + gradients + optimizer state
    activations: int  # one rank's activations at its batch

    @property
    def replica(self) -> int:
        return self.state + self.activations


@dataclass(frozen=True)
class Place:
    """A GPU client as AUTO sees it: its host, each idle slot's free bytes (None: not reported),
    and the slower way of its link to the server in bytes/s (None: not measured)."""
    id: str
    free: tuple[int | None, ...]
    host: str = ""
    link: float | None = None


@dataclass(frozen=True)
class Rules:
    """The server's settings the choice follows (``AUTO_MIN_LINK``, ``AUTO_MARGIN``: ``settings.py``)."""
    min_link: float = defaults.AUTO_MIN_LINK
    margin: float = defaults.AUTO_MARGIN


@dataclass(frozen=True)
class Choice:
    """The mode (None: none fits), why, and FSDP+TP's group size (ranks on every GPU client)."""
    parallelism: Parallelism | None
    reason: str
    tp: int | None = None
    ranks: int = 0
    details: dict = field(default_factory=dict, compare=False)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _bits(rate: float) -> str:
    return f"{rate * 8 / 1e9:.2f} Gbit/s"


def _used(places: list[Place], world: int | None) -> list[Place]:
    """The GPU clients the job would take: those with idle slots, the roomiest first, up to
    ``world`` slots (every idle slot when None)."""
    order = sorted((p for p in places if p.free), key=lambda p: -min((f or 0) for f in p.free))
    if world is None:
        return order
    used, count = [], 0
    for place in order:
        if count >= world:
            break
        take = min(len(place.free), world - count)
        used.append(Place(place.id, tuple(sorted(place.free, key=lambda f: -(f or 0))[:take]), place.host, place.link))
        count += take
    return used


def _why_apart(used: list[Place], pairs: set[frozenset]) -> str | None:
    ids = [p.id for p in used]
    cut = sorted(sorted(pair) for pair in pairs if pair <= set(ids) and len(pair) == 2)
    return "; ".join(f"gpu clients {a} and {b} cannot reach each other" for a, b in cut) or None


def _why_slow(used: list[Place], rules: Rules) -> str | None:
    if len({p.host or p.id for p in used}) < 2:
        return None  # one machine: its GPU clients meet over local links
    slow = [p for p in used if p.link is not None and p.link < rules.min_link]
    if not slow:
        return None
    worst = min(slow, key=lambda p: p.link or 0)
    return (f"gpu client {worst.id}'s link measures {_bits(worst.link or 0)}, below AUTO_MIN_LINK "
            f"({_bits(rules.min_link)}): DDP's all-reduce would wait on it every step")


@dataclass(frozen=True)
class _Room:
    """What ``decide``'s rules read: the slots the job would take, what a slot can hold, and the
    words that say so."""
    used: list[Place]
    n: int
    usable: int | None  # None: no slot said its free memory
    room: str
    replica: str
    replica_bytes: int
    links: str

    def fits(self, need: int) -> bool:
        return self.usable is None or need <= self.usable


def _room(need: Need, used: list[Place], rules: Rules) -> _Room:
    n = sum(len(p.free) for p in used)
    known = [f for p in used for f in p.free if f is not None]
    usable = int(min(known) * (1 - rules.margin)) if known else None
    room = ("no slot reported its free memory" if usable is None else
            f"the smallest of the {n} slot(s) has {_gib(min(known))} free, {_gib(usable)} usable "
            f"(AUTO_MARGIN {rules.margin:.0%} held back)")
    replica = f"a replica needs {_gib(need.replica)} (state {_gib(need.state)} + activations {_gib(need.activations)})"
    measured = [p.link for p in used if p.link is not None]
    links = ("one host" if len({p.host or p.id for p in used}) < 2 else
             f"links of at least {_bits(min(measured))}" if measured else "links not measured (taken as fast)")
    return _Room(used, n, usable, room, replica, need.replica, links)


def _apart_or_slow(r: _Room, pairs: set[frozenset], rules: Rules) -> Choice | None:
    """Rule 1: DILOCO where the GPU clients cannot all meet, or meet too slowly."""
    apart_why = _why_apart(r.used, pairs) if len(r.used) > 1 else None
    why = apart_why or _why_slow(r.used, rules)
    if why is None:
        return None
    if r.fits(r.replica_bytes):
        return Choice(Parallelism.DILOCO, f"DILOCO: {why}; it syncs through the server, and "
                                          f"{r.replica}, which fits one slot ({r.room})", ranks=r.n)
    return Choice(None, f"no mode fits: {why} (so DILOCO, whose workers hold a replica each), "
                        f"but {r.replica} and {r.room}")


def _sharded(need: Need, r: _Room) -> Choice:
    """Rules 3-6, for a replica that does not fit one slot: FSDP, FSDP+TP, PIPELINE, or none."""
    n = r.n
    fsdp = need.state // n + need.activations
    if r.fits(fsdp):
        return Choice(Parallelism.FSDP, f"FSDP: {r.replica}, more than one slot ({r.room}); sharded over {n} ranks "
                                        f"a rank needs {_gib(fsdp)}; {r.links}", ranks=n)
    group = min(len(p.free) for p in r.used)
    each = need.state // n + need.activations // group
    if group >= 2 and all(len(p.free) == group for p in r.used) and r.fits(each):
        return Choice(Parallelism.FSDP_TP, f"FSDP+TP: sharded over {n} ranks a rank still needs {_gib(fsdp)} "
                                           f"({r.room}); with TP over each gpu client's {group} slots its activations "
                                           f"split too: {_gib(each)} a rank; {r.links}", tp=group, ranks=n)
    stage = need.replica // n
    if r.fits(stage):
        return Choice(Parallelism.PIPELINE, f"PIPELINE: sharded over {n} ranks a rank still needs {_gib(fsdp)} "
                                            f"({r.room}); cut into {n} stages one needs about {_gib(stage)}; {r.links}",
                      ranks=n)
    return Choice(None, f"no mode fits: {r.replica}; even cut into {n} stages one needs {_gib(stage)}, and {r.room}")


def decide(need: Need, places: list[Place], pairs: set[frozenset] | None = None, world: int | None = None,
           rules: Rules = Rules()) -> Choice:
    """The mode for a job needing ``need`` on the idle slots of ``places`` (``world`` ranks; None:
    every idle slot), ``pairs`` the GPU clients known not to reach each other."""
    used = _used(places, world)
    if not any(p.free for p in used):
        return Choice(None, "no idle slot to choose a mode for yet")
    r = _room(need, used, rules)
    unlinked = _apart_or_slow(r, pairs or set(), rules)
    if unlinked is not None:
        return unlinked
    if r.fits(need.replica):
        return Choice(Parallelism.DDP, f"DDP: {r.replica}, which fits every slot ({r.room}); {len(used)} gpu client(s) "
                                       f"that reach each other, {r.links}", ranks=r.n)
    if r.n < 2:
        return Choice(None, f"no mode fits one slot: {r.replica} and {r.room}")
    return _sharded(need, r)


# -- the server's side --------------------------------------------------------------------------
def need_of(strategy: Auto, factor: float) -> Need:
    """What the submitter's counts say one replica needs (activations: ``factor`` times the
    parameters' bytes when not measured)."""
    activations = strategy.activation_bytes
    if activations is None:
        activations = int(strategy.parameter_bytes * factor)
    return Need(state=strategy.state_bytes or 4 * strategy.parameter_bytes, activations=activations)


def places_of(clients: dict, avoid: list[str]) -> list[Place]:
    """The room's online GPU clients (by id, each with its slots) as ``decide`` takes them."""
    places = []
    for cid, client in clients.items():
        if cid in avoid or client.get("status") != "online":
            continue
        free = tuple(memory(s, "memory_free") if memory(s) else None for s in client.get("slots") or []
                     if not s.get("job_id"))
        link = client.get("link") if isinstance(client.get("link"), dict) else None
        rate = min(float(link.get("up") or 0), float(link.get("down") or 0)) if link else None
        places.append(Place(cid, free, host_of(client), rate))
    return places




def _strategy(choice: Choice, spec):
    """The spec with AUTO replaced by the mode chosen (FSDP+TP: its groups, one per GPU client)."""
    resources = spec.resources
    if choice.parallelism == Parallelism.FSDP_TP:
        strategy = FSDP(tp=TensorParallel(size=choice.tp))
        resources = resources.model_copy(update={"world_size": choice.ranks, "gpus_per_client": choice.tp})
    elif choice.parallelism == Parallelism.PIPELINE:
        strategy = Pipeline().resolved(resources.world_size or choice.ranks)
        resources = resources.model_copy(update={"world_size": resources.world_size or choice.ranks})
    elif choice.parallelism == Parallelism.DILOCO:  # the server steps the global weights from the submitter's
        strategy = Diloco(start_weights=spec.strategy.start_weights)
    else:
        strategy = {Parallelism.DDP: DDP, Parallelism.FSDP: FSDP}[choice.parallelism]()
    return spec.model_copy(update={"strategy": strategy, "resources": resources})


def _drop_start(ctx, start_id: str | None) -> None:
    """Start weights no job will step (AUTO chose another mode): deleted, out of the room's quota."""
    if start_id and ctx.store.delete_artifact(start_id):
        ctx.artifacts.delete(start_id)


def resolve(ctx, record: JobRecord, clients: dict) -> JobRecord | None:
    """A waiting AUTO job given its mode (stored with ``auto``, logged, and said in the job's log),
    or None: none fits the room's idle slots now, and the job waits saying why."""
    strategy = record.spec.strategy
    assert isinstance(strategy, Auto)
    settings = ctx.settings
    choice = decide(need_of(strategy, settings.auto_activation_factor), places_of(clients, record.avoid),
                    apart(clients, time.time()), record.spec.resources.world_size,
                    Rules(min_link=settings.auto_min_link, margin=settings.auto_margin))
    if choice.parallelism is None:
        jobs.wait(ctx, record, f"AUTO: {choice.reason}")
        return None
    now = time.time()
    chosen = AutoChoice(parallelism=choice.parallelism, reason=choice.reason, at=now)
    stored = ctx.store.set_job(record.id, {"spec": _strategy(choice, record.spec), "auto": chosen},
                               when=[record.status])
    if stored is None:
        return None  # it moved on meanwhile (cancelled)
    if choice.parallelism != Parallelism.DILOCO:
        _drop_start(ctx, strategy.start_weights)
    text = f"AUTO chose {choice.reason}"
    log.info("job %s: %s", record.id, text)
    notify.events_added(stored, ctx.store.add_events(record.id, [{
        "kind": EventKind.LOG.value, "rank": None, "key": f"auto:{record.attempt}", "step": None,
        "data": {"text": text}, "ts": now}]))
    notify.job_changed(stored)
    return stored
