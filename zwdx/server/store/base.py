"""The store interface: rooms and their credentials, GPU clients and their slots, jobs, job
events, artifacts' metadata.

Every backend (``sqlite.SQLiteStore``, the embedded default, and ``mongo.MongoStore``)
implements these methods with the same behaviour; ``test/test_store_contract.py`` runs one
suite against each. Rooms, clients, slots, events and artifacts are plain dicts with lowercase
string keys; a job is a typed record (``zwdx.protocol.job.Job``), written whole once and then
through small verbs, each taking typed values of the fields it writes (``docs/store.md``):

    set_job(job_id, fields, when=..., unless_set=...)       top-level fields
    put_job_entries(job_id, field, {rank: value}, when=...)  entries of a per-rank map
    append_job(job_id, {field: item}, fields=..., when=..., keep_last=...)
                                                             items of list fields (+ fields)
    reserve_slots(job_id, [(slot_id, rank)], fields)         slots and fields, all or nothing

Above the store, a job's moves write through ``store.jobs`` (``job_verbs.py``): the same
writes named after what happened (``move``, ``mark_suspect``, ``add_checkpoint``, ...).

Atomicity promises (the scheduler and ``zwdx.server.jobs.Job`` rely on them, across threads
and processes):
- ``reserve_slots`` gives a slot to at most one job and moves the job out of ``queued`` (or
  ``resuming``) at most once: all of it happens or none of it does.
- Each job verb is one write that applies only while the job's status is one of ``when``:
  a transition that two servers race for happens once.
- ``touch_client`` changes a client only if it is still in ``expect_status``. On SQLite the
  client and its slots' stats change in one transaction; on MongoDB (single-document
  atomicity) the slots' stats follow the client's update in one more round trip.
- ``upsert_client`` writes only over a client of the same room and client secret: two agents
  registering one new id at once get one registration.
- ``revoke_credential`` never leaves a room without a submitter credential, however many
  revocations race.
"""
from __future__ import annotations

import abc
import functools
import json
import typing
from typing import Any, Iterable, Mapping

from pydantic import ConfigDict, TypeAdapter
from pydantic.errors import PydanticUserError

from ...protocol.job import Job as JobRecord
from .job_verbs import JobVerbs

#: The layout version this code writes. Bump it and add a migration when the layout changes
#: (``migrations.py``).
SCHEMA_VERSION = 3


#: What a heartbeat refreshes on a slot (``touch_client``).
SLOT_STATS = ("memory_free", "utilization", "memory_total")

#: A job's per-rank maps (``put_job_entries``) and its lists (``append_job``).
MAP_FIELDS = ("ranks", "exits", "failures", "joins", "suspects", "shadows")
LIST_FIELDS = ("timeline", "restart_history", "checkpoints")
#: Fields no verb changes once the job is created.
FIXED_FIELDS = ("id", "room_id", "seq")

_CONFIG = ConfigDict(ser_json_inf_nan="strings")


@functools.lru_cache(maxsize=None)
def _adapter(name: str, part: str = "") -> TypeAdapter:
    """Checks and dumps a value of a job's field ``name`` (``part``: "entry" of a map, "item" of a list)."""
    if name not in JobRecord.model_fields or name in FIXED_FIELDS:
        raise ValueError(f"a job has no field {name!r} that can be written")
    kind = JobRecord.model_fields[name].annotation
    if part:
        wanted = MAP_FIELDS if part == "entry" else LIST_FIELDS
        if name not in wanted:
            raise ValueError(f"field {name!r} of a job is not one of {', '.join(wanted)}")
        kind = typing.get_args(kind)[-1]
    try:
        return TypeAdapter(kind, config=_CONFIG)
    except PydanticUserError:  # a model: it has its own config
        return TypeAdapter(kind)


def _json(name: str, value, part: str = ""):
    adapter = _adapter(name, part)
    return adapter.dump_python(adapter.validate_python(value), mode="json")


