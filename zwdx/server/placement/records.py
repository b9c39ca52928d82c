"""The GPU clients, slots and job asks placement reads, typed: read once from the store's
documents (``store.list_clients``, a job's ``spec``), whose format stays as it is. Clients and
slots are named tuples: immutable, and quicker to build than frozen dataclasses (a pass makes
one per slot of the room)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ... import defaults
from ...protocol import ClientStatus, JobStatus, SlotKind, python_minor
from ...protocol.flat import nest

GiB = 1024**3
#: The modes whose ranks form TP groups, each on one GPU client.
TP_MODES = ("TP", "FSDP+TP")


def gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def count(value) -> int:
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
    total = min(count(slot.get("memory_total")), bound)
    return total if field == "memory_total" else min(count(slot.get(field)), total)


def python_of(client: dict) -> str:
    """The Python version a GPU client reported ("?" if its record holds none)."""
    versions = client.get("versions")
    return str(versions.get("python", "?")) if isinstance(versions, dict) else "?"


def host_of(client: dict) -> str:
    """The machine a GPU client runs on (one of its own when it did not say)."""
    return client.get("host_id") or f"client:{client['id']}"


def online(client: dict | None) -> bool:
    return bool(client) and client.get("status") == ClientStatus.ONLINE.value


#: A slot's kind as stored (none: a GPU, as records of earlier zwdx); one this zwdx does not know: never placed.
_KINDS = {None: SlotKind.CUDA, "": SlotKind.CUDA, **{k.value: k for k in SlotKind}}


class Slot(NamedTuple):
    """One GPU, or the CPU of a client without GPUs; ``doc`` is the store's document (what a
    plan returns, and the scheduler marks as taken)."""
    id: str
    client_id: str
    index: int
    kind: SlotKind | None
    memory_total: int
    memory_free: int
    job_id: str | None
    allowed_images: tuple[str, ...]
    doc: dict

    @classmethod
    def of(cls, doc: dict) -> Slot:
        bound = defaults.MAX_GPU_MEMORY if doc.get("kind", "cuda") == "cuda" else defaults.MAX_HOST_MEMORY
        total = min(count(doc.get("memory_total")), bound)
        kind = doc.get("kind")
        return cls(id=doc.get("id") or f"{doc['client_id']}:{doc.get('index', 0)}", client_id=doc["client_id"],
                   index=count(doc.get("index")), kind=_KINDS.get(kind) if isinstance(kind, (str, type(None))) else None,
                   memory_total=total, memory_free=min(count(doc.get("memory_free")), total),
                   job_id=doc.get("job_id") or None,
                   allowed_images=tuple((doc.get("terms") or {}).get("allowed_images") or ()), doc=doc)


class Client(NamedTuple):
    """A GPU client as placement sees it. ``modules``: the packages it can import, as it reported
    them (None: it did not say, and is not checked)."""
    id: str
    online: bool
    python: str
    minor: str  # its Python's minor version
    modules: str | None
    hostname: str | None
    host: str
    unreachable: tuple[tuple[str, float], ...]
    slots: tuple[Slot, ...]
    doc: dict

    @classmethod
    def of(cls, doc: dict, with_slots: bool = True) -> Client:
        held = doc.get("unreachable")
        apart = tuple((e["client_id"], float(e["until"])) for e in (held if isinstance(held, list) else ())
                      if isinstance(e, dict) and isinstance(e.get("client_id"), str)
                      and isinstance(e.get("until"), (int, float)))
        python = python_of(doc)
        return cls(id=doc["id"], online=online(doc), python=python, minor=python_minor(python), modules=doc.get("modules"),
                   hostname=doc.get("hostname"), host=host_of(doc), unreachable=apart,
                   slots=tuple(Slot.of(s) for s in doc.get("slots") or ()) if with_slots else (), doc=doc)

    @property
    def name(self) -> str:
        return f"{self.id} on host {self.hostname or '?'}"

    def apart_from(self, now: float) -> list[str]:
        """The GPU clients this one is known not to reach, or not to be reached by, at ``now``."""
        return sorted({peer for peer, until in self.unreachable if until > now}) if self.unreachable else []


class Kept:
    """Records of documents that stay in memory from one plan to the next (the room view's,
    roomview.py), by the document's identity: built once, not at every plan (a pass and a submit
    each read the whole room). The store's changes reach the view as new documents, which get
    records of their own; what the view drops, it forgets here. The one field written in place
    is a slot's ``job_id`` (the scheduler marks the slots it reserved in the pass's view): a slot
    whose record says another is built again."""

    def __init__(self) -> None:
        self._clients: dict[int, Client] = {}
        self._slots: dict[int, Slot] = {}

    def client(self, doc: dict, with_slots: bool = True) -> Client:
        record = self._clients.get(id(doc))
        if record is None or record.doc is not doc:
            record = self._clients[id(doc)] = Client.of(doc, with_slots=False)
        return record._replace(slots=tuple(self.slot(s) for s in doc.get("slots") or ())) if with_slots else record

    def slot(self, doc: dict) -> Slot:
        record = self._slots.get(id(doc))
        if record is None or record.doc is not doc or record.job_id != (doc.get("job_id") or None):
            record = self._slots[id(doc)] = Slot.of(doc)
        return record

    def forget(self, docs) -> None:
        """Drop the records of these client documents and of their slots."""
        for doc in docs:
            if doc is not None:
                self._clients.pop(id(doc), None)
                for slot in doc.get("slots") or ():
                    self._slots.pop(id(slot), None)

    def retain(self, docs) -> None:
        """Keep only the records of these client documents and their slots (a pass may have
        asked for a document the view replaced meanwhile)."""
        docs = list(docs)
        clients = {id(d) for d in docs}
        slots = {id(s) for d in docs for s in d.get("slots") or ()}
        self._clients = {k: r for k, r in self._clients.items() if k in clients}
        self._slots = {k: r for k, r in self._slots.items() if k in slots}


def tree(spec: dict) -> dict:
    """A spec document as the tree (``zwdx.protocol.spec``) with its mode named, whichever shape
    it has (a record of an earlier zwdx, a hand-made document, are flat)."""
    if "strategy" in spec or "code" in spec:
        return spec
    mode = {"parallelism": str(spec.get("parallelism") or "DDP").upper(), "kind": spec.get("kind") or "function"}
    return {**nest(spec), **mode}


@dataclass(frozen=True, slots=True)
class Need:
    """What a job asks of the slots it runs on. ``python``: the minor version its code loads on
    (its bundle's: cloudpickled code needs the one that made it; a script job's, None: its script
    runs on the GPU client's Python). ``want``: its ranks (None: as many as fit); ``least``: a
    resuming job's fewest. ``avoid``: GPU clients that held a placement of it that did not start."""
    python: str | None
    modules: tuple[str, ...]
    memory: int
    image: str | None
    want: int | None
    least: int | None
    per: int
    parallelism: str | None
    mixed: bool
    avoid: frozenset[str] = frozenset()

    @classmethod
    def of(cls, spec: dict, job: dict | None = None) -> Need:
        spec, job = tree(spec), job or {}
        code, res = spec.get("code") or {}, spec.get("resources") or {}
        want, least = res.get("world_size"), None
        if job.get("status") == JobStatus.RESUMING.value and job.get("world_size"):
            want, least = job["world_size"], (spec.get("recovery") or {}).get("min_world_size")
        python = (code.get("versions") or {}).get("python")
        return cls(python=None if spec.get("kind") == "script" or not python else python_minor(python),
                   modules=tuple(code.get("required_modules") or ()), memory=count(res.get("memory_required")),
                   image=res.get("image"), want=want, least=least, per=count(res.get("gpus_per_client")),
                   parallelism=spec.get("parallelism"), mixed=(spec.get("strategy") or {}).get("type") == "mixed",
                   avoid=frozenset(job.get("avoid") or ()))

    @property
    def tp(self) -> bool:
        return self.parallelism in TP_MODES

    @property
    def tcp(self) -> bool:
        """Whether its ranks open TCP to each other (all but DILOCO, which syncs through the server)."""
        return self.parallelism != "DILOCO"
