"""How the stored layout changes from one schema version to the next, as pure functions over
documents; each backend's ``MIGRATIONS`` applies them (``sqlite_db.py``, ``mongo_db.py``).

Every function is safe to run on a document it already changed (two MongoDB servers may
start together), and leaves fields it does not know alone.

    1 -> 2   a job's ``failures`` (rank -> traceback) and ``failure_info`` (rank -> {at, kind})
             become one map, rank -> {traceback, at, kind}; a checkpoint that did not say
             its format gets the one its job's parallelism writes.
    2 -> 3   a room's one token becomes its first credential, a ``legacy`` one (it opens both
             roles until rotated into a submitter and a donor token); the room keeps no hash
             of its own; a job's job-wide ``job_key_hash`` goes (rank keys replace it).
"""
from __future__ import annotations

from ...protocol import CheckpointFormat, CredentialRole, Parallelism


def job_1_to_2(doc: dict) -> dict:
    """A job document of layout 1, as layout 2 keeps it."""
    info = doc.pop("failure_info", None) or {}
    failures = {}
    for rank, failure in (doc.get("failures") or {}).items():
        if isinstance(failure, str):
            failure = {"traceback": failure, **(info.get(rank) or {})}
        failures[str(rank)] = failure
    doc["failures"] = failures
    fsdp = (doc.get("spec") or {}).get("parallelism") == Parallelism.FSDP.value
    written = (CheckpointFormat.DCP if fsdp else CheckpointFormat.TORCH).value
    entries = [doc.get("latest_checkpoint"), *(doc.get("checkpoints") or []),
               *((r or {}).get("from_checkpoint") for r in doc.get("restart_history") or [])]
    for entry in entries:
        if isinstance(entry, dict) and not entry.get("format"):
            entry["format"] = written
    return doc


def legacy_credential(room: dict) -> dict | None:
    """The credential a room of layout 2 had in its ``token_hash``, as layout 3 keeps it (None
    for a room without one). Its id is made from the room's, so making it twice makes one."""
    token_hash = room.get("token_hash")
    if not token_hash:
        return None
    return {"id": f"{room['id']}-legacy", "room_id": room["id"], "role": CredentialRole.SUBMITTER.value,
            "name": "room token", "hash": token_hash, "created_at": room.get("created_at") or 0.0,
            "rotated_at": None, "revoked_at": None, "legacy": True}


def room_2_to_3(doc: dict) -> dict:
    """A room document of layout 2, as layout 3 keeps it: without its token's hash."""
    return {k: v for k, v in doc.items() if k != "token_hash"}


def job_2_to_3(doc: dict) -> dict:
    """A job document of layout 2, as layout 3 keeps it: without the job-wide key's hash."""
    doc.pop("job_key_hash", None)
    return doc
