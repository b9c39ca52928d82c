"""How the stored layout changes from one schema version to the next, as pure functions over
documents; each backend's ``MIGRATIONS`` applies them (``sqlite_db.py``, ``mongo_db.py``).

Every function is safe to run on a document it already changed (two MongoDB servers may
start together), and leaves fields it does not know alone.

    1 -> 2   a job's ``failures`` (rank -> traceback) and ``failure_info`` (rank -> {at, kind})
             become one map, rank -> {traceback, at, kind}; a checkpoint that did not say
             its format gets the one its job's parallelism writes.
"""
from __future__ import annotations

from ...protocol import CheckpointFormat, Parallelism


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
