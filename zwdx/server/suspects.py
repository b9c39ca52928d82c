"""Naming a dishonest DILOCO worker: after every round averaged through the server, each
worker's pseudo-gradient is scored against the others' (``zwdx.robust``: its norm against the
round's median, its agreement with the rest); a worker flagged ``suspect_after`` rounds in a row
is a *suspect*: recorded in the job's ``suspects`` (rank -> client, rounds, reason), shown by
``zwdx jobs show``, the dashboard and the SDK's result, dropped from the job, and its GPU client
is not given the job again (``avoid``). The robust rule has already kept its rounds from steering
the weights; naming it stops it from costing the job a worker's share for good.

What a round found lives in its average's record (``scores``: rank -> norm, norm ratio,
agreement; ``strikes``: rank -> the rounds in a row it was flagged), so the count survives a
server restart and is shared among server processes.
"""
from __future__ import annotations

import logging
import time

from .. import robust
from ..protocol import EventKind
from ..protocol.job import Job as JobRecord, Suspect
from .http import ctx
from . import lifecycle, notify

log = logging.getLogger(__name__)


def judge(job: JobRecord, n: int, members: list[int], combiner: robust.Combiner, earlier: dict,
          record: dict) -> dict[int, str]:
    """Round ``n``'s scores and strikes into its average's ``record``; the workers flagged in
    it (rank -> why); those flagged ``suspect_after`` rounds in a row named and dropped."""
    scores = combiner.scores()
    why = {rank: reason for rank, reason in zip(members, robust.flags(scores)) if reason}
    before = {int(r): rounds for r, rounds in (earlier.get("strikes") or {}).items()}
    strikes = {rank: [*before.get(rank, []), n] for rank in why}
    ctx().store.update_artifact(record["id"], {
        "scores": {str(r): s.as_dict() for r, s in zip(members, scores)},
        "strikes": {str(r): rounds for r, rounds in strikes.items()}})
    after = job.spec.diloco.suspect_after
    named = {r: rounds for r, rounds in strikes.items() if after and len(rounds) >= after and str(r) not in job.suspects}
    if named:
        _name(job, {r: (rounds, why[r]) for r, rounds in named.items()})
    return why


def _name(job: JobRecord, named: dict[int, tuple[list[int], str]]) -> None:
    store, now = ctx().store, time.time()
    clients = {p.rank: p.client_id for p in job.placement or []}
    clients.update({int(r): j.client_id for r, j in job.joins.items()})
    tokens = {r: (store.get_client(clients[r]) or {}).get("token_id") if clients.get(r) else None for r in named}
    entries = {str(r): Suspect(client_id=clients.get(r), token_id=tokens[r], rounds=rounds, reason=reason, at=now)
               for r, (rounds, reason) in named.items()}
    if store.put_job_entries(job.id, "suspects", entries) is None:
        return
    avoid = sorted(set(job.avoid) | {e.client_id for e in entries.values() if e.client_id})
    store.set_job(job.id, {"avoid": avoid})
    texts = []
    for r, (rounds, reason) in sorted(named.items()):
        revoke = f"; `zwdx room tokens revoke {tokens[r]}` keeps its donor out of the room" if tokens[r] else ""
        texts.append(f"diloco: rank {r} (gpu client {clients.get(r)}) is a suspect: {reason}, in rounds "
                     f"{', '.join(map(str, rounds))} in a row; it is dropped and its client is not given this job "
                     f"again{revoke}")
        log.warning("job %s: %s", job.id, texts[-1])
    notify.events_added(job, store.add_events(job.id, [{
        "kind": EventKind.LOG.value, "rank": None, "key": f"diloco-suspect:{job.attempt}:{r}", "step": None,
        "data": {"text": text}, "ts": now} for r, text in zip(sorted(named), texts)]))
    fresh = store.get_job(job.id)
    if not lifecycle.drop(ctx(), fresh, sorted(named), f"named a suspect ({'; '.join(r for _, r in named.values())})"):
        log.warning("job %s: the suspect(s) %s could not be dropped (no other worker left)", job.id, sorted(named))
    notify.job_changed(store.get_job(job.id))

