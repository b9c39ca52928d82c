"""DILOCO with ``verify``: the shadows' slots as the job is placed (``zwdx.server.shadows`` says
what a shadow is; ``zwdx.verify``, the rule). The scheduler plans the workers' slots and the
shadows' together (``asked``), then ``arrange`` says which slots are shadows, which worker each
runs again (drawn with the server's own randomness), and ``entries`` the job record's ``shadows``."""
from __future__ import annotations

import random

from ... import verify
from ...protocol import Parallelism
from ...protocol.job import Job as JobRecord, Shadow


def extra(record: JobRecord) -> int:
    """How many shadows the job asks for (0: no spot checks)."""
    settings = record.spec.diloco
    if record.spec.parallelism != Parallelism.DILOCO or settings is None or not settings.verify:
        return 0
    return verify.count(settings.verify, record.spec.resources.world_size or 0)


def asked(record: JobRecord, job: dict) -> dict:
    """The job document the placement plans from (``{"spec", "status", "world_size", ...}``): the
    workers' slots and the shadows' (a resuming job's too: it is planned from its world size)."""
    more = extra(record)
    if not more:
        return job
    spec = job["spec"]
    res, rec = spec["resources"], spec["recovery"]
    spec = {**spec, "resources": {**res, "world_size": (res.get("world_size") or 0) + more},
            "recovery": {**rec, "min_world_size": rec["min_world_size"] + more if rec.get("min_world_size") else None}}
    return {**job, "spec": spec, "world_size": job["world_size"] + more if job.get("world_size") else None}


def arrange(record: JobRecord, chosen: list[dict], clients: dict, rng: random.Random | None = None) \
        -> tuple[list[dict], dict[int, int]]:
    """The slots in rank order (the workers' first, then the shadows') and the worker each
    shadow runs again (shadow's rank -> worker): the most workers whose shadows fit, the
    shadowed ones drawn, each shadow on another donor token than its worker where it can be
    (else another GPU client)."""
    settings, n = record.spec.diloco, len(chosen)
    if not extra(record) or settings is None:
        return chosen, {}
    workers = max((w for w in range(1, n + 1) if w + verify.count(settings.verify, w) <= n), default=n)
    ours, theirs = chosen[:workers], chosen[workers:]
    drawn = verify.draw(workers, n - workers, rng)

    def token(slot: dict) -> str | None:
        return (clients.get(slot["client_id"]) or {}).get("token_id")
    of: dict[int, int] = {}
    for i, slot in enumerate(theirs):
        def apart(w: int) -> tuple[bool, bool]:
            other = ours[w]
            return token(other) == token(slot) and token(slot) is not None, other["client_id"] == slot["client_id"]
        w = min(drawn, key=apart)  # another token first, then another GPU client
        drawn.remove(w)
        of[workers + i] = w
    return chosen, of


def entries(placement: list, of: dict[int, int]) -> dict[str, Shadow]:
    """The job record's ``shadows`` for a placement."""
    clients = {p.rank: p.client_id for p in placement}
    return {str(s): Shadow(of=w, client_id=clients[s]) for s, w in of.items()}

__all__ = ["extra", "asked", "arrange", "entries"]
