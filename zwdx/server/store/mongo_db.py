"""The MongoDB store's database: connecting, indexes, the schema version and migrations, and
the translation of pymongo's errors into ``StoreError``.

The database is the URI's path, or "zwdx". Collections: ``meta`` (the schema version),
``rooms``, ``credentials``, ``clients``, ``slots``, ``jobs``, ``events``, ``artifacts`` (metadata),
``counters``, and the GridFS bucket ``artifacts`` (``gridfs.py``).
"""
from __future__ import annotations

import functools
import json
import logging
from typing import Callable

from pymongo import ASCENDING, MongoClient, uri_parser
from pymongo.database import Database
from pymongo.errors import DuplicateKeyError, PyMongoError

from ...errors import SchemaVersionError, StoreError
from . import base
from .migrations import job_1_to_2, legacy_credential

log = logging.getLogger(__name__)

INDEXES = {
    "credentials": [([("hash", ASCENDING)], True), ([("room_id", ASCENDING), ("_order", ASCENDING)], False)],
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
    "artifacts": [([("job_id", ASCENDING), ("kind", ASCENDING), ("_order", ASCENDING)], False),
                  ([("room_id", ASCENDING)], False)],
}


def _jobs_1_to_2(db: Database) -> None:
    for doc in db.jobs.find({}):
        after = job_1_to_2(json.loads(json.dumps(doc)))
        db.jobs.update_one({"_id": doc["_id"]}, {"$set": {"failures": after["failures"],
                                                          "latest_checkpoint": after.get("latest_checkpoint"),
                                                          "checkpoints": after.get("checkpoints") or [],
                                                          "restart_history": after.get("restart_history") or []},
                                                 "$unset": {"failure_info": ""}, "$inc": {"_rev": 1}})


def _credentials_2_to_3(db: Database) -> None:
    """Each room's token becomes its legacy credential (its id made from the room's, so a
    second run inserts nothing); rooms lose their token's hash and its unique index, jobs their
    job key's hash."""
    for room in db.rooms.find({"token_hash": {"$exists": True}}):
        credential = legacy_credential(room)
        if credential is not None and db.credentials.find_one({"_id": credential["id"]}, {"_id": 1}) is None:
            try:
                db.credentials.insert_one({**credential, "_id": credential["id"], "_order": 0})
            except DuplicateKeyError:
                pass  # another server made it first
    if "token_hash_1" in db.rooms.index_information():
        db.rooms.drop_index("token_hash_1")
    db.rooms.update_many({"token_hash": {"$exists": True}}, {"$unset": {"token_hash": ""}})
    db.jobs.update_many({"job_key_hash": {"$exists": True}}, {"$unset": {"job_key_hash": ""}, "$inc": {"_rev": 1}})


#: Migrations from version N to N+1: each takes the database and must be safe to run twice
#: (two servers may start at once).
MIGRATIONS: dict[int, Callable[[Database], None]] = {1: _jobs_1_to_2, 2: _credentials_2_to_3}


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


def prepare(db: Database, where: str) -> None:
    """Check (and migrate) the schema version, and create the indexes."""
    try:
        _check_schema(db, where)
        for name, indexes in INDEXES.items():
            for keys, unique in indexes:
                db[name].create_index(keys, unique=unique)
    except PyMongoError as exc:
        raise StoreError(f"cannot prepare the MongoDB store at {where}: {exc}") from exc


def schema_version(db: Database) -> int:
    return int(db.meta.find_one({"_id": "schema"})["version"])


def _check_schema(db: Database, where: str) -> None:
    doc = db.meta.find_one({"_id": "schema"})
    if doc is None:
        try:
            db.meta.insert_one({"_id": "schema", "version": base.SCHEMA_VERSION})
        except DuplicateKeyError:
            pass  # another server created it first
        doc = db.meta.find_one({"_id": "schema"})
    found = int(doc["version"])
    if found > base.SCHEMA_VERSION:
        raise SchemaVersionError(
            f"the store at {where} has schema version {found}, newer than this zwdx "
            f"understands ({base.SCHEMA_VERSION}); upgrade zwdx", found=found, supported=base.SCHEMA_VERSION)
    while found < base.SCHEMA_VERSION:
        step = MIGRATIONS.get(found)
        if step is not None:
            step(db)
        db.meta.update_one({"_id": "schema", "version": found}, {"$set": {"version": found + 1}})
        found += 1
        log.info("store: migrated %s to schema version %d", where, found)


def plain(value):
    """The value as the embedded store keeps it: JSON types only (int keys become strings)."""
    return json.loads(json.dumps(value))


def guarded(cls):
    """Turn pymongo's errors, in every public method of the class, into StoreError."""
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
