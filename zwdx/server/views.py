"""What the API shows of stored documents: secrets and internals removed, the order of failures added."""
from __future__ import annotations

from ..protocol import FailureKind

_JOB_HIDDEN = {"job_key_hash"}
_CLIENT_HIDDEN = {"sid", "modules"}  # modules: hundreds of names, for the scheduler only


def failure_order(job: dict) -> list[str]:
    """The failing ranks, first failure first: ranks whose own code raised before ranks that
    only lost their peers (a collective broke, a process died without a word), then by when
    the server heard of each."""
    info = job.get("failure_info") or {}

    def key(rank: str):
        entry = info.get(rank) or {}
        lost_peers = entry.get("kind") != FailureKind.RAISED.value
        return lost_peers, entry.get("at", float("inf")), int(rank) if str(rank).isdigit() else 0
    return sorted((str(r) for r in job.get("failures") or {}), key=key)


def job_view(job: dict) -> dict:
    view = {k: v for k, v in job.items() if k not in _JOB_HIDDEN}
    view["failure_order"] = failure_order(job)
    return view


def client_view(client: dict) -> dict:
    return {k: v for k, v in client.items() if k not in _CLIENT_HIDDEN}


def room_view(room: dict) -> dict:
    return {"id": room["id"], "name": room["name"], "created_at": room["created_at"]}
