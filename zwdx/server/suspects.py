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
from collections import Counter

from .. import robust
from ..protocol import JobStatus, Parallelism, RankStatus
from ..protocol.job import Job as JobRecord
from .http import ctx
from . import jobs

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
        name(job, {r: (rounds, why[r]) for r, rounds in named.items()})
    return why


def compare_weights(job: JobRecord | None) -> None:
    """A DILOCO job just completed: every worker's ``global_fingerprint`` (its parameters after
    the last round) against the server's global weights (``global_weights``), or, where the
    server does not hold them (the rounds were averaged among the workers), against the
    fingerprint a strict majority of the ranks reported. A worker that disagrees is a suspect
    (its client not given the job again); with no strict majority nobody can be told apart, and
    the fingerprints' warning (``jobs.reports._compare_fingerprints``) is all there is."""
    if job is None or job.spec.parallelism != Parallelism.DILOCO or job.status != JobStatus.COMPLETED:
        return
    held = {int(r): s.global_fingerprint for r, s in job.ranks.items()
            if s.status == RankStatus.COMPLETED and s.global_fingerprint}
    if not held:
        return
    weights = ctx().store.get_artifact(job.weights_artifact) if job.weights_artifact else None
    reference, whose = (weights or {}).get("global_fingerprint"), "the server's global weights"
    if reference is None:
        reference, votes = Counter(held.values()).most_common(1)[0]
        if 2 * votes <= len(held):
            return
        agree = sorted(r for r, fp in held.items() if fp == reference)
        whose = f"those of rank(s) {', '.join(map(str, agree))} (the majority)"
    named = {r: ([], f"its final weights are not {whose} (fingerprint {fp[:12]}, not {reference[:12]})")
             for r, fp in held.items() if fp != reference and str(r) not in job.suspects}
    if named:
        name(job, named, drop=False)


def name(job: JobRecord, named: dict[int, tuple[list[int], str]], drop: bool = True) -> None:
    """These ranks are suspects (rank -> rounds, why), their clients avoided; ``drop``: DILOCO
    workers dropped (``jobs.name_suspects``, which a DDP job's step checks use too)."""
    jobs.name_suspects(ctx(), job, named, dropped=drop)
