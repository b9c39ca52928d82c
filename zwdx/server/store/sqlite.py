"""The embedded store: one SQLite database file in the data dir, no setup.

Documents are kept as JSON next to the columns the server filters on (the tables, the
connection pool and the transactions are in ``sqlite_db.py``). A write that must be atomic
is one ``BEGIN IMMEDIATE`` transaction: a job's verbs read its document, check its status and
write it back inside one.
"""
from __future__ import annotations

import functools
import sqlite3
import time
from typing import Any, Callable, Iterable, Mapping

from ...errors import StoreError
from ...protocol.base import loads
from ...protocol.job import Job as JobRecord
from ...protocol.vocab import JobStatus
from .base import SLOT_STATS, Store, field_name, job_doc, job_entries, job_fields, job_items, status_values
from .sqlite_db import Database, dump, dump_exact


def _json_set(fields: dict) -> tuple[str, tuple]:
    """SQL that sets top-level fields of the ``doc`` column in place (SQLite's json_set, no
    decoding in Python), and its arguments."""
    return _json_set_sql(tuple(fields)), tuple(dump(value) for value in fields.values())


@functools.lru_cache(maxsize=64)
def _json_set_sql(keys: tuple[str, ...]) -> str:
    if not keys:
        return "doc"
    for key in keys:
        if not key.isidentifier():
            raise ValueError(f"cannot set field {key!r} in place")
    return "json_set(doc, " + ", ".join(f"'$.{key}', json(?)" for key in keys) + ")"


