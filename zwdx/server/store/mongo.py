"""The MongoDB store (pymongo) and artifact bytes in GridFS: chosen with ``zwdx server
--mongo-uri URI`` or ``ZWDX_MONGO_URI``. The database is the URI's path, or "zwdx".

Collections: ``meta`` (the schema version), ``rooms``, ``clients``, ``slots``, ``jobs``,
``events``, ``artifacts`` (metadata), ``counters``, and the GridFS bucket ``artifacts``.

Every atomic step is one single-document operation with a precondition, so it holds on a
standalone server without transactions, across threads and server processes:

- A slot is claimed with ``find_one_and_update({_id, job_id: None})``; a reservation that
  cannot claim every slot gives back the ones it took, and one whose job left ``queued``
  (or ``resuming``) meanwhile (``find_one_and_update({_id, status: {$in: [...]}})``) gives
  back all of them.
  Each claim carries a token and stays pending until the job moved; a claim left pending by
  a server killed mid-reservation is fenced off its job and freed once it is
  ``STALE_CLAIM_S`` old (see ``_heal``).
- Every write to a job bumps its ``_rev``. ``update_job`` with ``push`` reads the job and
  writes it back only if ``_rev`` did not move (compare-and-set, retried): the appended
  lists are written whole, which also works on wire-compatible servers whose ``$push`` is
  unreliable (nx-27017 0.8 turns existing list items into JSON strings).
- Event and job ``seq`` numbers are the last one plus one, inserted under a unique index
  and retried on collision: they are gapless, and a reader that saw ``seq`` N has seen
  every smaller one (a counter handed out before the insert would not promise that).
"""
from __future__ import annotations

import functools
import json
import logging
import random
import time
import uuid
from typing import Callable

from pymongo import ASCENDING, DESCENDING, MongoClient, ReturnDocument, UpdateOne, uri_parser
from pymongo.database import Database
from pymongo.errors import BulkWriteError, DuplicateKeyError, PyMongoError

from ...errors import SchemaVersionError, StoreError
from .base import SCHEMA_VERSION, SLOT_STATS, Store

log = logging.getLogger(__name__)

#: Migrations from version N to N+1: each takes the database and must be safe to run twice
#: (two servers may start at once).
MIGRATIONS: dict[int, Callable[[Database], None]] = {}

#: A slot claim still pending after this long was left by a reservation that never finished
#: (a killed server); ``list_slots`` settles it. Reservations take milliseconds.
STALE_CLAIM_S = 60.0

#: The states a job is reserved from.
_WAITING = ["queued", "resuming"]

#: Fields the store keeps for itself; never returned.
_INTERNAL = ("_id", "_rev", "_order", "_claim", "_claimed_at", "_fences", "_moved")


_INDEXES = {
    "rooms": [([("token_hash", ASCENDING)], True)],
    "clients": [([("room_id", ASCENDING), ("_order", ASCENDING)], False), ([("_order", ASCENDING)], False),
                ([("doc.lost_after", ASCENDING)], False)],
    "slots": [([("room_id", ASCENDING), ("client_id", ASCENDING), ("index", ASCENDING)], False),
              ([("client_id", ASCENDING), ("index", ASCENDING)], False),
              ([("job_id", ASCENDING)], False)],
    "jobs": [([("seq", ASCENDING)], True),
             ([("room_id", ASCENDING), ("status", ASCENDING), ("seq", ASCENDING)], False),
             ([("status", ASCENDING), ("seq", ASCENDING)], False)],
    "events": [([("job_id", ASCENDING), ("seq", ASCENDING)], True),
               ([("job_id", ASCENDING), ("rank", ASCENDING), ("key", ASCENDING)], True),
               ([("job_id", ASCENDING), ("kind", ASCENDING), ("seq", ASCENDING)], False),
               ([("job_id", ASCENDING), ("kind", ASCENDING), ("step", ASCENDING)], False)],
    "artifacts": [([("job_id", ASCENDING), ("kind", ASCENDING), ("_order", ASCENDING)], False)],
}


