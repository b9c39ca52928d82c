"""DILOCO's spot checks through the server (``verify``; the rule is ``zwdx.verify``'s): shadow
workers. A job with ``verify`` takes ceil(verify * workers) more slots as it is placed; their
ranks are numbered from ``world_size`` on (``world_size`` stays the workers'), and each runs
again the rank of a worker the server draws with its own randomness (``Job.shadows``: the
shadow's rank -> the worker, never told to the worker), on a GPU client of another donor token
than that worker's where the room has one.

A shadow uploads its pseudo-gradient for every round as a worker does (``PUT .../rounds/<n>``,
its own key) and fetches the round's average like any worker, so it stays in step; its upload
is never in the average (``diloco._uploads`` leaves it out), nor is a round waited for it. Once a
round is averaged and the uploads of a shadowed worker and all its shadows still running are in,
they are compared (``compare``): identical sha256, or a relative L2 distance within
``verify_tolerance``, agree; a disagreement names the ones the rule names as suspects
(``suspects``: a worker is dropped, a shadow is not given the job again), and the round's result
is kept in the shadow's entry (``agreed``, ``disagreed``) and the job's log.

A shadow that fails, whose process dies or whose GPU client is lost, is noted (``gone``) and the
job goes on: its reports are ignored, none of its exits makes the job suspect, and its lost GPU
client drops no worker and interrupts nothing.

A DDP or FSDP job's shadows (``verify`` there: step checks) are placed alike but run in step with
the job (``jobs.in_step``): one lost, exited or failed is any rank's, and what their checks found is
settled with the attempt (``jobs.step_checked``).
"""
from __future__ import annotations

import logging
import time

from .. import codec, verify
from ..protocol import ACTIVE, ArtifactKind, EventKind
from ..protocol.job import Job as JobRecord, Shadow
from .http import ctx
from . import jobs, notify

log = logging.getLogger(__name__)


# -- what a shadow says -----------------------------------------------------------------------------
def of(job: JobRecord, rank: int) -> Shadow | None:
    """Rank ``rank``'s shadow entry, if it is a shadow."""
    return job.shadows.get(str(rank))


def gone(job: JobRecord, ranks: list[int], why: str) -> list[int]:
    """Those of ``ranks`` that are shadows are noted gone (``why``) and the job goes on; the
    others (the workers), returned (``jobs.shadows_gone``)."""
    return jobs.shadows_gone(ctx(), job, ranks, why)


def finished(job: JobRecord, rank: int, fingerprint: str | None) -> bool:
    """A DDP/FSDP shadow (in step with the job) reported its end: its final weights' fingerprint
    is kept for the weights check. False where there is nothing to keep, or the job is over."""
    shadow = of(job, rank)
    if shadow is None or not fingerprint or not jobs.in_step(job):
        return False
    return ctx().store.put_job_entries(job.id, "shadows", {str(rank): shadow.model_copy(
        update={"fingerprint": fingerprint})}, when=[s.value for s in ACTIVE]) is not None


def _log(job: JobRecord, texts: list[str], key: str) -> None:
    now = time.time()
    for text in texts:
        log.info("job %s: %s", job.id, text)
    notify.events_added(job, ctx().store.add_events(job.id, [{
        "kind": EventKind.LOG.value, "rank": None, "key": f"{key}:{job.attempt}:{i}", "step": None,
        "data": {"text": text}, "ts": now} for i, text in enumerate(texts)]))


# -- comparing a round -----------------------------------------------------------------------------
#: Rounds a shadow may fall behind its worker (it started later, or runs slower): what it still
#: needs is kept that long (its worker's uploads, the averages); further behind, it fails.
MAX_LAG = 50


def keeps(job: JobRecord, artifact: dict, n: int) -> bool:
    """Whether round ``n``'s averaging leaves this artifact for a shadow still behind: a
    shadowed worker's upload of a round one of its running shadows has not uploaded yet, a
    shadow's own of round ``n - 1`` or later or of a round another shadow of its worker has not
    uploaded yet, an average a running shadow has still to fetch."""
    rank, r = artifact.get("rank"), artifact.get("round", n)
    if artifact.get("attempt") != job.attempt or r < n - MAX_LAG:
        return False
    if artifact.get("kind") == ArtifactKind.OUTER_GRADIENT.value:
        return any(s.gone is None and r >= s.round for s in job.shadows.values())
    if (mine := of(job, rank)) is not None:  # until its worker's other shadows are in too
        return r >= n - 1 or any(s.of == mine.of and s.gone is None and r > s.round for s in job.shadows.values())
    return any(s.of == rank and s.gone is None and r > s.round for s in job.shadows.values())