class SQLiteStore(Store):
    def __init__(self, path: str):
        self.path = path
        self.db = Database(path)

    # -- lifecycle -------------------------------------------------------------------------
    def ping(self) -> bool:
        try:
            self.db.query("SELECT 1")
            return True
        except StoreError:
            return False

    def schema_version(self) -> int:
        return self.db.schema_version()

    def close(self) -> None:
        self.db.close()

    def serving(self) -> None:
        """This process serves: checkpoint the log from a thread of its own (``Database``)."""
        self.db.checkpoint_in_background()

    # -- rooms and their credentials ---------------------------------------------------------
    def create_room(self, room: dict) -> dict:
        with self.db.tx() as db:
            db.execute("INSERT INTO rooms VALUES (?, ?)", (room["id"], dump(room)))
        return room

    def get_room(self, room_id: str) -> dict | None:
        rows = self.db.query("SELECT doc FROM rooms WHERE id=?", (room_id,))
        return loads(rows[0][0]) if rows else None

    def update_room(self, room_id: str, changes: dict) -> dict | None:
        with self.db.tx() as db:
            row = db.execute("SELECT doc FROM rooms WHERE id=?", (room_id,)).fetchone()
            if row is None:
                return None
            doc = {**loads(row[0]), **changes}
            db.execute("UPDATE rooms SET doc=? WHERE id=?", (dump(doc), room_id))
        return doc

    def add_credential(self, credential: dict) -> dict:
        with self.db.tx() as db:
            db.execute("INSERT INTO credentials VALUES (?, ?, ?, ?)",
                       (credential["id"], credential["room_id"], credential["hash"], dump(credential)))
        return credential

    def find_credential(self, secret_hash: str) -> dict | None:
        rows = self.db.query("SELECT doc FROM credentials WHERE hash=?", (secret_hash,))
        return loads(rows[0][0]) if rows else None

    def get_credential(self, credential_id: str) -> dict | None:
        rows = self.db.query("SELECT doc FROM credentials WHERE id=?", (credential_id,))
        return loads(rows[0][0]) if rows else None

    def list_credentials(self, room_id: str) -> list[dict]:
        return [loads(r[0]) for r in self.db.query("SELECT doc FROM credentials WHERE room_id=? ORDER BY rowid",
                                                        (room_id,))]

    def _write_credential(self, credential_id: str, change: Callable[[sqlite3.Connection, dict], bool]) -> dict | None:
        """Read a credential not revoked, and if ``change(db, doc)`` (which changes it in place)
        says yes, write it back: one transaction."""
        with self.db.tx() as db:
            row = db.execute("SELECT doc FROM credentials WHERE id=?", (credential_id,)).fetchone()
            if row is None:
                return None
            doc = loads(row[0])
            if doc.get("revoked_at") is not None or not change(db, doc):
                return None
            db.execute("UPDATE credentials SET hash=?, doc=? WHERE id=?", (doc["hash"], dump(doc), credential_id))
        return doc

    def revoke_credential(self, credential_id: str, at: float) -> dict | None:
        def change(db, doc):
            if doc.get("role") == "submitter":
                (others,) = db.execute(
                    "SELECT COUNT(*) FROM credentials WHERE room_id=? AND id<>? AND "
                    "json_extract(doc, '$.role')='submitter' AND json_extract(doc, '$.revoked_at') IS NULL",
                    (doc["room_id"], credential_id)).fetchone()
                if not others:
                    return False
            doc["revoked_at"] = float(at)
            return True
        return self._write_credential(credential_id, change)

    def rotate_credential(self, credential_id: str, secret_hash: str, at: float) -> dict | None:
        def change(db, doc):
            doc.update(hash=secret_hash, rotated_at=float(at), legacy=False)
            return True
        return self._write_credential(credential_id, change)

    # -- GPU clients and slots --------------------------------------------------------------
    def upsert_client(self, client: dict, slots: list[dict]) -> bool:
        with self.db.tx() as db:
            row = db.execute("SELECT room_id, json_extract(doc, '$.secret_hash') FROM clients WHERE id=?",
                             (client["id"],)).fetchone()
            if row is not None and (row[0] != client["room_id"] or
                                    row[1] not in (None, client.get("secret_hash"))):
                return False
            db.execute("INSERT INTO clients VALUES (?, ?, ?) ON CONFLICT(id) DO UPDATE SET "
                       "room_id=excluded.room_id, doc=excluded.doc",
                       (client["id"], client["room_id"], dump(client)))
            keep = [s["id"] for s in slots]
            db.execute(f"DELETE FROM slots WHERE client_id=? AND job_id IS NULL AND id NOT IN "
                       f"({','.join('?' * len(keep))})", (client["id"], *keep))
            for slot in slots:
                db.execute("INSERT INTO slots (id, client_id, room_id, idx, doc) VALUES (?, ?, ?, ?, ?) "
                           "ON CONFLICT(id) DO UPDATE SET doc=excluded.doc, room_id=excluded.room_id",
                           (slot["id"], client["id"], client["room_id"], slot["index"], dump(slot)))
        return True

    def get_client(self, client_id: str) -> dict | None:
        rows = self.db.query("SELECT doc FROM clients WHERE id=?", (client_id,))
        return loads(rows[0][0]) if rows else None

    def list_clients(self, room_id: str | None, lost_before: float | None = None) -> list[dict]:
        where, args = "WHERE 1=1", ()
        if room_id is not None:
            where, args = where + " AND room_id=?", args + (room_id,)
        if lost_before is not None:  # json_extract in SQLite: no client decoded that is not asked for
            where, args = where + " AND json_extract(doc, '$.lost_after') < ?", args + (float(lost_before),)
        clients = [loads(r[0]) for r in self.db.query(f"SELECT doc FROM clients {where} ORDER BY rowid", args)]
        return self._with_slots(clients, room_id, every=lost_before is None)

    def update_client(self, client_id: str, changes: dict) -> None:
        with self.db.tx() as db:
            row = db.execute("SELECT doc FROM clients WHERE id=?", (client_id,)).fetchone()
            if row is None:
                return
            doc = loads(row[0])
            doc.update(changes)
            db.execute("UPDATE clients SET doc=? WHERE id=?", (dump(doc), client_id))

    def touch_client(self, client_id: str, changes: dict, stats: list[dict],
                     expect_status: str | None = None) -> bool:
        return not self.touch_clients([(client_id, changes, stats)], expect_status)

    def touch_clients(self, touches: list[tuple[str, dict, list[dict]]], expect_status: str | None = None) -> list[str]:
        missed = []
        with self.db.tx() as db:
            for client_id, changes, stats in touches:
                set_client, args = _json_set(changes)
                where = "id=?" + (" AND json_extract(doc, '$.status')=?" if expect_status is not None else "")
                args += (client_id,) + ((expect_status,) if expect_status is not None else ())
                if db.execute(f"UPDATE clients SET doc={set_client} WHERE {where}", args).rowcount != 1:
                    missed.append(client_id)
                    continue
                for stat in stats:
                    fields = {k: stat[k] for k in SLOT_STATS if k in stat}
                    if fields:
                        set_slot, slot_args = _json_set(fields)
                        db.execute(f"UPDATE slots SET doc={set_slot} WHERE client_id=? AND idx=?",
                                   (*slot_args, client_id, stat["index"]))
        return missed

    def release_clients_of(self, server: str, changes: dict) -> list[str]:
        set_client, args = _json_set(changes)
        with self.db.tx() as db:
            return [r[0] for r in db.execute(
                f"UPDATE clients SET doc={set_client} WHERE json_extract(doc, '$.server')=? AND "
                f"json_extract(doc, '$.status')='online' RETURNING id", (*args, server)).fetchall()]

    def remove_clients(self, room_id: str, seen_before: float) -> list[str]:
        gone = ("room_id=? AND json_extract(doc, '$.status')='offline' AND "
                "json_extract(doc, '$.last_seen') < ? AND NOT EXISTS "
                "(SELECT 1 FROM slots WHERE slots.client_id=clients.id AND slots.job_id IS NOT NULL)")
        with self.db.tx() as db:  # one transaction: a register meanwhile comes before or after it
            ids = [r[0] for r in db.execute(f"SELECT id FROM clients WHERE {gone}", (room_id, float(seen_before)))]
            for cid in ids:
                db.execute("DELETE FROM slots WHERE client_id=?", (cid,))
                db.execute("DELETE FROM clients WHERE id=?", (cid,))
        return ids

    def list_slots(self, room_id: str | None, client_id: str | None = None) -> list[dict]:
        out = []
        where, args = "WHERE 1=1", ()
        if room_id is not None:
            where, args = where + " AND room_id=?", args + (room_id,)
        if client_id is not None:
            where, args = where + " AND client_id=?", args + (client_id,)
        for doc, job_id, rank in self.db.query(
                f"SELECT doc, job_id, rank FROM slots {where} ORDER BY client_id, idx", args):
            slot = loads(doc)
            slot["job_id"], slot["rank"] = job_id, rank
            out.append(slot)
        return out

    def reserve_slots(self, job_id: str, assignments: list[tuple[str, int]], fields: Mapping[str, Any],
                      when=None) -> bool:
        values = job_fields(fields)
        statuses = status_values(when) or ["queued", "resuming"]
        try:
            with self.db.tx() as db:
                row = db.execute(f"SELECT doc FROM jobs WHERE id=? AND status IN ({', '.join('?' * len(statuses))})",
                                 (job_id, *statuses)).fetchone()
                if row is None:
                    return False
                for slot_id, rank in assignments:
                    cur = db.execute("UPDATE slots SET job_id=?, rank=? WHERE id=? AND job_id IS NULL",
                                     (job_id, rank, slot_id))
                    if cur.rowcount != 1:
                        raise _Abort()
                doc = {**loads(row[0]), **values}
                db.execute("UPDATE jobs SET status=?, doc=? WHERE id=?", (doc["status"], dump_exact(doc), job_id))
        except _Abort:
            return False
        return True

    def release_slots(self, job_id: str, client_id: str | None = None) -> int:
        with self.db.tx() as db:
            if client_id is None:
                cur = db.execute("UPDATE slots SET job_id=NULL, rank=NULL WHERE job_id=?", (job_id,))
            else:
                cur = db.execute("UPDATE slots SET job_id=NULL, rank=NULL WHERE job_id=? AND client_id=?",
                                 (job_id, client_id))
            return cur.rowcount

    # -- jobs ------------------------------------------------------------------------------
    def create_job(self, job: JobRecord) -> JobRecord:
        doc = job_doc(job)
        with self.db.tx() as db:
            if db.execute("SELECT 1 FROM jobs WHERE id=?", (job.id,)).fetchone():
                raise StoreError(f"job {job.id} already exists", job_id=job.id)
            cur = db.execute("INSERT INTO jobs (id, room_id, status, doc) VALUES (?, ?, ?, ?)",
                             (job.id, job.room_id, doc["status"], "{}"))
            doc["seq"] = cur.lastrowid
            db.execute("UPDATE jobs SET doc=? WHERE id=?", (dump_exact(doc), job.id))
        return JobRecord.model_validate(doc)

    def get_job(self, job_id: str) -> JobRecord | None:
        rows = self.db.query("SELECT doc FROM jobs WHERE id=?", (job_id,))
        return JobRecord.model_validate_json(rows[0][0]) if rows else None

    def count_jobs(self, room_id: str, statuses: Iterable[str], before_seq: int | None = None) -> int:
        wanted = status_values(statuses)
        sql = f"SELECT COUNT(*) FROM jobs WHERE room_id=? AND status IN ({','.join('?' * len(wanted))})"
        args = [room_id, *wanted]
        if before_seq is not None:
            sql += " AND seq<?"
            args.append(int(before_seq))
        return int(self.db.query(sql, tuple(args))[0][0])

    def job_counts(self) -> dict[tuple[str, str], int]:
        rows = self.db.query("SELECT room_id, status, COUNT(*) FROM jobs GROUP BY room_id, status", ())
        return {(room, status): int(n) for room, status, n in rows}

    def job_rooms(self, statuses: Iterable[str]) -> list[str]:
        wanted = status_values(statuses)
        rows = self.db.query(f"SELECT room_id, MIN(seq) FROM jobs WHERE status IN ({','.join('?' * len(wanted))}) "
                             f"GROUP BY room_id ORDER BY 2", tuple(wanted))
        return [r[0] for r in rows]

    def job_ids(self, room_id: str, statuses: Iterable[str]) -> list[str]:
        wanted = status_values(statuses)
        rows = self.db.query(f"SELECT id FROM jobs WHERE room_id=? AND status IN ({','.join('?' * len(wanted))}) "
                             f"ORDER BY seq", (room_id, *wanted))
        return [r[0] for r in rows]

    def list_jobs(self, room_id=None, statuses=None, limit=None, parallelism=None, unsettled=False) -> list[JobRecord]:
        sql, args = "SELECT doc FROM jobs WHERE 1=1", []
        if room_id is not None:
            sql += " AND room_id=?"
            args.append(room_id)
        if statuses is not None:
            wanted = status_values(statuses)
            sql += f" AND status IN ({','.join('?' * len(wanted))})"
            args += wanted
        if parallelism is not None:
            sql += " AND json_extract(doc, '$.spec.parallelism')=?"
            args.append(str(getattr(parallelism, "value", parallelism)))
        if unsettled:
            sql += (" AND (json_extract(doc, '$.failing_since') IS NOT NULL OR json_extract(doc, '$.suspect_since')"
                    " IS NOT NULL OR (status=? AND json_extract(doc, '$.master') IS NULL))")
            args.append(JobStatus.STARTING.value)
        sql += " ORDER BY seq"
        if limit:
            sql += f" LIMIT {int(limit)}"
        return [JobRecord.model_validate_json(r[0]) for r in self.db.query(sql, tuple(args))]

    def _write_job(self, job_id: str, when, change: Callable[[dict], bool]) -> JobRecord | None:
        """Read the job's document, and if its status is one of ``when`` and ``change(doc)``
        (which changes it in place) says yes, write it back: one transaction."""
        when = status_values(when)
        with self.db.tx() as db:
            row = db.execute("SELECT status, doc FROM jobs WHERE id=?", (job_id,)).fetchone()
            if row is None or (when is not None and row[0] not in when):
                return None
            doc = loads(row[1])
            if not change(doc):
                return None
            db.execute("UPDATE jobs SET status=?, doc=? WHERE id=?", (doc["status"], dump_exact(doc), job_id))
        return JobRecord.model_validate(doc)

    def set_job(self, job_id, fields, when=None, unless_set=None) -> JobRecord | None:
        values = job_fields(fields)
        field_name(unless_set)

        def change(doc):
            if unless_set is not None and doc.get(unless_set) is not None:
                return False
            doc.update(values)
            return True
        return self._write_job(job_id, when, change)

    def put_job_entries(self, job_id, field, entries, when=None) -> JobRecord | None:
        values = job_entries(field, entries)

        def change(doc):
            doc[field] = {**(doc.get(field) or {}), **values}
            return True
        return self._write_job(job_id, when, change)

    def append_job(self, job_id, items, fields=None, when=None, keep_last=None) -> JobRecord | None:
        lists, values = job_items(items), job_fields(fields or {})

        def change(doc):
            doc.update(values)
            for field, item in lists.items():
                kept = [*(doc.get(field) or []), item]
                doc[field] = kept[-keep_last:] if keep_last else kept
            return True
        return self._write_job(job_id, when, change)

    # -- events ----------------------------------------------------------------------------
    def add_events(self, job_id: str, events: list[dict]) -> list[dict]:
        return self.add_event_batches([(job_id, events)])[0]

    def add_event_batches(self, batches: list[tuple[str, list[dict]]]) -> list[list[dict]]:
        with self.db.tx() as db:
            return [self._add_events(db, job_id, events) for job_id, events in batches]

    @staticmethod
    def _add_events(db, job_id: str, events: list[dict]) -> list[dict]:
        stored, size = [], 0
        room = db.execute("SELECT room_id FROM jobs WHERE id=?", (job_id,)).fetchone()
        if room is not None and db.execute("SELECT 1 FROM event_usage WHERE room_id=?", room).fetchone() is None:
            # the room's first count: its events stored before rooms had counters, once
            db.execute("INSERT INTO event_usage SELECT ?, COUNT(*), COALESCE(SUM(length(e.doc)), 0) FROM events e "
                       "JOIN jobs j ON e.job_id=j.id WHERE j.room_id=?", (room[0], room[0]))
        (last,) = db.execute("SELECT COALESCE(MAX(seq), 0) FROM events WHERE job_id=?", (job_id,)).fetchone()
        for ev in events:
            ev = {**ev, "seq": last + 1}
            if ev.get("rank") is None and db.execute(  # NULLs are distinct in a UNIQUE index
                    "SELECT 1 FROM events WHERE job_id=? AND rank IS NULL AND key=?",
                    (job_id, ev.get("key"))).fetchone():
                continue
            doc = dump_exact(ev)
            cur = db.execute("INSERT OR IGNORE INTO events VALUES (?, ?, ?, ?, ?, ?)",
                             (job_id, ev["seq"], ev["kind"], ev.get("rank"), ev.get("key"), doc))
            if cur.rowcount == 1:
                last += 1
                stored.append(ev)
                size += len(doc)  # event_bytes(ev), but for the mark of a 19-digit run (dump_exact)
        if room is not None and stored:
            db.execute("UPDATE event_usage SET events=events+?, bytes=bytes+? WHERE room_id=?",
                       (len(stored), size, room[0]))
        return stored

    def get_events(self, job_id, after=0, kind=None, limit=None) -> list[dict]:
        sql, args = "SELECT doc FROM events WHERE job_id=? AND seq>?", [job_id, after]
        if kind:
            sql += " AND kind=?"
            args.append(kind)
        sql += " ORDER BY seq"
        if limit:
            sql += f" LIMIT {int(limit)}"
        return [loads(r[0]) for r in self.db.query(sql, tuple(args))]

    def last_event_seq(self, job_id: str) -> int:
        return int(self.db.query("SELECT COALESCE(MAX(seq), 0) FROM events WHERE job_id=?", (job_id,))[0][0])

    def room_event_usage(self, room_id: str) -> dict[str, int]:
        rows = self.db.query("SELECT events, bytes FROM event_usage WHERE room_id=?", (room_id,))
        return {"events": int(rows[0][0]), "bytes": int(rows[0][1])} if rows else {"events": 0, "bytes": 0}

    # -- artifacts -------------------------------------------------------------------------
    def add_artifact(self, artifact: dict) -> dict:
        with self.db.tx() as db:
            db.execute("INSERT INTO artifacts VALUES (?, ?, ?, ?)",
                       (artifact["id"], artifact.get("job_id"), artifact["kind"], dump(artifact)))
        return artifact

    def get_artifact(self, artifact_id: str) -> dict | None:
        rows = self.db.query("SELECT doc FROM artifacts WHERE id=?", (artifact_id,))
        return loads(rows[0][0]) if rows else None

    def update_artifact(self, artifact_id: str, changes: dict) -> None:
        with self.db.tx() as db:
            row = db.execute("SELECT doc FROM artifacts WHERE id=?", (artifact_id,)).fetchone()
            if row is None:
                return
            doc = {**loads(row[0]), **changes}
            db.execute("UPDATE artifacts SET job_id=?, kind=?, doc=? WHERE id=?",
                       (doc.get("job_id"), doc["kind"], dump(doc), artifact_id))

    def list_artifacts(self, job_id: str, kind: str | None = None) -> list[dict]:
        sql, args = "SELECT doc FROM artifacts WHERE job_id=?", [job_id]
        if kind:
            sql += " AND kind=?"
            args.append(kind)
        return [loads(r[0]) for r in self.db.query(sql + " ORDER BY rowid", tuple(args))]

    def find_artifact(self, room_id: str, kind: str, sha256: str) -> dict | None:
        rows = self.db.query("SELECT doc FROM artifacts WHERE json_extract(doc, '$.room_id')=? AND kind=? AND "
                             "json_extract(doc, '$.sha256')=? ORDER BY rowid LIMIT 1", (room_id, kind, sha256))
        return loads(rows[0][0]) if rows else None

    def list_room_artifacts(self, room_id: str, kind: str) -> list[dict]:
        rows = self.db.query("SELECT doc FROM artifacts WHERE json_extract(doc, '$.room_id')=? AND kind=? "
                             "ORDER BY rowid", (room_id, kind))
        return [loads(r[0]) for r in rows]

    def delete_artifact(self, artifact_id: str, if_unattached: bool = False) -> bool:
        with self.db.tx() as db:
            sql = "DELETE FROM artifacts WHERE id=?" + (" AND job_id IS NULL" if if_unattached else "")
            return db.execute(sql, (artifact_id,)).rowcount == 1

    # -- quotas and garbage collection -----------------------------------------------------------
    def room_artifact_bytes(self, room_id: str) -> int:
        rows = self.db.query("SELECT COALESCE(SUM(json_extract(doc, '$.size')), 0) FROM artifacts "
                             "WHERE json_extract(doc, '$.room_id')=?", (room_id,))
        return int(rows[0][0])

    def list_unattached_artifacts(self, created_before: float) -> list[dict]:
        rows = self.db.query("SELECT doc FROM artifacts WHERE job_id IS NULL AND "
                             "json_extract(doc, '$.created_at') < ? ORDER BY rowid", (float(created_before),))
        return [loads(r[0]) for r in rows]

    def known_artifacts(self, artifact_ids: Iterable[str]) -> set[str]:
        ids, known = list(artifact_ids), set()
        for start in range(0, len(ids), 500):
            part = ids[start:start + 500]
            known |= {r[0] for r in self.db.query(
                f"SELECT id FROM artifacts WHERE id IN ({','.join('?' * len(part))})", tuple(part))}
        return known

    # -- leases ----------------------------------------------------------------------------------
    def take_lease(self, name: str, holder: str, ttl: float, now: float | None = None) -> float | None:
        now = time.time() if now is None else float(now)
        with self.db.tx() as db:  # the upsert's WHERE: free, expired, or ours
            rows = db.execute("INSERT INTO leases VALUES (?, ?, ?) ON CONFLICT (name) DO UPDATE SET "
                              "holder=excluded.holder, expires_at=excluded.expires_at WHERE leases.holder=? OR "
                              "leases.expires_at<? RETURNING expires_at", (name, holder, now + ttl, holder, now))
            taken = rows.fetchall()
        return float(taken[0][0]) if taken else None

    def release_lease(self, name: str, holder: str) -> bool:
        with self.db.tx() as db:
            return db.execute("DELETE FROM leases WHERE name=? AND holder=?", (name, holder)).rowcount == 1

    def lease_holder(self, name: str, now: float | None = None) -> str | None:
        rows = self.db.query("SELECT holder FROM leases WHERE name=? AND expires_at>=?",
                             (name, time.time() if now is None else float(now)))
        return rows[0][0] if rows else None


class _Abort(Exception):
    """Rolls back a reservation whose slot was taken meanwhile."""