def connect(uri: str, client: MongoClient | None = None) -> tuple[MongoClient, Database]:
    """A client and the URI's database ("zwdx" when the URI names none), checked with a ping;
    with ``client``, that client (shared by the store and GridFS) and its default database."""
    if client is not None:
        return client, client.get_default_database(default="zwdx")
    where = describe(uri)
    options = {} if "serverselectiontimeoutms" in uri.lower() else {"serverSelectionTimeoutMS": 5000}
    try:
        client = MongoClient(uri, **options)
        client.admin.command("ping")
    except (PyMongoError, ValueError) as exc:
        raise StoreError(f"cannot reach MongoDB at {where}: {exc}", mongo=where) from exc
    return client, client.get_default_database(default="zwdx")


def describe(uri: str) -> str:
    """``host:port/db`` of a URI, without the credentials it may hold."""
    try:
        parsed = uri_parser.parse_uri(uri)
    except (ValueError, PyMongoError):
        return "(unparsable MongoDB URI)"
    hosts = ",".join(f"{h}:{p}" for h, p in parsed["nodelist"])
    return f"{hosts}/{parsed.get('database') or 'zwdx'}"


def _plain(value):
    """The value as the embedded store keeps it: JSON types only (int keys become strings)."""
    return json.loads(json.dumps(value))


def _public(doc: dict | None, drop: tuple = ()) -> dict | None:
    if doc is None:
        return None
    return {k: v for k, v in doc.items() if k not in _INTERNAL and k not in drop}


def _now() -> float:
    return time.time()


def _status(value) -> str:
    return str(getattr(value, "value", value))


def _guarded(cls):
    """Turn pymongo's errors, in every public method, into StoreError."""
    def guard(fn):
        @functools.wraps(fn)
        def method(self, *args, **kwargs):
            try:
                return fn(self, *args, **kwargs)
            except PyMongoError as exc:
                raise StoreError(f"MongoDB {fn.__name__} failed: {exc}") from exc
        return method
    for name, fn in list(vars(cls).items()):
        if callable(fn) and not name.startswith("_"):
            setattr(cls, name, guard(fn))
    return cls


