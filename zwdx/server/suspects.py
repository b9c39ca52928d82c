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

Any other job's weights come back from rank 0's upload: ``compare_upload`` holds them against
the fingerprints the ranks reported, so the weights are not rank 0's word alone.
"""
from __future__ import annotations

import logging
from collections import Counter

from .. import robust
from ..protocol import JobStatus, Parallelism, RankStatus
from ..protocol.job import Job as JobRecord
from .http import ctx
from . import global_weights, jobs

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
    named = {r: rounds for r, rounds in strikes.items() if after and len(rounds) >= after and r not in job.suspected()}
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
    if job is None or job.status != JobStatus.COMPLETED:
        return
    if job.spec.parallelism != Parallelism.DILOCO:
        return compare_upload(job)
    held = {int(r): s.global_fingerprint for r, s in job.ranks.items()
            if s.status == RankStatus.COMPLETED and s.global_fingerprint}
    if not held:
        return
    weights = ctx().store.get_artifact(job.weights_artifact) if job.weights_artifact else None
    reference, whose = (weights or {}).get("global_fingerprint"), "the server's global weights"
    if reference is None:
        if (found := _majority(held)) is None:
            return
        reference, agree = found
        whose = f"those of rank(s) {', '.join(map(str, agree))} (the majority)"
    named = {r: ([], f"its final weights are not {whose} (fingerprint {fp[:12]}, not {reference[:12]})")
             for r, fp in held.items() if fp != reference and r not in job.suspected()}
    if named:
        name(job, named, drop=False)


def compare_upload(job: JobRecord) -> None:
    """A job other than DILOCO just completed: the weights that came back (rank 0's upload, the
    one ``PUT /jobs/<id>/weights`` takes) against the fingerprints its ranks reported of their
    final weights (``RankState.fingerprint``; ranks that hold no whole model report none), and
    its step checks' shadows (``Shadow.fingerprint``: they hold the whole model, and report
    before the ranks do).

    - rank 0's upload is not the weights rank 0 reported: it is a suspect (its word about its own
      weights is not borne out by the bytes it sent);
    - a strict majority of the reporting ranks holds other weights than the upload: the job
      carries a warning saying the weights that came back are not the majority's (the ranks'
      own disagreement is ``jobs.reports._compare_fingerprints``' warning), and every rank not of
      that majority is a suspect.
    Nothing is dropped (the job is over); the suspects' clients are not given the job again."""
    held = {int(r): s.fingerprint for r, s in job.ranks.items()
            if s.status == RankStatus.COMPLETED and s.fingerprint}
    held.update({int(r): s.fingerprint for r, s in job.shadows.items() if s.fingerprint})  # step checks' shadows
    if not held or not job.weights_artifact:
        return
    uploaded = _upload_fingerprint(job.weights_artifact)
    shown = "unreadable (not safetensors)" if uploaded is None else uploaded[:12]
    named: dict[int, tuple[list[int], str]] = {}
    if 0 in held and held[0] != uploaded:
        named[0] = ([], f"the weights it uploaded (fingerprint {shown}) are not the weights it reported "
                        f"({held[0][:12]})")
    if (found := _majority(held)) is not None:
        reference, agree = found
        majority = f"rank(s) {', '.join(map(str, agree))}" + (" (the majority)" if len(held) > 1 else "")
        for r, fp in held.items():
            if fp != reference:
                named.setdefault(r, ([], f"its final weights are not those of {majority} (fingerprint {fp[:12]}, "
                                         f"not {reference[:12]})"))
        if uploaded != reference:
            jobs.job_line(ctx(), job, f"the weights that came back (rank 0's upload, fingerprint {shown}) are not "
                                      f"the weights {majority} reported ({reference[:12]}): do not trust them",
                          "weights-check")
    named = {r: why for r, why in named.items() if r not in job.suspected()}
    if named:
        jobs.name_suspects(ctx(), job, named, dropped=False, what="weights check")


def _upload_fingerprint(artifact_id: str) -> str | None:
    """``global_weights.fingerprint`` of an uploaded safetensors file's tensors (what a rank's
    ``fingerprint`` hashes: each tensor's bytes as stored, in name order); None if it is not one."""
    try:
        header, _, body = global_weights.read(b"".join(ctx().artifacts.open(artifact_id)))
    except ValueError:  # ``read`` says so of anything that is not safetensors
        return None
    return global_weights.fingerprint({k: bytes(body[slice(*t["data_offsets"])]) for k, t in header.items()})


def _majority(held: dict[int, str]) -> tuple[str, list[int]] | None:
    """The fingerprint a strict majority of ``held`` (rank -> fingerprint) reported, and those
    ranks; None where there is no strict majority."""
    reference, votes = Counter(held.values()).most_common(1)[0]
    if 2 * votes <= len(held):
        return None
    return reference, sorted(r for r, fp in held.items() if fp == reference)


def name(job: JobRecord, named: dict[int, tuple[list[int], str]], drop: bool = True) -> None:
    """These ranks are suspects (rank -> rounds, why), their clients avoided; ``drop``: DILOCO
    workers dropped (``jobs.name_suspects``, which a DDP job's step checks use too)."""
    jobs.name_suspects(ctx(), job, named, dropped=drop)
