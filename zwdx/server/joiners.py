"""A worker joining a running DILOCO job (``Job.join``, the scheduler's ``join_workers``): what
it starts from. Where the server holds the job's global weights (``global_weights``: the
submitter's start weights stepped with every round's aggregate), the joiner starts from those,
written by the server after the round it joins at (``serve``): no worker's word. Where it does not
(no start weights, rounds averaged among the workers), the worker the rounds name
(``state_from``) sends its own (``PUT .../diloco/state/<n>``), checked by their header
(``check_state``) and never unpickled.
"""
from __future__ import annotations

import json
import logging
import time
import uuid

from flask import current_app

from .. import codec
from ..errors import BadRequest
from ..protocol import ArtifactKind, EventKind, JobStatus
from ..protocol.job import Job as JobRecord
from .http import ctx
from . import global_weights, limits, notify

log = logging.getLogger(__name__)


def delete(artifact: dict) -> None:
    """Record first, then bytes (as the sweeper deletes)."""
    if ctx().store.delete_artifact(artifact["id"]):
        ctx().artifacts.delete(artifact["id"])


def joined(job: JobRecord, n: int, artifact: dict, waiting: list[int], sender: int | None) -> int:
    """The waiting workers start from ``artifact`` (the global weights after round ``n - 1``,
    sent by worker ``sender``, or None: the server's own); the first round they upload to."""
    for old in ctx().store.list_artifacts(job.id, ArtifactKind.DILOCO_STATE.value):
        if old["id"] != artifact["id"]:
            delete(old)
    first = n + 1 if job.spec.diloco.overlap else n
    ctx().store.put_job_entries(job.id, "joins", {r: job.joins[str(r)].model_copy(
        update={"round": first, "state_from": sender}) for r in waiting}, when=[JobStatus.RUNNING])
    whose = "the server's own" if sender is None else f"rank {sender}'s"
    text = (f"diloco: rank(s) {', '.join(map(str, waiting))} joined: from {whose} global weights after "
            f"round {n - 1}, uploading from round {first} on")
    log.info("job %s: %s", job.id, text)
    notify.events_added(job, ctx().store.add_events(job.id, [{
        "kind": EventKind.LOG.value, "rank": None, "key": f"diloco-join:{job.attempt}:{n}", "step": None,
        "data": {"text": text}, "ts": time.time()}]))
    return first


def serve(job: JobRecord, n: int) -> None:
    """After round ``n``: workers waiting to join start from the server's own global weights
    after it, where the server holds them (not a worker's word); else a worker the rounds name
    sends them (``put_state``)."""
    job = ctx().store.get_job(job.id) or job
    waiting = sorted(int(r) for r, j in job.joins.items() if j.round is None)
    data = global_weights.joining_state(job, n) if waiting else None
    if data is None:
        return
    allowed, _ = limits.artifact_allowance(job.room_id, current_app.extensions["zwdx"].settings.max_artifact_bytes)
    if len(data) > allowed:
        log.warning("job %s: no room in the quota for the joiners' global weights; a worker sends them", job.id)
        return
    artifact_id = uuid.uuid4().hex
    size, sha = ctx().artifacts.save(artifact_id, codec.ChunkReader(iter([data])), len(data))
    artifact = ctx().store.add_artifact({
        "id": artifact_id, "room_id": job.room_id, "kind": ArtifactKind.DILOCO_STATE.value, "size": size,
        "sha256": sha, "job_id": job.id, "created_at": time.time(), "round": n + 1, "rank": None,
        "attempt": job.attempt})
    joined(job, n + 1, artifact, waiting, None)


def check_state(chunks, n: int, numel: int | None) -> None:
    """A safetensors file of float32 vectors ``global`` (and ``momentum``) of ``numel`` values,
    metadata ``round`` = ``n``: read by its header and its size."""
    reader = codec.ChunkReader(chunks)
    head = reader.read(8)
    length = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 < length <= 1 << 16:
        raise BadRequest("the body is not safetensors (its header's length)", field="body")
    try:
        header = json.loads(reader.read(length))
        meta = header.pop("__metadata__", {}) or {}
        assert set(header) in ({"global"}, {"global", "momentum"})
        sizes = [(v["dtype"], v["shape"], v["data_offsets"]) for v in header.values()]
    except (ValueError, AssertionError, KeyError, TypeError, AttributeError):
        raise BadRequest("the body is not the global weights: safetensors with float32 vectors 'global' and, "
                         "with momentum, 'momentum'", field="body") from None
    count = sizes[0][1][0] if sizes[0][1] else -1
    if any(d != "F32" or s != [count] for d, s, _ in sizes) or (numel is not None and count != numel):
        raise BadRequest(f"the body's vectors must be float32 of the model's {numel} values", field="body")
    if meta.get("round") != str(n):
        raise BadRequest(f"the body's metadata must say round {n}", field="body")
    rest = sum(len(c) for c in iter(lambda: reader.read(1 << 20), b""))
    if rest != 4 * count * len(sizes) or sorted(o for _, _, o in sizes) != sorted(
            [[i * 4 * count, (i + 1) * 4 * count] for i in range(len(sizes))]):
        raise BadRequest("the body's size is not its header's", field="body")
