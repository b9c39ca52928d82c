"""The MongoDB store (pymongo) and artifact bytes in GridFS: chosen with ``zwdx server
--mongo-uri URI`` or ``ZWDX_MONGO_URI``. Connecting, indexes and the schema version are in
``mongo_db.py``.

Every atomic step is one single-document operation with a precondition, so it holds on a
standalone server without transactions, across threads and server processes:

- A slot is claimed with ``find_one_and_update({_id, job_id: None})``; a reservation that
  cannot claim every slot gives back the ones it took, and one whose job left ``queued``
  (or ``resuming``) meanwhile (``find_one_and_update({_id, status: {$in: [...]}})``) gives
  back all of them.
  Each claim carries a token and stays pending until the job moved; a claim left pending by
  a server killed mid-reservation is fenced off its job and freed once it is
  ``STALE_CLAIM_S`` old (see ``_heal``).
- A job's verbs are one ``find_one_and_update`` each, its status (and ``unless_set``) in the
  filter; entries of a per-rank map are ``$set`` by path (``ranks.0``).
- Every write to a job bumps its ``_rev``. ``append_job`` reads the job and writes its lists
  back whole only if ``_rev`` did not move (compare-and-set, retried), which also works on
  wire-compatible servers whose ``$push`` is unreliable (nx-27017 0.8 turns existing list
  items into JSON strings).
- Event and job ``seq`` numbers are the last one plus one, inserted under a unique index
  and retried on collision: they are gapless, and a reader that saw ``seq`` N has seen
  every smaller one (a counter handed out before the insert would not promise that).
"""
from __future__ import annotations

import logging
import random
import time
import uuid
from typing import Any, Mapping

from pymongo import ASCENDING, DESCENDING, MongoClient, ReturnDocument, UpdateOne
from pymongo.errors import BulkWriteError, DuplicateKeyError, PyMongoError

from ...errors import StoreError
from ...protocol.job import Job as JobRecord
from ...protocol.vocab import JobStatus
from .base import SLOT_STATS, Store, event_bytes, field_name, job_doc, job_entries, job_fields, job_items, status_values
from .mongo_db import connect, describe, guarded, plain, prepare, schema_version

log = logging.getLogger(__name__)

#: A slot claim still pending after this long was left by a reservation that never finished
#: (a killed server); ``list_slots`` settles it. Reservations take milliseconds.
STALE_CLAIM_S = 60.0

#: The states a job is reserved from.
_WAITING = ["queued", "resuming"]

#: Fields the store keeps for itself; never returned.
_INTERNAL = ("_id", "_rev", "_order", "_claim", "_claimed_at", "_fences", "_moved")

_AFTER = ReturnDocument.AFTER


def _public(doc: dict | None, drop: tuple = ()) -> dict | None:
    if doc is None:
        return None
    return {k: v for k, v in doc.items() if k not in _INTERNAL and k not in drop}


def _record(doc: dict | None) -> JobRecord | None:
    return None if doc is None else JobRecord.model_validate(_public(doc))


def _now() -> float:
    return time.time()