def uploaded(job: JobRecord, rank: int, n: int) -> None:
    """Shadow ``rank`` uploaded round ``n``: what it needs is kept from there on."""
    shadow = of(job, rank)
    if shadow is not None and n > shadow.round:
        ctx().store.put_job_entries(job.id, "shadows", {str(rank): shadow.model_copy(update={"round": n})})


def compare(job: JobRecord, n: int, average: dict | None, uploads: list[dict], delete) -> None:
    """Round ``n`` of every shadowed worker whose upload and those of all its running shadows are
    in (``uploads``: the round's pseudo-gradients, shadows' included), once the round is
    averaged: compared, recorded, the disagreeing named; their uploads then ``delete``d."""
    if average is None or not job.shadows:
        return
    by_rank = {a["rank"]: a for a in sorted(uploads, key=lambda a: a["created_at"])
               if a.get("round") == n and a.get("attempt") == job.attempt and a.get("numel") is not None}
    flagged = {int(r) for r, rounds in (average.get("strikes") or {}).items() if n in rounds}
    tolerance = job.spec.diloco.verify_tolerance if job.spec.diloco else verify.BITWISE
    for worker in sorted({s.of for s in job.shadows.values()} - job.suspected()):  # named: done
        mine = {int(r): s for r, s in job.shadows.items() if s.of == worker}
        running = [r for r, s in mine.items() if s.gone is None and n not in s.agreed and str(n) not in s.disagreed]
        if worker not in by_rank or not running or any(r not in by_rank for r in running):
            continue
        opinions = {r: verify.Opinion(r, by_rank[r]["sha256"], _values(by_rank[r])) for r in [worker, *running]}
        distances, named = verify.decide(opinions[worker], [opinions[r] for r in running], worker in flagged,
                                         tolerance)
        _record(job, n, worker, {r: mine[r] for r in running}, distances, named)
        for r in [worker, *running]:
            delete(by_rank[r])


def _values(artifact: dict):
    return codec.decode(b"".join(ctx().artifacts.open(artifact["id"])))


def _record(job: JobRecord, n: int, worker: int, shadows: dict[int, Shadow], distances: dict[int, float],
            named: dict[int, str]) -> None:
    from . import suspects
    changed = {}
    for r, s in shadows.items():
        agreed = distances[r] <= (job.spec.diloco.verify_tolerance if job.spec.diloco else 0.0)
        changed[str(r)] = s.model_copy(update={"agreed": [*s.agreed, n]} if agreed else
                                       {"disagreed": {**s.disagreed, str(n): f"relative distance {distances[r]:.3g}"}})
    ctx().store.put_job_entries(job.id, "shadows", changed)
    how = ", ".join(f"shadow rank {r}: {'identical bytes' if d == 0 else f'relative distance {d:.3g}'}"
                    for r, d in sorted(distances.items()))
    verdict = "agree" if not named else f"disagree: {', '.join(f'rank {r}' for r in sorted(named))} named"
    _log(job, [f"diloco spot check, round {n}: rank {worker} and its shadow(s) {verdict} ({how})"], f"verify:{n}:{worker}")
    if not named:
        return
    reasons = {r: ([n], f"spot check, round {n}: {why}") for r, why in named.items()}
    fresh = ctx().store.get_job(job.id) or job
    workers = {r: v for r, v in reasons.items() if r not in shadows}
    if workers:
        suspects.name(fresh, workers)
    if len(workers) < len(reasons):
        suspects.name(ctx().store.get_job(job.id) or fresh, {r: v for r, v in reasons.items() if r in shadows},
                      drop=False)
        gone(ctx().store.get_job(job.id) or fresh, [r for r in reasons if r in shadows], "named a suspect")


def pseudo_gradients(job: JobRecord) -> list[dict]:
    return ctx().store.list_artifacts(job.id, ArtifactKind.PSEUDO_GRADIENT.value)


__all__ = ["MAX_LAG", "uploaded", "of", "gone", "keeps", "compare", "pseudo_gradients"]