def job_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Top-level fields of a job as the store keeps them (JSON values), each checked against
    its declaration in ``Job``: a wrong name or value is a ``ValueError`` (a bug, not input)."""
    return {name: _json(name, value) for name, value in fields.items()}


def job_entries(field: str, entries: Mapping[str, Any]) -> dict[str, Any]:
    """Entries of one of ``MAP_FIELDS``, by rank (as a string), as the store keeps them."""
    return {str(rank): _json(field, value, "entry") for rank, value in entries.items()}


def job_items(items: Mapping[str, Any]) -> dict[str, Any]:
    """One item for each of ``LIST_FIELDS`` named, as the store keeps it."""
    return {field: _json(field, item, "item") for field, item in items.items()}


def field_name(name: str | None) -> str | None:
    """``name`` if it is a field of ``Job`` (or None), else ``ValueError``."""
    if name is not None and name not in JobRecord.model_fields:
        raise ValueError(f"a job has no field {name!r}")
    return name


def job_doc(job: JobRecord) -> dict:
    """A whole record as the store keeps it."""
    return job.model_dump(mode="json")


def event_bytes(event: dict) -> int:
    """What an event counts against its room's byte quota: its JSON's length, ``seq`` included."""
    return len(json.dumps(event, separators=(",", ":")))


def status_values(when: Iterable | None) -> list[str] | None:
    """Status values (``JobStatus`` members or strings) as stored, or None for any."""
    return None if when is None else [str(getattr(s, "value", s)) for s in when]


class Store(abc.ABC):
    """Abstract store. Methods raise ``zwdx.errors.StoreError`` when the backend fails."""

    @property
    def jobs(self) -> JobVerbs:
        """The job's writes named after what happened (``job_verbs.py``), over the verbs below."""
        return JobVerbs(self)

    # -- lifecycle -------------------------------------------------------------------------
    @abc.abstractmethod
    def ping(self) -> bool:
        """True when the backend answers (used by ``GET /health``)."""

    @abc.abstractmethod
    def schema_version(self) -> int:
        """The layout version recorded in the store."""

    def close(self) -> None:
        """Release connections. The store may not be used afterwards."""

    def serving(self) -> None:
        """This process is a server that will use the store for long and hard: start what only
        such a process needs (SQLite: a checkpointer thread). Nothing by default."""

    # -- rooms and their credentials ---------------------------------------------------------
    @abc.abstractmethod
    def create_room(self, room: dict) -> dict:
        """Insert a room ``{id, name, created_at}``. Returns it. An id already stored is a
        ``StoreError``."""

    @abc.abstractmethod
    def get_room(self, room_id: str) -> dict | None:
        """The room with this id, or None."""

    @abc.abstractmethod
    def update_room(self, room_id: str, changes: dict) -> dict | None:
        """Set fields of a room (its settings, ``client_retention``). Returns it after, or None
        when there is no such room."""

    @abc.abstractmethod
    def add_credential(self, credential: dict) -> dict:
        """Insert a credential of a room ``{id, room_id, role, name, hash, created_at,
        rotated_at, revoked_at, legacy}`` (``hash``: the sha256 of its secret). Returns it. An
        id or a hash already stored is a ``StoreError``."""

    @abc.abstractmethod
    def find_credential(self, secret_hash: str) -> dict | None:
        """The credential whose secret hashes to ``secret_hash`` (revoked or not), or None."""

    @abc.abstractmethod
    def get_credential(self, credential_id: str) -> dict | None:
        """The credential with this id, or None."""

    @abc.abstractmethod
    def list_credentials(self, room_id: str) -> list[dict]:
        """Every credential of the room, revoked ones too, oldest first."""

    @abc.abstractmethod
    def revoke_credential(self, credential_id: str, at: float) -> dict | None:
        """Set ``revoked_at`` of a credential not revoked yet, unless it is a ``submitter`` one
        and the room has no other unrevoked ``submitter`` credential. Returns it after, or None
        (nothing changed)."""

    @abc.abstractmethod
    def rotate_credential(self, credential_id: str, secret_hash: str, at: float) -> dict | None:
        """Give a credential not revoked a new secret: ``hash`` replaced (the old secret opens
        nothing from now on), ``rotated_at`` set, ``legacy`` cleared. Returns it after, or None."""

    # -- GPU clients and slots --------------------------------------------------------------
    @abc.abstractmethod
    def upsert_client(self, client: dict, slots: list[dict]) -> bool:
        """Insert or replace a GPU client ``{id, room_id, hostname, status, last_seen,
        secret_hash, ...}`` and its slots ``{id, client_id, room_id, index, name, memory_total,
        memory_free, utilization}``. Slots keep their ``job_id``/``rank`` if they already exist.
        A client of that id already stored is replaced only if it is of the same room and its
        ``secret_hash`` is the one given (or it has none: registered before clients had
        secrets); otherwise nothing changes and it returns False."""

    @abc.abstractmethod
    def get_client(self, client_id: str) -> dict | None:
        """The client, or None."""

    @abc.abstractmethod
    def list_clients(self, room_id: str | None, lost_before: float | None = None) -> list[dict]:
        """Every client of the room (of every room when None), each with its ``slots`` list,
        oldest first; with ``lost_before``, only those whose ``lost_after`` is earlier (the
        reaper's question, answered without reading every client)."""

    def _with_slots(self, clients: list[dict], room_id: str | None, every: bool = True) -> list[dict]:
        """Give each client document its ``slots`` list (for ``list_clients``): from one listing
        of the room's slots when ``clients`` are ``every`` client of it, else client by client."""
        by_id = {c["id"]: c for c in clients}
        for c in clients:
            c["slots"] = []
        slots = self.list_slots(room_id) if every else [s for c in clients for s in self.list_slots(None, c["id"])]
        for slot in slots:
            if slot["client_id"] in by_id:
                by_id[slot["client_id"]]["slots"].append(slot)
        return clients

    @abc.abstractmethod
    def update_client(self, client_id: str, changes: dict) -> None:
        """Set fields of a client (``status``, ``last_seen``, ``sid``...)."""

    @abc.abstractmethod
    def touch_client(self, client_id: str, changes: dict, stats: list[dict],
                     expect_status: str | None = None) -> bool:
        """A heartbeat, in one write: if the client exists (and its ``status`` is
        ``expect_status``, when given), set ``changes`` (top-level fields: ``last_seen``,
        ``lost_after``) on it and refresh ``memory_free``/``utilization``/``memory_total`` of
        its slots by ``index`` from ``stats`` (slots it does not have are skipped). Returns
        False, changing nothing, otherwise."""

    def touch_clients(self, touches: list[tuple[str, dict, list[dict]]], expect_status: str | None = None) -> list[str]:
        """Several ``touch_client`` calls ``(client_id, changes, stats)`` together (a server
        process writes its GPU clients' figures once a second, ``presence.py``); the ids of
        those that were not there (or not in ``expect_status``), which changed nothing. A
        backend may make them one transaction (SQLite does)."""
        return [cid for cid, changes, stats in touches if not self.touch_client(cid, changes, stats, expect_status)]

    @abc.abstractmethod
    def release_clients_of(self, server: str, changes: dict) -> list[str]:
        """Set ``changes`` on every ``online`` GPU client whose ``server`` field is ``server`` (a
        server process found dead, ``presence.py``), each in one conditional write: one that
        registered meanwhile through another process is left alone. The ids changed."""

    @abc.abstractmethod
    def remove_clients(self, room_id: str, seen_before: float) -> list[str]:
        """Remove the room's GPU clients that are ``offline``, were last seen (``last_seen``)
        before ``seen_before`` and hold no slot with a job, with their slots; a client that is
        online again or running ranks when its turn comes stays. The ids removed."""

    @abc.abstractmethod
    def list_slots(self, room_id: str | None, client_id: str | None = None) -> list[dict]:
        """Every slot of the room (every room when None), or only the slots of one client of
        it, with ``job_id`` and ``rank``, by client id and index."""

    @abc.abstractmethod
    def reserve_slots(self, job_id: str, assignments: list[tuple[str, int]], fields: Mapping[str, Any],
                      when: Iterable[str] | None = None) -> bool:
        """Atomically: if the job is ``queued`` or ``resuming`` (or one of ``when``: a running
        DILOCO job taking a worker) and every slot in ``assignments``
        (``(slot_id, rank)`` pairs) is free, give the slots to the job and set its top-level
        ``fields`` (as ``set_job``). Returns False, changing nothing, otherwise."""

    @abc.abstractmethod
    def release_slots(self, job_id: str, client_id: str | None = None) -> int:
        """Free the job's slots (only that client's, if given). Returns how many."""

    # -- jobs: small verbs over the typed record ---------------------------------------------
    @abc.abstractmethod
    def create_job(self, job: JobRecord) -> JobRecord:
        """Insert a job; the store assigns ``seq``, its FIFO position. Returns it with its ``seq``.
        A job id already stored is a ``StoreError``."""

    @abc.abstractmethod
    def get_job(self, job_id: str) -> JobRecord | None:
        """The job, or None."""

    @abc.abstractmethod
    def count_jobs(self, room_id: str, statuses: Iterable[str], before_seq: int | None = None) -> int:
        """How many jobs of the room are in one of ``statuses`` (submitted before the job
        whose ``seq`` is ``before_seq``, when given): a queued job's place in line."""

    @abc.abstractmethod
    def job_counts(self) -> dict[tuple[str, str], int]:
        """How many jobs each room has in each status, ``(room_id, status) -> n``, counted by the
        store (``GET /metrics`` reads it at every scrape)."""

    @abc.abstractmethod
    def job_rooms(self, statuses: Iterable[str]) -> list[str]:
        """The rooms that have jobs in one of ``statuses``, by their oldest such job; read from
        what the store indexes, without reading the jobs (the scheduler places room by room, so
        that one room's records never stop another's)."""

    @abc.abstractmethod
    def job_ids(self, room_id: str, statuses: Iterable[str]) -> list[str]:
        """The ids of the room's jobs in one of ``statuses``, in submission order, without reading them."""

    @abc.abstractmethod
    def list_jobs(self, room_id: str | None = None, statuses: Iterable[str] | None = None,
                  limit: int | None = None, parallelism: str | None = None,
                  unsettled: bool = False) -> list[JobRecord]:
        """Jobs of a room (every room when None), filtered by status, in submission order; with
        ``parallelism``, only the jobs of that mode; with ``unsettled``, only those a settling pass
        must look at (``Job.overdue``): a rank failed (``failing_since``) or lost its peers
        (``suspect_since``), or the job is starting with no rendezvous yet (``master`` null).
        The filters run in the database: the scheduler's passes parse only what they act on."""

    @abc.abstractmethod
    def set_job(self, job_id: str, fields: Mapping[str, Any], when: Iterable[str] | None = None,
                unless_set: str | None = None) -> JobRecord | None:
        """Set top-level fields (names of ``Job``'s fields, values of their types), if the
        job's status is one of ``when`` (any when None) and, with ``unless_set``, that field
        is still null. Returns the record after the write, or None: nothing changed."""

    @abc.abstractmethod
    def put_job_entries(self, job_id: str, field: str, entries: Mapping[str, Any],
                        when: Iterable[str] | None = None) -> JobRecord | None:
        """Set entries of one per-rank map (``ranks``, ``exits``, ``failures``: rank -> value),
        keeping its other entries, if the job's status is one of ``when``. Returns the record
        after, or None."""

    @abc.abstractmethod
    def append_job(self, job_id: str, items: Mapping[str, Any], fields: Mapping[str, Any] | None = None,
                   when: Iterable[str] | None = None, keep_last: int | None = None) -> JobRecord | None:
        """Append one item to each list field named in ``items`` (``timeline``,
        ``restart_history``, ``checkpoints``), keeping only the last ``keep_last`` items of
        each when given, and set the top-level ``fields`` in the same write, if the job's
        status is one of ``when``. Returns the record after, or None."""

    # -- events (metrics and logs) ---------------------------------------------------------
    @abc.abstractmethod
    def add_events(self, job_id: str, events: list[dict]) -> list[dict]:
        """Append events ``{kind, rank, key, step, data, ts}``. An event whose ``(rank, key)``
        the job already holds is dropped (resent batches are not counted twice). Returns the
        events stored, each with its ``seq``, increasing per job. Each event stored is counted
        to the job's room (``room_event_usage``): one, and its ``event_bytes``."""

    def add_event_batches(self, batches: list[tuple[str, list[dict]]]) -> list[list[dict]]:
        """``add_events`` for several ``(job_id, events)`` at once (``batches.py``'s group
        commit), in order: for each, the events stored. A backend may make them one
        transaction (SQLite does); a job's events are stored once either way."""
        return [self.add_events(job_id, events) for job_id, events in batches]

    @abc.abstractmethod
    def get_events(self, job_id: str, after: int = 0, kind: str | None = None,
                   limit: int | None = None) -> list[dict]:
        """The job's events with ``seq > after``, in order."""

    @abc.abstractmethod
    def last_event_seq(self, job_id: str) -> int:
        """The ``seq`` of the job's last event (0: it has none), from the index alone."""

    @abc.abstractmethod
    def room_event_usage(self, room_id: str) -> dict[str, int]:
        """``{"events": n, "bytes": b}``: the events the room's jobs hold and their
        ``event_bytes`` added up, read from a counter (not from the events). Events stored
        before rooms had counters are added up once, by the first ``add_events`` of the room."""

    # -- artifacts' metadata ---------------------------------------------------------------
    @abc.abstractmethod
    def add_artifact(self, artifact: dict) -> dict:
        """Insert ``{id, room_id, kind, size, sha256, job_id, created_at}``."""

    @abc.abstractmethod
    def get_artifact(self, artifact_id: str) -> dict | None:
        """The artifact's metadata, or None."""

    @abc.abstractmethod
    def update_artifact(self, artifact_id: str, changes: dict) -> None:
        """Set fields of an artifact's metadata (``job_id``)."""

    @abc.abstractmethod
    def list_artifacts(self, job_id: str, kind: str | None = None) -> list[dict]:
        """The job's artifacts, oldest first."""

    @abc.abstractmethod
    def find_artifact(self, room_id: str, kind: str, sha256: str) -> dict | None:
        """The room's oldest artifact of that kind with those bytes (a working dir by its
        sha256), or None."""

    @abc.abstractmethod
    def list_room_artifacts(self, room_id: str, kind: str) -> list[dict]:
        """The room's artifacts of that kind (a room dataset's chunks and manifests), oldest first."""

    @abc.abstractmethod
    def delete_artifact(self, artifact_id: str, if_unattached: bool = False) -> bool:
        """Forget an artifact's metadata (with ``if_unattached``, only while it belongs to no
        job: one conditional write, so a submit that attaches it meanwhile wins). True if it was
        forgotten."""

    # -- quotas and garbage collection (``zwdx.server.limits``, ``zwdx.server.sweeper``) ----------
    @abc.abstractmethod
    def room_artifact_bytes(self, room_id: str) -> int:
        """The sizes of the room's artifacts, added up."""

    @abc.abstractmethod
    def list_unattached_artifacts(self, created_before: float) -> list[dict]:
        """Artifacts that belong to no job (bundles never submitted) created before then."""

    @abc.abstractmethod
    def known_artifacts(self, artifact_ids: Iterable[str]) -> set[str]:
        """Which of these ids name an artifact's metadata (bytes without it are garbage)."""

    # -- leases (one holder at a time across server processes: the scheduler's) ------------------
    @abc.abstractmethod
    def take_lease(self, name: str, holder: str, ttl: float, now: float | None = None) -> float | None:
        """Take lease ``name`` for ``holder``, or renew it, until ``now + ttl``: one atomic write
        that applies only while the lease is free, expired, or ``holder``'s already. Returns the
        new expiry, or None while another holder has it. ``now`` is this process's clock: the
        servers that share a lease need clocks that agree to well within ``ttl``."""

    @abc.abstractmethod
    def release_lease(self, name: str, holder: str) -> bool:
        """Give lease ``name`` up, if ``holder`` has it (another may take it at once)."""

    @abc.abstractmethod
    def lease_holder(self, name: str, now: float | None = None) -> str | None:
        """Who holds lease ``name`` now, or None when it is free or expired."""