@guarded
class MongoStore(Store):
    """The Store in a MongoDB database; see the module's docstring for what keeps it atomic."""

    def __init__(self, uri: str, client: MongoClient | None = None):
        self.where = describe(uri)
        self._client, self.db = connect(uri, client)
        db = self.db
        self._meta, self._rooms, self._clients, self._slots = db.meta, db.rooms, db.clients, db.slots
        self._credentials = db.credentials
        self._jobs, self._events, self._artifacts, self._counters = db.jobs, db.events, db.artifacts, db.counters
        self._leases, self._usage = db.leases, db.event_usage
        prepare(db, self.where)

    # -- plumbing ----------------------------------------------------------------------------
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
        return schema_version(self.db)

    def close(self) -> None:
        self._client.close()

    # -- rooms and their credentials ---------------------------------------------------------
    def create_room(self, room: dict) -> dict:
        try:
            self._rooms.insert_one({**plain(room), "_id": room["id"]})
        except DuplicateKeyError:
            raise StoreError(f"room {room['id']} already exists") from None
        return room

    def get_room(self, room_id: str) -> dict | None:
        return _public(self._rooms.find_one({"_id": room_id}))

    def update_room(self, room_id: str, changes: dict) -> dict | None:
        return _public(self._rooms.find_one_and_update({"_id": room_id}, {"$set": plain(changes)},
                                                       return_document=ReturnDocument.AFTER))

    def add_credential(self, credential: dict) -> dict:
        try:
            self._credentials.insert_one({**plain(credential), "_id": credential["id"],
                                          "_order": self._next("credentials")})
        except DuplicateKeyError:
            raise StoreError(f"credential {credential['id']} (or its secret) already exists") from None
        return credential

    def find_credential(self, secret_hash: str) -> dict | None:
        return _public(self._credentials.find_one({"hash": str(secret_hash)}))

    def get_credential(self, credential_id: str) -> dict | None:
        return _public(self._credentials.find_one({"_id": str(credential_id)}))

    def list_credentials(self, room_id: str) -> list[dict]:
        return [_public(d) for d in self._credentials.find({"room_id": str(room_id)}).sort("_order", ASCENDING)]

    def revoke_credential(self, credential_id: str, at: float) -> dict | None:
        """Revoke, then look: if that left the room without a submitter credential, take it
        back (a compare-and-undo: two revocations racing for the last two may both be undone,
        never both kept)."""
        doc = self._credentials.find_one_and_update({"_id": str(credential_id), "revoked_at": None},
                                                    {"$set": {"revoked_at": float(at)}}, return_document=_AFTER)
        if doc is None:
            return None
        if doc.get("role") == "submitter" and self._credentials.find_one(  # (nx-27017 counts no nulls)
                {"room_id": doc["room_id"], "role": "submitter", "revoked_at": None}, {"_id": 1}) is None:
            # matched on the value as stored (a server may keep fewer digits of a float than were sent)
            self._credentials.update_one({"_id": doc["_id"], "revoked_at": doc["revoked_at"]},
                                         {"$set": {"revoked_at": None}})
            return None
        return _public(doc)

    def rotate_credential(self, credential_id: str, secret_hash: str, at: float) -> dict | None:
        return _public(self._credentials.find_one_and_update(
            {"_id": str(credential_id), "revoked_at": None},
            {"$set": {"hash": str(secret_hash), "rotated_at": float(at), "legacy": False}}, return_document=_AFTER))

    # -- GPU clients and slots --------------------------------------------------------------
    # Clients and slots keep the caller's document whole under "doc" (replaced on upsert, as
    # the embedded store does); what the store queries and claims sits beside it.
    def upsert_client(self, client: dict, slots: list[dict]) -> bool:
        client, slots = plain(client), plain(slots)
        cid, room_id = client["id"], client["room_id"]
        same = {"_id": cid, "room_id": room_id, "doc.secret_hash": {"$in": [client.get("secret_hash"), None]}}
        if not self._clients.update_one(same, {"$set": {"doc": client}}).matched_count:
            try:
                self._clients.insert_one({"_id": cid, "room_id": room_id, "doc": client,
                                          "_order": self._next("clients")})
            except DuplicateKeyError:  # another room's, another secret's, or registered at once elsewhere
                return False
        self._slots.delete_many({"client_id": cid, "job_id": None, "_id": {"$nin": [s["id"] for s in slots]}})
        for slot in slots:
            fields = {"room_id": room_id, "index": slot["index"], "doc": slot}
            if not self._slots.update_one({"_id": slot["id"]}, {"$set": fields}).matched_count:
                try:
                    self._slots.insert_one({"_id": slot["id"], "client_id": cid, **fields,
                                            "job_id": None, "rank": None})
                except DuplicateKeyError:
                    self._slots.update_one({"_id": slot["id"]}, {"$set": fields})
        return True

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
                                     {"$set": {f"doc.{k}": v for k, v in plain(changes).items()}})

    def release_clients_of(self, server: str, changes: dict) -> list[str]:
        where = {"doc.server": server, "doc.status": "online"}
        sets = {"$set": {f"doc.{k}": v for k, v in plain(changes).items()}}
        return [d["_id"] for d in self._clients.find(where, {"_id": 1})
                if self._clients.update_one({"_id": d["_id"], **where}, sets).matched_count]

    def touch_client(self, client_id: str, changes: dict, stats: list[dict],
                     expect_status: str | None = None) -> bool:
        where = {"_id": client_id, **({"doc.status": expect_status} if expect_status is not None else {})}
        sets = {f"doc.{k}": v for k, v in plain(changes).items()}
        found = self._clients.update_one(where, {"$set": sets}).matched_count if sets else \
            self._clients.find_one(where, {"_id": 1}) is not None
        if not found:
            return False
        updates = []
        for stat in plain(stats):
            fields = {f"doc.{k}": stat[k] for k in SLOT_STATS if k in stat}
            if fields:
                updates.append(UpdateOne({"client_id": client_id, "index": stat["index"]}, {"$set": fields}))
        if updates:  # one round trip for every slot
            self._slots.bulk_write(updates, ordered=False)
        return True

    def remove_clients(self, room_id: str, seen_before: float) -> list[str]:
        gone = {"room_id": room_id, "doc.status": "offline", "doc.last_seen": {"$lt": float(seen_before)}}
        removed = []
        for doc in self._clients.find(gone, {"_id": 1}):
            cid = doc["_id"]
            if self._slots.find_one({"client_id": cid, "job_id": {"$ne": None}}, {"_id": 1}):
                continue
            # the same conditions in the delete itself: a client that registered again meanwhile stays
            if self._clients.delete_one({**gone, "_id": cid}).deleted_count:
                self._slots.delete_many({"client_id": cid, "job_id": None})
                removed.append(cid)
        return removed

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

    def reserve_slots(self, job_id: str, assignments: list[tuple[str, int]], fields: Mapping[str, Any],
                      when=None) -> bool:
        values = job_fields(fields)
        statuses = status_values(when) or _WAITING
        if self._jobs.find_one({"_id": job_id, "status": {"$in": statuses}}, {"_id": 1}) is None:
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
                {"_id": job_id, "status": {"$in": statuses}, f"_fences.{token}": {"$exists": False}},
                {"$set": {**values, f"_moved.{token}": True}, "$inc": {"_rev": 1}})
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
    def create_job(self, job: JobRecord) -> JobRecord:
        doc = job_doc(job)
        for _ in range(1000):
            seq = self._last_seq(self._jobs, {}) + 1
            try:
                self._jobs.insert_one({**doc, "seq": seq, "_id": job.id, "_rev": 0})
                return JobRecord.model_validate({**doc, "seq": seq})
            except DuplicateKeyError:
                if self._jobs.find_one({"_id": job.id}, {"_id": 1}) is not None:
                    raise StoreError(f"job {job.id} already exists", job_id=job.id)
        raise StoreError(f"could not give job {job.id} a queue position", job_id=job.id)

    def get_job(self, job_id: str) -> JobRecord | None:
        return _record(self._jobs.find_one({"_id": job_id}))

    def count_jobs(self, room_id: str, statuses, before_seq: int | None = None) -> int:
        where = {"room_id": room_id, "status": {"$in": status_values(statuses)}}
        if before_seq is not None:
            where["seq"] = {"$lt": int(before_seq)}
        return self._jobs.count_documents(where)

    def job_counts(self) -> dict[tuple[str, str], int]:
        # Grouped by one field at a time: a compound ``_id`` of field paths is what MongoDB
        # groups by too, but nx-27017 (the tests' server) does not evaluate one.
        out = {}
        for room in self._jobs.distinct("room_id"):
            if isinstance(room, str):
                for g in self._jobs.aggregate([{"$match": {"room_id": room}},
                                               {"$group": {"_id": "$status", "n": {"$sum": 1}}}]):
                    if isinstance(g["_id"], str):
                        out[(room, g["_id"])] = int(g["n"])
        return out

    def job_rooms(self, statuses) -> list[str]:
        where = {"status": {"$in": status_values(statuses)}}
        rooms = (d.get("room_id") for d in self._jobs.find(where, {"room_id": 1}).sort("seq", ASCENDING))
        return [r for r in dict.fromkeys(rooms) if isinstance(r, str)]

    def job_ids(self, room_id: str, statuses) -> list[str]:
        where = {"room_id": room_id, "status": {"$in": status_values(statuses)}}
        return [d["_id"] for d in self._jobs.find(where, {"_id": 1}).sort("seq", ASCENDING)]

    def list_jobs(self, room_id=None, statuses=None, limit=None, parallelism=None, unsettled=False) -> list[JobRecord]:
        where = {} if room_id is None else {"room_id": room_id}
        if statuses is not None:
            where["status"] = {"$in": status_values(statuses)}
        if parallelism is not None:
            where["spec.parallelism"] = str(getattr(parallelism, "value", parallelism))
        if unsettled:
            where["$or"] = [{"failing_since": {"$ne": None}}, {"suspect_since": {"$ne": None}},
                            {"$and": [{"status": JobStatus.STARTING.value}, {"master": {"$eq": None}}]}]
        cursor = self._jobs.find(where).sort("seq", ASCENDING)
        if limit:
            cursor = cursor.limit(int(limit))
        return [_record(d) for d in cursor]

    @staticmethod
    def _where(job_id: str, when, unless_set: str | None = None) -> dict:
        where = {"_id": job_id}
        if when is not None:
            where["status"] = {"$in": status_values(when)}
        if unless_set is not None:
            where[unless_set] = None  # null or absent
        return where

    def _update(self, where: dict, sets: dict) -> JobRecord | None:
        update = {"$inc": {"_rev": 1}, **({"$set": sets} if sets else {})}
        return _record(self._jobs.find_one_and_update(where, update, return_document=_AFTER))

    def set_job(self, job_id, fields, when=None, unless_set=None) -> JobRecord | None:
        return self._update(self._where(job_id, when, field_name(unless_set)), job_fields(fields))

    def put_job_entries(self, job_id, field, entries, when=None) -> JobRecord | None:
        values = job_entries(field, entries)
        return self._update(self._where(job_id, when), {f"{field}.{rank}": v for rank, v in values.items()})

    def append_job(self, job_id, items, fields=None, when=None, keep_last=None) -> JobRecord | None:
        lists, values = job_items(items), job_fields(fields or {})
        where = self._where(job_id, when)
        for attempt in range(200):
            current = self._jobs.find_one(where)
            if current is None:
                return None
            sets = dict(values)
            for field, item in lists.items():
                kept = [*(current.get(field) or []), item]
                sets[field] = kept[-keep_last:] if keep_last else kept
            done = self._update({**where, "_rev": current.get("_rev", 0)}, sets)
            if done is not None:
                return done
            time.sleep(random.uniform(0, 0.001 * min(attempt + 1, 20)))  # another writer won; again
        raise StoreError(f"job {job_id} kept changing; nothing appended", job_id=job_id)

    # -- events ----------------------------------------------------------------------------
    def add_events(self, job_id: str, events: list[dict]) -> list[dict]:
        events = plain(events)
        if not events:
            return []
        room = self._counted_room(job_id)
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
                if room is not None and stored:
                    self._usage.update_one({"_id": room}, {"$inc": {"events": len(stored),
                                                                    "bytes": sum(map(event_bytes, stored))}})
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

    def last_event_seq(self, job_id: str) -> int:
        return self._last_seq(self._events, {"job_id": job_id})

    def room_event_usage(self, room_id: str) -> dict[str, int]:
        doc = self._usage.find_one({"_id": room_id}) or {}
        return {"events": int(doc.get("events") or 0), "bytes": int(doc.get("bytes") or 0)}

    def _counted_room(self, job_id: str) -> str | None:
        """The job's room, with its event counter made (its events stored before rooms had
        counters added up, once) if it had none."""
        job = self._jobs.find_one({"_id": job_id}, {"room_id": 1})
        if job is None:
            return None
        room = job["room_id"]
        if self._usage.find_one({"_id": room}, {"_id": 1}) is None:
            ids = [d["_id"] for d in self._jobs.find({"room_id": room}, {"_id": 1})]
            sizes = [event_bytes(_public(d, drop=("job_id",))) for d in self._events.find({"job_id": {"$in": ids}})]
            try:
                self._usage.insert_one({"_id": room, "events": len(sizes), "bytes": sum(sizes)})
            except DuplicateKeyError:
                pass  # another process counted them
        return room

    # -- artifacts' metadata ---------------------------------------------------------------
    def add_artifact(self, artifact: dict) -> dict:
        self._artifacts.insert_one({**plain(artifact), "_id": artifact["id"], "_order": self._next("artifacts")})
        return artifact

    def get_artifact(self, artifact_id: str) -> dict | None:
        return _public(self._artifacts.find_one({"_id": artifact_id}))

    def update_artifact(self, artifact_id: str, changes: dict) -> None:
        if changes:
            self._artifacts.update_one({"_id": artifact_id}, {"$set": plain(changes)})

    def list_artifacts(self, job_id: str, kind: str | None = None) -> list[dict]:
        where = {"job_id": job_id, **({"kind": kind} if kind else {})}
        return [_public(d) for d in self._artifacts.find(where).sort("_order", ASCENDING)]

    def find_artifact(self, room_id: str, kind: str, sha256: str) -> dict | None:
        found = self._artifacts.find({"room_id": room_id, "kind": kind, "sha256": sha256}).sort("_order", ASCENDING)
        return next((_public(d) for d in found.limit(1)), None)

    def list_room_artifacts(self, room_id: str, kind: str) -> list[dict]:
        return [_public(d) for d in self._artifacts.find({"room_id": room_id, "kind": kind}).sort("_order", ASCENDING)]

    def delete_artifact(self, artifact_id: str, if_unattached: bool = False) -> bool:
        where = {"_id": artifact_id, **({"job_id": None} if if_unattached else {})}
        return self._artifacts.delete_one(where).deleted_count == 1

    # -- quotas and garbage collection -----------------------------------------------------------
    def room_artifact_bytes(self, room_id: str) -> int:
        # added up here: wire-compatible servers (nx-27017) lack parts of the aggregation language
        return sum(int(d.get("size") or 0) for d in self._artifacts.find({"room_id": room_id}, {"size": 1}))

    def list_unattached_artifacts(self, created_before: float) -> list[dict]:
        where = {"job_id": None, "created_at": {"$lt": float(created_before)}}
        return [_public(d) for d in self._artifacts.find(where).sort("_order", ASCENDING)]

    def known_artifacts(self, artifact_ids) -> set[str]:
        ids, known = list(artifact_ids), set()
        for start in range(0, len(ids), 500):
            known |= {d["_id"] for d in self._artifacts.find({"_id": {"$in": ids[start:start + 500]}}, {"_id": 1})}
        return known

    # -- leases ----------------------------------------------------------------------------------
    def take_lease(self, name: str, holder: str, ttl: float, now: float | None = None) -> float | None:
        now = _now() if now is None else float(now)
        until = {"$set": {"holder": holder, "expires_at": now + ttl}}
        for where in ({"_id": name, "holder": holder}, {"_id": name, "expires_at": {"$lt": now}}):  # ours, expired
            if self._leases.find_one_and_update(where, until, {"_id": 1}) is not None:
                return now + ttl
        try:  # free: never taken, or given up
            self._leases.insert_one({"_id": name, "holder": holder, "expires_at": now + ttl})
        except DuplicateKeyError:
            return None  # another holder's, or taken just now
        return now + ttl

    def release_lease(self, name: str, holder: str) -> bool:
        return self._leases.delete_one({"_id": name, "holder": holder}).deleted_count == 1

    def lease_holder(self, name: str, now: float | None = None) -> str | None:
        doc = self._leases.find_one({"_id": name, "expires_at": {"$gte": _now() if now is None else float(now)}})
        return doc["holder"] if doc else None
