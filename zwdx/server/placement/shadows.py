"""DILOCO, DDP or FSDP with ``verify``: the shadows' slots as the job is placed (``zwdx.server.shadows``
says what a DILOCO shadow is, ``gpu_client/rank/strategies/step_check.py`` a DDP one, which runs in
step with the job, ``fsdp_check.py`` beside it an FSDP one; ``zwdx.verify``, the rule). The scheduler plans the workers' slots and the
shadows' together (``asked``), then ``arrange`` says which slots are shadows, which worker each
runs again (drawn with the server's own randomness), and ``entries`` the job record's ``shadows``.
A DDP or FSDP job (``IN_STEP``) gets exactly ``verify.count(verify, W)`` shadows for its W workers:
every rank counts them so to build the group its steps are checked over."""
from __future__ import annotations

import random

from ... import verify
from ...protocol import Parallelism
from ...protocol.job import Job as JobRecord, Shadow
from ...protocol.spec import DDP, FSDP, Diloco

#: The modes whose shadows run in step with the workers (step checks); DILOCO's run apart.
IN_STEP = (Parallelism.DDP, Parallelism.FSDP)


def _verify(record: JobRecord) -> float:
    """The job's ``verify`` (DILOCO's spot checks, DDP's and FSDP's step checks); 0 for any other mode."""
    strategy = record.spec.strategy
    return strategy.verify if isinstance(strategy, (Diloco, DDP, FSDP)) else 0.0


def extra(record: JobRecord) -> int:
    """How many shadows the job asks for (0: no checks)."""
    return verify.count(_verify(record), record.spec.resources.world_size or 0)


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
    shadow runs again (shadow's rank -> worker): the most workers whose shadows fit (DDP, FSDP: the
    slots past their ``count`` let go), the shadowed ones drawn, each shadow on another donor
    token than its worker where it can be (else another GPU client)."""
    share, n = _verify(record), len(chosen)
    if not extra(record):
        return chosen, {}
    workers = max((w for w in range(1, n + 1) if w + verify.count(share, w) <= n), default=n)
    if record.spec.parallelism in IN_STEP:  # its ranks count the shadows: no more than that
        chosen = chosen[:workers + verify.count(share, workers)]
        n = len(chosen)
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

__all__ = ["IN_STEP", "extra", "asked", "arrange", "entries"]
