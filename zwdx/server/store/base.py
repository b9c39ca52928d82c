"""The store interface: rooms, GPU clients and their slots, jobs, job events, artifacts' metadata.

Every backend (``sqlite.SQLiteStore``, the embedded default, and ``mongo.MongoStore``)
implements these methods with the same behaviour; ``test/test_store_contract.py`` runs one
suite against each. Documents are plain dicts with lowercase string keys; ids are strings.

Atomicity promises (the scheduler relies on them, across threads and processes):
- ``reserve_slots`` gives a slot to at most one job and moves the job out of ``queued`` (or
  ``resuming``) at most once: all of it happens or none of it does.
- ``update_job`` with ``expect_status`` changes a job only if it is still in one of those states.
- ``touch_client`` changes a client only if it is still in ``expect_status``. On SQLite the
  client and its slots' stats change in one transaction; on MongoDB (single-document
  atomicity) the slots' stats follow the client's update in one more round trip.
"""
from __future__ import annotations

import abc
from typing import Iterable

#: The layout version this code writes. Bump it and add a migration when the layout changes.
SCHEMA_VERSION = 1


#: What a heartbeat refreshes on a slot (``touch_client``).
SLOT_STATS = ("memory_free", "utilization", "memory_total")


class Store(abc.ABC):
    """Abstract store. Methods raise ``zwdx.errors.StoreError`` when the backend fails."""

    # -- lifecycle -------------------------------------------------------------------------
    @abc.abstractmethod
    def ping(self) -> bool:
        """True when the backend answers (used by ``GET /health``)."""

    @abc.abstractmethod
    def schema_version(self) -> int:
        """The layout version recorded in the store."""

    def close(self) -> None:
        """Release connections. The store may not be used afterwards."""

    # -- rooms -----------------------------------------------------------------------------
    @abc.abstractmethod
    def create_room(self, room: dict) -> dict:
        """Insert a room ``{id, name, token_hash, created_at}``. Returns it."""

    @abc.abstractmethod
    def get_room(self, room_id: str) -> dict | None:
        """The room with this id, or None."""

    @abc.abstractmethod
    def find_room_by_token_hash(self, token_hash: str) -> dict | None:
        """The room whose token hashes to ``token_hash``, or None."""

    # -- GPU clients and slots --------------------------------------------------------------
    @abc.abstractmethod
    def upsert_client(self, client: dict, slots: list[dict]) -> None:
        """Insert or replace a GPU client ``{id, room_id, hostname, status, last_seen, ...}``
        and its slots ``{id, client_id, room_id, index, name, memory_total, memory_free,
        utilization}``. Slots keep their ``job_id``/``rank`` if they already exist."""

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

    @abc.abstractmethod
    def list_slots(self, room_id: str | None, client_id: str | None = None) -> list[dict]:
        """Every slot of the room (every room when None), or only the slots of one client of
        it, with ``job_id`` and ``rank``, by client id and index."""

    @abc.abstractmethod
    def reserve_slots(self, job_id: str, assignments: list[tuple[str, int]], changes: dict) -> bool:
        """Atomically: if the job is ``queued`` or ``resuming`` and every slot in ``assignments``
        (``(slot_id, rank)`` pairs) is free, give the slots to the job and apply ``changes``
        to the job. Returns False, changing nothing, otherwise."""

    @abc.abstractmethod
    def release_slots(self, job_id: str, client_id: str | None = None) -> int:
        """Free the job's slots (only that client's, if given). Returns how many."""

    # -- jobs ------------------------------------------------------------------------------
    @abc.abstractmethod
    def create_job(self, job: dict) -> dict:
        """Insert a job; the store assigns ``seq``, its FIFO position. Returns it."""

    @abc.abstractmethod
    def get_job(self, job_id: str) -> dict | None:
        """The job, or None."""

    @abc.abstractmethod
    def count_jobs(self, room_id: str, statuses: Iterable[str], before_seq: int | None = None) -> int:
        """How many jobs of the room are in one of ``statuses`` (submitted before the job
        whose ``seq`` is ``before_seq``, when given): a queued job's place in line."""

    @abc.abstractmethod
    def list_jobs(self, room_id: str | None = None, statuses: Iterable[str] | None = None,
                  limit: int | None = None) -> list[dict]:
        """Jobs of a room (every room when None), filtered by status, in submission order."""

    @abc.abstractmethod
    def update_job(self, job_id: str, changes: dict, expect_status: Iterable[str] | None = None,
                   push: dict | None = None) -> dict | None:
        """Set ``changes`` (keys may be dotted paths, ``"ranks.0"``, as in MongoDB's $set;
        and append each ``push`` value to its list field) if the job's
        status is in ``expect_status`` (any status when None). Returns the new job or None."""

    # -- events (metrics and logs) ---------------------------------------------------------
    @abc.abstractmethod
    def add_events(self, job_id: str, events: list[dict]) -> list[dict]:
        """Append events ``{kind, rank, key, step, data, ts}``. An event whose ``(rank, key)``
        the job already holds is dropped (resent batches are not counted twice). Returns the
        events stored, each with its ``seq``, increasing per job."""

    @abc.abstractmethod
    def get_events(self, job_id: str, after: int = 0, kind: str | None = None,
                   limit: int | None = None) -> list[dict]:
        """The job's events with ``seq > after``, in order."""

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
    def delete_artifact(self, artifact_id: str) -> None:
        """Forget an artifact's metadata."""