@_guarded
class MongoStore(Store):
    """The Store in a MongoDB database; see the module's docstring for what keeps it atomic."""

    def __init__(self, uri: str, client: MongoClient | None = None):
        self.where = describe(uri)
        self._client, self.db = connect(uri, client)
        db = self.db
        self._meta, self._rooms, self._clients, self._slots = db.meta, db.rooms, db.clients, db.slots
        self._jobs, self._events, self._artifacts, self._counters = db.jobs, db.events, db.artifacts, db.counters
        try:
            self._check_schema()
            for name, indexes in _INDEXES.items():
                for keys, unique in indexes:
                    db[name].create_index(keys, unique=unique)
        except PyMongoError as exc:
            raise StoreError(f"cannot prepare the MongoDB store at {self.where}: {exc}") from exc

    # -- plumbing ----------------------------------------------------------------------------
    def _check_schema(self) -> None:
        doc = self._meta.find_one({"_id": "schema"})
        if doc is None:
            try:
                self._meta.insert_one({"_id": "schema", "version": SCHEMA_VERSION})
            except DuplicateKeyError:
                pass  # another server created it first
            doc = self._meta.find_one({"_id": "schema"})
        found = int(doc["version"])
        if found > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"the store at {self.where} has schema version {found}, newer than this zwdx "
                f"understands ({SCHEMA_VERSION}); upgrade zwdx", found=found, supported=SCHEMA_VERSION)
        while found < SCHEMA_VERSION:
            step = MIGRATIONS.get(found)
            if step is not None:
                step(self.db)
            self._meta.update_one({"_id": "schema", "version": found}, {"$set": {"version": found + 1}})
            found += 1
            log.info("store: migrated %s to schema version %d", self.where, found)

    def _next(self, name: str) -> int:
        doc = self._counters.find_one_and_update({"_id": name}, {"$inc": {"n": 1}}, upsert=True,
                                                 return_document=ReturnDocument.AFTER)
        return int(doc["n"])

    def _last_seq(self, coll, scope: dict) -> int:
        doc = coll.find_one(scope, {"seq": 1}, sort=[("seq", DESCENDING)])
        return int(doc["seq"]) if doc else 0

    # -- lifecycle -------------------------------------------------------------------------
    def ping(self) -> bool:
        try:
            self._client.admin.command("ping")
            return True
        except PyMongoError:
            return False

    def schema_version(self) -> int:
        return int(self._meta.find_one({"_id": "schema"})["version"])

    def close(self) -> None:
        self._client.close()

    # -- rooms -----------------------------------------------------------------------------
    def create_room(self, room: dict) -> dict:
        self._rooms.insert_one({**_plain(room), "_id": room["id"]})
        return room

    def get_room(self, room_id: str) -> dict | None:
        return _public(self._rooms.find_one({"_id": room_id}))

    def find_room_by_token_hash(self, token_hash: str) -> dict | None:
        return _public(self._rooms.find_one({"token_hash": token_hash}))

    # -- GPU clients and slots --------------------------------------------------------------
    # Clients and slots keep the caller's document whole under "doc" (replaced on upsert, as
    # the embedded store does); what the store queries and claims sits beside it.
    def upsert_client(self, client: dict, slots: list[dict]) -> None:
        client, slots = _plain(client), _plain(slots)
        cid, room_id = client["id"], client["room_id"]
        if not self._clients.update_one({"_id": cid}, {"$set": {"room_id": room_id, "doc": client}}).matched_count:
            try:
                self._clients.insert_one({"_id": cid, "room_id": room_id, "doc": client,
                                          "_order": self._next("clients")})
            except DuplicateKeyError:  # registered twice at once: the other insert won
                self._clients.update_one({"_id": cid}, {"$set": {"room_id": room_id, "doc": client}})
        self._slots.delete_many({"client_id": cid, "job_id": None, "_id": {"$nin": [s["id"] for s in slots]}})
        for slot in slots:
            fields = {"room_id": room_id, "index": slot["index"], "doc": slot}
            if not self._slots.update_one({"_id": slot["id"]}, {"$set": fields}).matched_count:
                try:
                    self._slots.insert_one({"_id": slot["id"], "client_id": cid, **fields,
                                            "job_id": None, "rank": None})
                except DuplicateKeyError:
                    self._slots.update_one({"_id": slot["id"]}, {"$set": fields})

    def get_client(self, client_id: str) -> dict | None:
        doc = self._clients.find_one({"_id": client_id})
        return doc["doc"] if doc else None

    def list_clients(self, room_id: str | None, lost_before: float | None = None) -> list[dict]:
        where = {} if room_id is None else {"room_id": room_id}
        if lost_before is not None:
            where["doc.lost_after"] = {"$lt": float(lost_before)}
        clients = [d["doc"] for d in self._clients.find(where).sort("_order", ASCENDING)]
        return self._with_slots(clients, room_id, every=lost_before is None)

    def update_client(self, client_id: str, changes: dict) -> None:
        if changes:
            self._clients.update_one({"_id": client_id},
                                     {"$set": {f"doc.{k}": v for k, v in _plain(changes).items()}})

    def touch_client(self, client_id: str, changes: dict, stats: list[dict],
                     expect_status: str | None = None) -> bool:
        where = {"_id": client_id, **({"doc.status": expect_status} if expect_status is not None else {})}
        sets = {f"doc.{k}": v for k, v in _plain(changes).items()}
        found = self._clients.update_one(where, {"$set": sets}).matched_count if sets else \
            self._clients.find_one(where, {"_id": 1}) is not None
        if not found:
            return False
        updates = []
        for stat in _plain(stats):
            fields = {f"doc.{k}": stat[k] for k in SLOT_STATS if k in stat}
            if fields:
                updates.append(UpdateOne({"client_id": client_id, "index": stat["index"]}, {"$set": fields}))
        if updates:  # one round trip for every slot
            self._slots.bulk_write(updates, ordered=False)
        return True

    def list_slots(self, room_id: str | None, client_id: str | None = None) -> list[dict]:
        where = {} if room_id is None else {"room_id": room_id}
        if client_id is not None:
            where["client_id"] = client_id
        order = [("client_id", ASCENDING), ("index", ASCENDING)]
        docs = list(self._slots.find(where).sort(order))
        stale = [d for d in docs if (d.get("_claimed_at") or _now()) < _now() - STALE_CLAIM_S]
        if stale and sum(self._heal(d) for d in stale):
            docs = list(self._slots.find(where).sort(order))
        return [{**d["doc"], "job_id": d.get("job_id"), "rank": d.get("rank")} for d in docs]

    def reserve_slots(self, job_id: str, assignments: list[tuple[str, int]], changes: dict) -> bool:
        if self._jobs.find_one({"_id": job_id, "status": {"$in": _WAITING}}, {"_id": 1}) is None:
            return False
        token, claimed = uuid.uuid4().hex, []
        try:
            for slot_id, rank in assignments:
                if self._slots.find_one_and_update(
                        {"_id": slot_id, "job_id": None},
                        {"$set": {"job_id": job_id, "rank": rank, "_claim": token, "_claimed_at": _now()}}) is None:
                    return False
                claimed.append(slot_id)
            moved = self._jobs.find_one_and_update(
                {"_id": job_id, "status": {"$in": _WAITING}, f"_fences.{token}": {"$exists": False}},
                {"$set": {**_plain(changes), f"_moved.{token}": True}, "$inc": {"_rev": 1}})
            if moved is None:
                return False
            kept, claimed = claimed, []  # the job owns them now: no longer a pending claim
            self._slots.update_many({"_id": {"$in": kept}, "_claim": token}, {"$set": {"_claimed_at": None}})
            return True
        finally:
            if claimed:
                self._free({"_id": {"$in": claimed}, "_claim": token})

    def _heal(self, slot: dict) -> bool:
        """Settle a claim still pending after STALE_CLAIM_S: its reservation was cut short (a
        killed server). If that reservation never moved its job, fence the job against it (one
        conditional write: should it still run, it can no longer move the job and gives its
        slots back) and free the slot. Otherwise the slot is the job's; stop looking at it.
        True if the slot was freed."""
        token, job_id = slot.get("_claim"), slot.get("job_id")
        fenced = self._jobs.find_one_and_update({"_id": job_id, f"_moved.{token}": {"$exists": False}},
                                                {"$set": {f"_fences.{token}": True}, "$inc": {"_rev": 1}})
        if fenced is None and self._jobs.find_one({"_id": job_id}, {"_id": 1}) is not None:
            self._slots.update_one({"_id": slot["_id"], "_claim": token}, {"$set": {"_claimed_at": None}})
            return False
        freed = self._free({"_id": slot["_id"], "_claim": token})
        if freed:
            log.warning("store: freed slot %s, claimed %.0f s ago for job %s by a reservation that never "
                        "finished", slot["_id"], _now() - slot["_claimed_at"], job_id)
        return freed == 1

    def _free(self, where: dict) -> int:
        return self._slots.update_many(where, {"$set": {"job_id": None, "rank": None, "_claim": None,
                                                        "_claimed_at": None}}).modified_count

    def release_slots(self, job_id: str, client_id: str | None = None) -> int:
        where = {"job_id": job_id}
        if client_id is not None:
            where["client_id"] = client_id
        return self._free(where)

    # -- jobs ------------------------------------------------------------------------------
    def create_job(self, job: dict) -> dict:
        job = _plain(job)
        for _ in range(1000):
            seq = self._last_seq(self._jobs, {}) + 1
            try:
                self._jobs.insert_one({**job, "seq": seq, "_id": job["id"], "_rev": 0})
                return {**job, "seq": seq}
            except DuplicateKeyError:
                if self._jobs.find_one({"_id": job["id"]}, {"_id": 1}) is not None:
                    raise StoreError(f"job {job['id']} already exists", job_id=job["id"])
        raise StoreError(f"could not give job {job['id']} a queue position", job_id=job["id"])

    def get_job(self, job_id: str) -> dict | None:
        return _public(self._jobs.find_one({"_id": job_id}))

    def count_jobs(self, room_id: str, statuses, before_seq: int | None = None) -> int:
        where = {"room_id": room_id, "status": {"$in": [_status(s) for s in statuses]}}
        if before_seq is not None:
            where["seq"] = {"$lt": int(before_seq)}
        return self._jobs.count_documents(where)

    def list_jobs(self, room_id=None, statuses=None, limit=None) -> list[dict]:
        where = {} if room_id is None else {"room_id": room_id}
        if statuses is not None:
            where["status"] = {"$in": [_status(s) for s in statuses]}
        cursor = self._jobs.find(where).sort("seq", ASCENDING)
        if limit:
            cursor = cursor.limit(int(limit))
        return [_public(d) for d in cursor]

    def update_job(self, job_id, changes, expect_status=None, push=None) -> dict | None:
        changes, push = _plain(changes), _plain(push or {})
        where = {"_id": job_id}
        if expect_status is not None:
            where["status"] = {"$in": [_status(s) for s in expect_status]}
        if not push:
            update = {"$inc": {"_rev": 1}, **({"$set": changes} if changes else {})}
            return _public(self._jobs.find_one_and_update(where, update, return_document=ReturnDocument.AFTER))
        for attempt in range(200):
            current = self._jobs.find_one(where)
            if current is None:
                return None
            after = json.loads(json.dumps(current, default=str))
            for key, value in changes.items():
                *parents, last = key.split(".")
                node = after
                for part in parents:
                    node = node.setdefault(part, {})
                node[last] = value
            sets = dict(changes)
            for key, value in push.items():
                sets[key] = [*(after.get(key) or []), value]
            done = self._jobs.find_one_and_update({**where, "_rev": current.get("_rev", 0)},
                                                  {"$set": sets, "$inc": {"_rev": 1}},
                                                  return_document=ReturnDocument.AFTER)
            if done is not None:
                return _public(done)
            time.sleep(random.uniform(0, 0.001 * min(attempt + 1, 20)))  # another writer won; again
        raise StoreError(f"job {job_id} kept changing; update not applied", job_id=job_id)

    # -- events ----------------------------------------------------------------------------
    def add_events(self, job_id: str, events: list[dict]) -> list[dict]:
        events = _plain(events)
        if not events:
            return []
        held = {(d.get("rank"), d.get("key")) for d in self._events.find(
            {"job_id": job_id, "key": {"$in": list({e.get("key") for e in events})}}, {"rank": 1, "key": 1})}
        todo = []
        for ev in events:
            if (ev.get("rank"), ev.get("key")) not in held:
                held.add((ev.get("rank"), ev.get("key")))
                todo.append(ev)
        stored = []
        for _ in range(1000):
            if not todo:
                return stored
            last = self._last_seq(self._events, {"job_id": job_id})
            batch = [{**ev, "job_id": job_id, "seq": last + i + 1} for i, ev in enumerate(todo)]
            try:
                self._events.insert_many(batch, ordered=True)
                done = len(batch)
            except BulkWriteError as exc:
                errors = exc.details.get("writeErrors") or []
                if not errors or errors[0].get("code") != 11000:
                    raise
                done = errors[0]["index"]
                first = todo[done]
                if self._events.find_one({"job_id": job_id, "rank": first.get("rank"), "key": first.get("key")},
                                         {"_id": 1}) is not None:
                    todo.pop(done)  # sent twice at once: the other copy is stored
                # else another batch took that seq: go round with the new last one
            stored += [{**ev, "seq": b["seq"]} for ev, b in zip(todo[:done], batch)]
            todo = todo[done:]
        raise StoreError(f"could not store events of job {job_id}", job_id=job_id)

    def get_events(self, job_id, after=0, kind=None, limit=None) -> list[dict]:
        where = {"job_id": job_id, "seq": {"$gt": after}}
        if kind:
            where["kind"] = kind
        cursor = self._events.find(where).sort("seq", ASCENDING)
        if limit:
            cursor = cursor.limit(int(limit))
        return [_public(d, drop=("job_id",)) for d in cursor]

    # -- artifacts' metadata ---------------------------------------------------------------
    def add_artifact(self, artifact: dict) -> dict:
        self._artifacts.insert_one({**_plain(artifact), "_id": artifact["id"], "_order": self._next("artifacts")})
        return artifact

    def get_artifact(self, artifact_id: str) -> dict | None:
        return _public(self._artifacts.find_one({"_id": artifact_id}))

    def update_artifact(self, artifact_id: str, changes: dict) -> None:
        if changes:
            self._artifacts.update_one({"_id": artifact_id}, {"$set": _plain(changes)})

    def list_artifacts(self, job_id: str, kind: str | None = None) -> list[dict]:
        where = {"job_id": job_id, **({"kind": kind} if kind else {})}
        return [_public(d) for d in self._artifacts.find(where).sort("_order", ASCENDING)]

    def delete_artifact(self, artifact_id: str) -> None:
        self._artifacts.delete_one({"_id": artifact_id})
