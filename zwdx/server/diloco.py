"""DILOCO's outer steps, through the server: every worker of a DILOCO job (one rank, or with
``ranks_per_worker`` N the N ranks of one GPU client, whose first rank speaks for it) uploads its
pseudo-gradient for a round over the HTTPS connection it already has, the server averages them
once every worker the round waits for has uploaded, and every worker fetches the average. A
worker needs outbound access to the server and nothing else: no open port, no peer to reach.

    PUT /api/v1/jobs/<id>/diloco/rounds/<round>[?last=true]   a worker's pseudo-gradient (its rank key)
    GET /api/v1/jobs/<id>/diloco/rounds/<round>               the average (200), or where the round stands (202)
    PUT /api/v1/jobs/<id>/diloco/state/<round>                the global weights, for a worker joining
    GET /api/v1/jobs/<id>/diloco/state                        them, for the joiner (200), or 202 while it waits

A worker that joins in a dropped one's place (the scheduler's ``join_workers``, ``Job.join``)
is not waited for until the round it joins at (``joins``): it starts from the server's own
global weights after the round (``joiners.serve``), or, where the server holds none, the round's
answers name a worker (``state_from``) that sends its own after that round's average; the joiner
uploads from the next round on. Workers that reach each other may skip these routes
altogether (``gpu_client/rank/strategies/peers.py``).

The bytes are ``zwdx.codec``'s (a JSON layout, then int8 blocks with their scales, fp16 or
float32): never unpickled, checked whole on upload (layout, size, finite values, the job's
compression). The average is made streaming, one frame of every upload at a time, so a round
takes memory in the megabytes whatever the model's size, and is written in the job's
compression: every worker decodes the same bytes and so keeps the same global weights.

What a round is, lives in its artifacts (no store verb of its own): ``pseudo_gradient``
(round, rank, attempt, last) and ``outer_gradient`` (round, attempt, expected, members, left).
A round waits for the ranks of the job's current attempt that have not left (said ``last`` in an
earlier round) nor were dropped (``jobs.drop``: a lost GPU client or process), at most
``round_timeout`` after its first upload: then it is averaged over those in, and a worker that
missed two rounds in a row is dropped. Once a round is averaged its uploads are deleted, and the
averages older than the one before it; every artifact counts against the room's quota, and what a
finished job leaves, the sweeper takes.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid

from flask import Blueprint, current_app

from .. import codec
from ..errors import BadRequest, Conflict, NotFound
from .. import robust
from ..protocol import Aggregate, ArtifactKind, EventKind, Parallelism, RankStatus
from ..protocol.diloco import RoundState, RoundUpload
from ..protocol.rest import ArtifactView
from ..protocol.job import Job as JobRecord
from .auth import Sender
from .jobs import rejoined
from .http import OCTET, Auth, ctx, operation, save_artifact, stream
from . import global_weights, jobs, joiners, limits, notify, shadows, suspects

log = logging.getLogger(__name__)

bp = Blueprint("diloco", __name__)

#: Held while a round is averaged on this server process: each round is averaged once.
_averaging = threading.Lock()

#: Among several server processes, the one that averages a round holds the store's lease
#: ``diloco:<job>:<round>`` meanwhile (the others answer 202); one that died averaging lets
#: another take it over after this long.
AVERAGING_LEASE_S = 120.0


def _diloco(job: JobRecord) -> None:
    if job.spec.parallelism != Parallelism.DILOCO:
        raise Conflict(f"job {job.id} trains with {job.spec.parallelism.value}, not DILOCO: it has no rounds",
                       job_id=job.id)


def _uploads(job: JobRecord, n: int) -> dict[int, dict]:
    """rank -> its pseudo-gradient for round ``n`` of the current attempt (the latest it sent),
    once checked (``numel`` recorded): an upload still being read is not in the round yet."""
    out: dict[int, dict] = {}
    for artifact in sorted(ctx().store.list_artifacts(job.id, ArtifactKind.PSEUDO_GRADIENT.value),
                           key=lambda a: a["created_at"]):
        if artifact.get("attempt") == job.attempt and artifact.get("round") == n and artifact.get("numel") is not None \
                and shadows.of(job, artifact["rank"]) is None:  # a shadow's is compared, never averaged
            out[artifact["rank"]] = artifact
    return out


def _averages(job: JobRecord) -> dict[int, dict]:
    """round -> its average, of the current attempt."""
    return {a["round"]: a for a in ctx().store.list_artifacts(job.id, ArtifactKind.OUTER_GRADIENT.value)
            if a.get("attempt") == job.attempt}


def state(job: JobRecord, n: int) -> tuple[RoundState, dict | None, dict[int, dict]]:
    """Where round ``n`` stands, its average (None until made) and its uploads by rank. A round
    waits for the ranks of the attempt that neither left (said ``last`` in an earlier round) nor
    were dropped (their GPU client or process lost: ``jobs.drop``)."""
    averages, uploads = _averages(job), _uploads(job, n)
    average = averages.get(n)
    earlier = [r for r in averages if r < n]
    left = sorted(averages[max(earlier)].get("left") or []) if earlier else []
    dropped = {int(r) for r, s in job.ranks.items() if s.status == RankStatus.DROPPED and not rejoined(job, int(r))}
    later = {int(r) for r, j in job.joins.items() if j.round is None or n < j.round}  # joining, not in yet
    per = job.spec.diloco.ranks_per_worker  # a worker's first rank uploads for it; one rank of it lost drops it
    out = {r - r % per for r in dropped}
    expected = average["expected"] if average else [r for r in range(0, job.world_size or 0, per)
                                                    if r not in left and r not in out and r not in later]
    return RoundState(job_id=job.id, attempt=job.attempt, round=n, ready=average is not None, expected=expected,
                      uploaded=sorted(uploads), waiting_for=[] if average else [r for r in expected if r not in uploads],
                      members=average["members"] if average else [], left=average["left"] if average else left,
                      missed=average.get("missed", []) if average else [], dropped=sorted(dropped),
                      compression=job.spec.diloco.compression, size=average["size"] if average else None,
                      state_from=_state_from(job, expected)), average, uploads


def _state_from(job: JobRecord, expected: list[int]) -> int | None:
    """The worker that sends the global weights to the workers waiting to join: the first the
    round waits for (None when none waits)."""
    waiting = any(j.round is None for j in job.joins.values())
    return next((r for r in expected if str(r) not in job.joins), expected[0] if expected else None) if waiting else None


def round_timeout(job: JobRecord) -> float:
    """Seconds a round waits for its last workers after its first upload."""
    return float(job.spec.diloco.round_timeout or job.spec.training.collective_timeout or current_app.extensions["zwdx"].settings.collective_timeout)


def _delete(artifact: dict) -> None:
    """Record first, then bytes: a reader finds both or neither (as the sweeper deletes)."""
    if ctx().store.delete_artifact(artifact["id"]):
        ctx().artifacts.delete(artifact["id"])


def _check(job: JobRecord, artifact: dict, others: list[dict]) -> tuple[codec.Layout, float]:
    """The upload read whole: a pseudo-gradient of the job's compression, of the size of the
    round's other uploads; and its norm (the robust rule clips against the round's median)."""
    try:
        layout, norm = codec.inspect(codec.ChunkReader(_yielding(ctx().artifacts.open(artifact["id"]))))
    except codec.CodecError as exc:
        raise BadRequest(f"the body is not a pseudo-gradient: {exc}", field="body") from None
    want = job.spec.diloco.compression.value
    if layout.numel and layout.compression != want:
        raise BadRequest(f"the body is compressed {layout.compression}; job {job.id} sends {want}", field="body")
    for other in others:
        numel = other.get("numel") or 0
        if layout.numel and numel and numel != layout.numel:
            raise BadRequest(f"the body holds {layout.numel} values; rank {other['rank']}'s upload of this round "
                             f"holds {numel}", field="body")
    return layout, norm


@operation(bp, "PUT", "/jobs/<job_id>/diloco/rounds/<n>", "Upload a worker's pseudo-gradient for round n",
           auth=Auth.JOB, body=OCTET, query=RoundUpload, answer=RoundState, status=201,
           errors=(409, 413, 422, 429), tag="diloco")
def put_round(job: JobRecord, sender: Sender, n: int, query: RoundUpload):
    """The sender's rank of the current attempt only (its rank key); ``zwdx.codec``'s bytes in
    the job's compression (an upload of no values: the worker is there with nothing to add).
    Sent again before the round is averaged, the later upload wins; once it is, or for a round
    older than the last averaged, 409. ``last``: the worker's last round; later rounds do not
    wait for it. The upload that completes a round has it averaged before the answer."""
    _diloco(job)
    if shadows.of(job, sender.rank) is not None:
        return _shadow_upload(job, sender, n, query), 201
    per = job.spec.diloco.ranks_per_worker
    if sender.rank % per:
        raise Conflict(f"rank {sender.rank} uploads no rounds: rank {sender.rank - sender.rank % per} uploads for "
                       f"its worker (ranks_per_worker {per})", job_id=job.id)
    round_state, average, uploads = state(job, n)
    newest = max(_averages(job), default=-1)
    if average is not None or n < newest:
        missed = " without it (it came too late): fetch the average" if average and sender.rank in \
            average.get("missed", []) else ""
        raise Conflict(f"round {n} of job {job.id} is averaged already{missed} (the newest is {newest})",
                       job_id=job.id)
    if sender.rank not in round_state.expected:
        raise Conflict(f"rank {sender.rank} left job {job.id}'s rounds before round {n}", job_id=job.id)
    artifact = save_artifact({"id": job.room_id}, ArtifactKind.PSEUDO_GRADIENT.value, job.id, round=n,
                             rank=sender.rank, attempt=sender.attempt, last=query.last).model_dump()
    try:
        layout, norm = _check(job, artifact, [a for r, a in uploads.items() if r != sender.rank])
    except BaseException:
        _delete(artifact)
        raise
    ctx().store.update_artifact(artifact["id"], {"numel": layout.numel, "last": query.last, "norm": norm})
    if sender.rank in uploads:
        _delete(uploads[sender.rank])  # the later upload wins
    close(job, n)
    return state(job, n)[0], 201


def _shadow_upload(job: JobRecord, sender: Sender, n: int, query: RoundUpload) -> RoundState:
    """A shadow's upload (``shadows``): checked as a worker's, kept for the comparison with its
    worker's once round ``n`` is averaged; never in an average, and never late (its ``last``
    changes nothing)."""
    shadow = shadows.of(job, sender.rank)
    if shadow is None or shadow.gone is not None:
        raise Conflict(f"rank {sender.rank} of job {job.id} is a shadow that is gone", job_id=job.id)
    held = [a for a in shadows.pseudo_gradients(job) if a.get("round") == n and a.get("attempt") == job.attempt]
    artifact = save_artifact({"id": job.room_id}, ArtifactKind.PSEUDO_GRADIENT.value, job.id, round=n,
                             rank=sender.rank, attempt=sender.attempt, last=query.last).model_dump()
    try:
        layout, norm = _check(job, artifact, [a for a in held if a["rank"] != sender.rank and a.get("numel")])
    except BaseException:
        _delete(artifact)
        raise
    ctx().store.update_artifact(artifact["id"], {"numel": layout.numel, "last": query.last, "norm": norm})
    for earlier in held:
        if earlier["rank"] == sender.rank:
            _delete(earlier)  # the later upload wins
    # as a round's averaging compares too: each pair once (and among server processes, under the round's lease)
    with _averaging, _round_lease(job, n, wait=10.0) as held:
        if not held:  # another process holds the round: this pair goes unchecked
            log.warning("job %s: round %d's spot check of shadow rank %d skipped (its lease is held)",
                        job.id, n, sender.rank)
            return state(job, n)[0]
        job = ctx().store.get_job(job.id) or job
        shadows.compare(job, n, _averages(job).get(n), shadows.pseudo_gradients(job), _delete)
        shadows.uploaded(ctx().store.get_job(job.id) or job, sender.rank, n)  # after: its worker's kept till then
    return state(job, n)[0]


@contextlib.contextmanager
def _round_lease(job: JobRecord, n: int, wait: float = 0.0):
    """Round ``n``'s lease among several server processes (with one, always held): whether this
    process holds it, asked again for up to ``wait`` seconds; given back after the block."""
    lease, name = ctx().lease, f"diloco:{job.id}:{n}"
    if not lease.shared:
        yield True
        return
    deadline = time.time() + wait
    while ctx().store.take_lease(name, lease.holder, AVERAGING_LEASE_S) is None:
        if time.time() >= deadline:
            yield False
            return
        time.sleep(0.05)
    try:
        yield True
    finally:
        ctx().store.release_lease(name, lease.holder)


@operation(bp, "GET", "/jobs/<job_id>/diloco/rounds/<n>", "Download round n's average, once made",
           auth=Auth.JOB, answer=OCTET, answers={202: RoundState}, errors=(409,), tag="diloco")
def get_round(job: JobRecord, n: int):
    """Any rank's key of the current attempt. The average's bytes (``zwdx.codec``, the job's
    compression) once every worker the round waits for uploaded; until then 202 and where the
    round stands (ask again). A round whose average is deleted already (older than the one
    before the newest) is 404."""
    _diloco(job)
    average = close(job, n)
    if average is not None:
        return stream(average)
    round_state, _, _ = state(job, n)
    if n < max(_averages(job), default=-1):
        raise NotFound(f"round {n} of job {job.id} is gone (averages older than the last two are deleted)",
                       job_id=job.id)
    return round_state, 202


@operation(bp, "POST", "/diloco/start", "Upload a DILOCO job's start weights (the SDK, before the job)",
           body=OCTET, answer=ArtifactView, status=201, errors=(400, 413, 422, 429), tag="diloco")
def post_start(room: dict):
    """The submitter's model as submitted: a safetensors of its state_dict whose metadata
    ``parameters`` lists each parameter's state_dict keys in ``model.parameters()`` order
    (``zwdx.server.global_weights``); the submit names it as ``diloco.start_weights``. Read by its
    header, never unpickled."""
    artifact = save_artifact(room, ArtifactKind.DILOCO_START.value)
    try:
        numel = global_weights.check_start(b"".join(ctx().artifacts.open(artifact.id)))
    except ValueError as exc:
        _delete(artifact.model_dump())
        raise BadRequest(f"the body is not a model's start weights: {exc}", field="body") from None
    ctx().store.update_artifact(artifact.id, {"numel": numel})
    return artifact, 201


@operation(bp, "PUT", "/jobs/<job_id>/diloco/state/<n>", "Send the global weights a joining worker starts from",
           auth=Auth.JOB, body=OCTET, answer=RoundState, status=201, errors=(409, 413, 429), tag="diloco")
def put_state(job: JobRecord, sender: Sender, n: int):
    """The worker the rounds name (``state_from``), once a worker waits to join: the global
    weights and the outer optimizer's momentum after round ``n - 1``'s average, as safetensors
    (float32 vectors ``global`` and, with momentum, ``momentum``; metadata ``round``: ``n``),
    checked by its header, never unpickled. The waiting workers upload from round ``n`` on
    (``n + 1`` with ``overlap``: round ``n``'s average is still to come when they start)."""
    _diloco(job)
    averages = _averages(job)
    newest = max(averages, default=-1)
    if n != newest + 1:
        raise Conflict(f"job {job.id}'s global weights are those after round {newest}: send them as state "
                       f"{newest + 1}, not {n}", job_id=job.id)
    waiting = sorted(int(r) for r, j in job.joins.items() if j.round is None)
    if not waiting:
        raise Conflict(f"no worker waits to join job {job.id}", job_id=job.id)
    if global_weights.holds(job, newest):
        raise Conflict(f"job {job.id}'s joining workers start from the server's own global weights, not a "
                       f"worker's", job_id=job.id)
    artifact = save_artifact({"id": job.room_id}, ArtifactKind.DILOCO_STATE.value, job.id, round=n,
                             rank=sender.rank, attempt=sender.attempt).model_dump()
    try:
        joiners.check_state(_yielding(ctx().artifacts.open(artifact["id"])), n, averages[newest].get("numel") if averages else None)
    except BaseException:
        _delete(artifact)
        raise
    first = joiners.joined(job, n, artifact, waiting, sender.rank)
    return state(ctx().store.get_job(job.id), first)[0], 201


@operation(bp, "GET", "/jobs/<job_id>/diloco/state", "Download the global weights a joining worker starts from",
           auth=Auth.JOB, answer=OCTET, answers={202: RoundState}, errors=(409,), tag="diloco")
def get_state(job: JobRecord, sender: Sender):
    """A joining worker's key: the state sent for it (200), or 202 while it waits for it."""
    _diloco(job)
    join = job.joins.get(str(sender.rank))
    if join is None:
        raise Conflict(f"rank {sender.rank} of job {job.id} is not joining it", job_id=job.id)
    newest = max(_averages(job), default=-1)
    if join.round is None and global_weights.holds(job, newest):  # it came after round newest was averaged
        with _averaging:
            joiners.serve(job, newest)  # the server's own global weights, at once
        job = ctx().store.get_job(job.id) or job
        join = job.joins.get(str(sender.rank)) or join
    states = ctx().store.list_artifacts(job.id, ArtifactKind.DILOCO_STATE.value)
    if join.round is not None and states:
        return stream(max(states, key=lambda a: a["created_at"]))
    return state(job, newest + 1)[0], 202


def close(job: JobRecord, n: int) -> dict | None:
    """Round ``n``'s average: made now if every worker the round waits for has uploaded, or
    ``round_timeout`` passed since its first upload (the missing ones missed it). None while it
    waits."""
    round_state, average, uploads = state(job, n)
    if average is not None or not _due(job, round_state, uploads):
        return average
    with _averaging:
        round_state, average, uploads = state(job, n)  # made meanwhile?
        if average is not None or not _due(job, round_state, uploads):
            return average
        with _round_lease(job, n) as held:
            if not held:
                return None  # another server process averages it now
            round_state, average, uploads = state(job, n)  # made by another process meanwhile?
            if average is not None or not _due(job, round_state, uploads):
                return average
            return _average(job, n, round_state, uploads)


def _due(job: JobRecord, round_state: RoundState, uploads: dict[int, dict]) -> bool:
    if not uploads:
        return False
    first = min(a["created_at"] for a in uploads.values())
    return not round_state.waiting_for or time.time() > first + round_timeout(job)


def _average(job: JobRecord, n: int, round_state: RoundState, uploads: dict[int, dict]) -> dict:
    started = time.time()
    readers = {rank: codec.ChunkReader(_yielding(ctx().artifacts.open(a["id"]))) for rank, a in uploads.items()}
    settings = job.spec.diloco
    ranks = sorted(r for r, a in uploads.items() if a.get("numel"))  # codec.average's members, in its order
    combiner = robust.Combiner([float(uploads[r].get("norm") or 0.0) for r in ranks],
                               robust=settings.aggregate == Aggregate.ROBUST, trim=settings.trim)
    layout, members, chunks = codec.average(readers, combiner.frame)
    allowed, by_quota = limits.artifact_allowance(job.room_id, current_app.extensions["zwdx"].settings.max_artifact_bytes)
    if layout.size() > allowed:
        raise limits.artifact_quota_exceeded(job.room_id, layout.size())
    both = layout.size() + global_weights.held_size(job, layout.numel)  # and the server's global weights after it
    if limits.artifact_allowance(job.room_id, both)[1]:
        raise limits.artifact_quota_exceeded(job.room_id, both)
    artifact_id = uuid.uuid4().hex
    size, sha = ctx().artifacts.save(artifact_id, codec.ChunkReader(_yielding(chunks)), allowed)
    left = sorted(set(round_state.left) | {r for r, a in uploads.items() if a.get("last")})
    record = ctx().store.add_artifact({
        "id": artifact_id, "room_id": job.room_id, "kind": ArtifactKind.OUTER_GRADIENT.value, "size": size,
        "sha256": sha, "job_id": job.id, "created_at": time.time(), "round": n, "attempt": job.attempt,
        "numel": layout.numel,
        "expected": round_state.expected, "members": members, "left": left, "missed": round_state.waiting_for})
    global_weights.step(job, n, record)  # the server's own global weights after this round
    joiners.serve(job, n)
    earlier = _averages(job).get(n - 1) or {}
    flagged = suspects.judge(job, n, members, combiner, earlier, record)
    shadows.compare(ctx().store.get_job(job.id) or job, n, ctx().store.get_artifact(record["id"]),
                    shadows.pseudo_gradients(job), _delete)
    _collect(ctx().store.get_job(job.id) or job, n)
    twice = [r for r in round_state.waiting_for if r in (earlier.get("missed") or [])]
    if twice:  # two rounds in a row: it is gone, or too slow to be waited for
        jobs.drop(ctx(), ctx().store.get_job(job.id), twice, f"missed diloco rounds {n - 1} and {n}")
    text = (f"diloco round {n}: averaged the pseudo-gradients of rank(s) {', '.join(map(str, members)) or 'none'} "
            f"through the server ({layout.compression}, {sum(a['size'] for a in uploads.values())} bytes in, "
            f"{size} bytes out to each worker, {time.time() - started:.2f} s)"
            + (f"; rank(s) {', '.join(map(str, left))} left" if left else "")
            + (f"; rank(s) {', '.join(map(str, round_state.waiting_for))} missed it (not in within "
               f"{round_timeout(job):g} s)" if round_state.waiting_for else "")
            + "".join(f"; rank {r} flagged: {why}" for r, why in flagged.items()))
    log.info("job %s: %s", job.id, text)
    events = ctx().store.add_events(job.id, [{"kind": EventKind.LOG.value, "rank": None, "key": f"diloco:{job.attempt}:{n}",
                                              "step": None, "data": {"text": text}, "ts": time.time()}])
    notify.events_added(job, events)
    return record


def _yielding(chunks):
    """``chunks``, letting the server's other requests run between two (under gevent, reading a
    large upload through or averaging a round would otherwise hold the one thread that serves
    them all)."""
    for chunk in chunks:
        yield chunk
        time.sleep(0)


def _collect(job: JobRecord, n: int) -> None:
    """After round ``n`` is averaged: its uploads, the averages before round ``n - 1``, and every
    round artifact of an earlier attempt go; but what a shadow behind still needs (``shadows.keeps``)."""
    store = ctx().store
    for kind in (ArtifactKind.PSEUDO_GRADIENT, ArtifactKind.OUTER_GRADIENT):
        for artifact in store.list_artifacts(job.id, kind.value):
            old_attempt = artifact.get("attempt") != job.attempt
            done = artifact.get("round", n) <= n if kind is ArtifactKind.PSEUDO_GRADIENT else artifact.get("round", n) < n - 1
            if old_attempt or (done and not shadows.keeps(job, artifact, n)):  # a shadow behind: kept for it
                _delete(artifact)
