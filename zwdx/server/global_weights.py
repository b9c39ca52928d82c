"""DILOCO's global weights, held by the server: the weights a DILOCO job returns are the server's
own, never one worker's word.

    start    the submitter's model as submitted (``POST /api/v1/diloco/start``: a safetensors of
             its state_dict, metadata ``parameters``: the state_dict keys of each parameter in
             ``model.parameters()`` order, tied ones together), uploaded by the SDK before the job
             is created and named by ``DilocoSettings.start_weights``
    round n  once the round's aggregate is made (``diloco._average``), one step of the outer
             optimizer on numpy: SGD with Nesterov momentum, the arithmetic of the workers'
             ``torch.optim.SGD`` (dampening 0: ``buf = m * buf + g``; Nesterov ``g + m * buf``;
             ``p - lr * g``), in float32
    weights  when a worker reports the job's weights, the server writes its own in their place:
             every parameter from its global weights (cast to the start's dtype), the buffers
             (BatchNorm statistics, which DiLoCo does not average) from the worker's upload where
             they match the start's names, shapes and dtypes, else the start's

The held state is an artifact of the job (``diloco_global``: safetensors, float32 vectors
``global`` and, after the first step, ``momentum``; its record says the round it follows). The
chain is kept only while every round went through the server in order: a round it did not see
(averaged among the workers, ``peers.py``; an attempt resumed from an older checkpoint) breaks it,
and the job's weights are then a worker's, checked by the workers' fingerprints. Nothing here is
unpickled; a model is held in memory once per step (12 bytes a parameter: global, momentum, the
aggregate).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import time
import uuid

import numpy as np

from .. import codec
from ..errors import BadRequest
from ..protocol import ArtifactKind, Parallelism
from ..protocol.job import Job as JobRecord
from .http import ctx
from . import jobs

log = logging.getLogger(__name__)

#: safetensors dtypes the server reads and writes (BF16 through float32's upper half).
DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": None}
#: A worker's uploaded parameters further than this (relative, the worst tensor) from the
#: server's global weights are a warning on the job (the two differ only by rounding otherwise:
#: the workers step with torch, the server with numpy).
UPLOAD_TOLERANCE = 1e-4


# -- safetensors, read and written by their header (never unpickled) ------------------------------
def read(data: bytes) -> tuple[dict, dict, memoryview]:
    """A safetensors file's tensors (name -> dtype, shape, offsets), metadata and data."""
    length = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if not 0 < length <= min(len(data) - 8, 1 << 26):
        raise ValueError("not safetensors (its header's length)")
    try:  # the bytes are a donor's or a submitter's: anything wrong in them is a ValueError
        header = json.loads(bytes(data[8:8 + length]))
    except (ValueError, RecursionError):
        raise ValueError("not safetensors (its header is not JSON, or nests too deep)") from None
    if not isinstance(header, dict):
        raise ValueError("not safetensors (its header)")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise ValueError("not safetensors (its metadata)")
    body = memoryview(data)[8 + length:]
    for name, t in header.items():
        if not _entry(t):
            raise ValueError(f"tensor {name!r}: not a safetensors entry (dtype, shape, data_offsets)")
        start, stop = t["data_offsets"]
        width = 2 if t["dtype"] in ("F16", "BF16") else 8 if t["dtype"] == "F64" else 4 if t["dtype"] == "F32" else None
        if not 0 <= start <= stop <= len(body) or (width and stop - start != width * math.prod(t["shape"])):
            raise ValueError(f"tensor {name!r}: its offsets are not its size")
    return header, meta, body


def _entry(t) -> bool:
    """A header entry as safetensors writes one: a dtype name, a shape of sizes, two offsets."""
    return (isinstance(t, dict) and isinstance(t.get("dtype"), str) and isinstance(t.get("shape"), list)
            and all(type(d) is int and d >= 0 for d in t["shape"]) and isinstance(t.get("data_offsets"), list)
            and len(t["data_offsets"]) == 2 and all(type(o) is int for o in t["data_offsets"]))


def write(tensors: dict[str, tuple[str, list[int], bytes]], meta: dict | None = None) -> bytes:
    """A safetensors file of ``tensors`` (name -> dtype, shape, bytes), in name order."""
    header, offset = {}, 0
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    if meta:
        header["__metadata__"] = meta
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(tensors[n][2] for n in sorted(tensors))


def to_f32(dtype: str, raw) -> np.ndarray:
    if dtype == "BF16":
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(raw, DTYPES[dtype]).astype(np.float32)


def from_f32(dtype: str, values: np.ndarray) -> bytes:
    """float32 values as ``dtype``'s bytes; BF16 rounded to nearest even, as torch casts."""
    values = np.ascontiguousarray(values, np.float32)
    if dtype == "BF16":
        bits = values.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return np.where(np.isnan(values), 0x7FC0, rounded).astype(np.uint16).tobytes()
    return values.astype(DTYPES[dtype]).tobytes()


def _parameters(header: dict, meta: dict) -> list[list[str]]:
    """The start's ``parameters`` metadata, checked against its tensors."""
    try:
        groups = json.loads(meta["parameters"])
        assert isinstance(groups, list) and all(isinstance(g, list) and g for g in groups)
        for group in groups:
            first = header[group[0]]
            assert first["dtype"] in DTYPES and all(
                header[k]["dtype"] == first["dtype"] and header[k]["shape"] == first["shape"] for k in group)
        assert len({k for g in groups for k in g}) == sum(len(g) for g in groups)
    except (KeyError, ValueError, AssertionError, TypeError):
        raise ValueError("metadata 'parameters' must list, per parameter in model.parameters() order, its "
                         "state_dict keys (float tensors of one shape)") from None
    return groups


def check_start(data: bytes) -> int:
    """The number of parameter values in a start weights file; ValueError saying what is wrong."""
    header, meta, _ = read(data)
    return sum(int(np.prod(header[g[0]]["shape"])) for g in _parameters(header, meta))


# -- the start, attached to its job -----------------------------------------------------------------
def start_of(room: dict, submit) -> dict | None:
    """A submit's ``diloco.start_weights``: an unattached start upload of the room (400 else)."""
    start_id = start_named(getattr(submit, "spec", submit))  # the flat SubmitJob's, or its tree's
    if start_id is None:
        return None
    artifact = ctx().store.get_artifact(start_id)
    if artifact is None or artifact["room_id"] != room["id"] or artifact["kind"] != ArtifactKind.DILOCO_START.value \
            or artifact.get("job_id"):
        raise BadRequest(f"field 'diloco.start_weights': no start weights {start_id} uploaded in this room for a new "
                         f"job", field="diloco.start_weights")
    return artifact


def release_start(room: dict, tree: dict | None) -> None:
    """A refused submit's start weights (named by its spec tree's strategy, no job's yet) go at
    once, as its bundle does: they count against the room's quota no longer."""
    strategy = tree.get("strategy") if isinstance(tree, dict) else None
    start_id = strategy.get("start_weights") if isinstance(strategy, dict) else None
    artifact = ctx().store.get_artifact(start_id) if isinstance(start_id, str) else None
    if artifact and artifact["room_id"] == room["id"] and artifact["kind"] == ArtifactKind.DILOCO_START.value \
            and not artifact.get("job_id") and ctx().store.delete_artifact(start_id):
        ctx().artifacts.delete(start_id)


def start_named(spec) -> str | None:
    """The start weights a spec names: DILOCO's, or AUTO's (uploaded in case it chooses DILOCO)."""
    diloco = getattr(spec, "diloco", None)
    if diloco is not None:
        return diloco.start_weights
    strategy = getattr(spec, "strategy", None)
    return getattr(strategy, "start_weights", None) if getattr(strategy, "type", None) == "auto" else None


def attach_start(job: JobRecord) -> None:
    """The new job owns its start weights (swept with it)."""
    start_id = start_named(job.spec)
    if start_id:
        ctx().store.update_artifact(start_id, {"job_id": job.id})


# -- the outer step ----------------------------------------------------------------------------------
def _bytes(artifact_id: str) -> bytes:
    return b"".join(ctx().artifacts.open(artifact_id))


def _held(job: JobRecord) -> dict | None:
    held = ctx().store.list_artifacts(job.id, ArtifactKind.DILOCO_GLOBAL.value)
    return max(held, key=lambda a: (a.get("round", -1), a["created_at"])) if held else None


def _start_vector(job: JobRecord) -> np.ndarray:
    header, meta, body = read(_bytes(job.spec.diloco.start_weights))
    parts = [to_f32(header[g[0]]["dtype"], body[slice(*header[g[0]]["data_offsets"])])
             for g in _parameters(header, meta)]
    return np.concatenate(parts) if parts else np.empty(0, np.float32)


#: Values the outer step's float64 arithmetic takes at a time (its temporaries: 24 bytes each).
SLICE = 1 << 20


def _fused(a: np.ndarray, b: np.ndarray, alpha: float) -> np.ndarray:
    """``a + alpha * b`` rounded once to float32, as torch's ``add(b, alpha=)`` computes it on the
    CPU (a fused multiply-add; the float64 product of two float32 is exact), a slice at a time."""
    out, scale = np.empty(a.size, np.float32), np.float64(np.float32(alpha))
    for i in range(0, a.size, SLICE):
        out[i:i + SLICE] = a[i:i + SLICE].astype(np.float64) + scale * b[i:i + SLICE].astype(np.float64)
    return out


def outer_step(params: np.ndarray, momentum: np.ndarray | None, grad: np.ndarray, lr: float, m: float,
               nesterov: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """One step of SGD (dampening 0, no weight decay) on float32, as ``torch.optim.SGD`` takes it
    on the CPU, bit for bit: ``buf.mul_(m).add_(g)``, Nesterov ``g.add(buf, alpha=m)``, then
    ``p.add_(g, alpha=-lr)``."""
    if m:
        momentum = grad.copy() if momentum is None else momentum * np.float32(m) + grad
        grad = _fused(grad, momentum, m) if nesterov else momentum
    return _fused(params, grad, -lr), momentum


def held_size(job: JobRecord, numel: int) -> int:
    """The bytes the server's global weights take after a round of ``numel`` values (float32
    weights and momentum, and a header): what ``step`` writes beside the round's average, counted
    against the room's quota before the round is averaged (0 where the server holds none)."""
    settings = job.spec.diloco
    if job.spec.parallelism != Parallelism.DILOCO or not settings or not settings.start_weights:
        return 0
    return 4 * numel * (2 if settings.outer_momentum else 1) + 256


def step(job: JobRecord, n: int, average: dict) -> None:
    """After round ``n``'s aggregate ``average`` is made: the server's global weights after it.
    Round 0 starts from the submitter's weights; a later round from those after round ``n - 1``
    (none held: the chain is broken, and stays so for this job's attempt)."""
    settings = job.spec.diloco
    if job.spec.parallelism != Parallelism.DILOCO or not settings or not settings.start_weights:
        return
    held = _held(job)
    if n == 0:
        params, momentum = _start_vector(job), None
    elif held is not None and held.get("round") == n - 1:
        header, _, body = read(_bytes(held["id"]))
        params = np.frombuffer(body[slice(*header["global"]["data_offsets"])], np.float32)
        momentum = np.frombuffer(body[slice(*header["momentum"]["data_offsets"])], np.float32) \
            if "momentum" in header else None
    else:
        return
    grad = codec.decode(_bytes(average["id"])) if average.get("numel") else np.empty(0, np.float32)
    if grad.size and grad.size != params.size:
        log.warning("job %s: diloco round %d's aggregate holds %d values, the start weights %d: the server "
                    "holds no global weights", job.id, n, grad.size, params.size)
        return
    if grad.size:
        params, momentum = outer_step(params, momentum, grad, settings.outer_lr, settings.outer_momentum,
                                      settings.nesterov)
    tensors = {"global": ("F32", [params.size], params.astype(np.float32).tobytes())}
    if momentum is not None:
        tensors["momentum"] = ("F32", [momentum.size], momentum.astype(np.float32).tobytes())
    data = write(tensors, {"round": str(n)})
    artifact_id = uuid.uuid4().hex
    size, sha = ctx().artifacts.save(artifact_id, codec.ChunkReader(iter([data])), len(data))
    ctx().store.add_artifact({"id": artifact_id, "room_id": job.room_id, "kind": ArtifactKind.DILOCO_GLOBAL.value,
                              "size": size, "sha256": sha, "job_id": job.id, "created_at": time.time(),
                              "round": n, "attempt": job.attempt, "numel": int(params.size)})
    for old in ctx().store.list_artifacts(job.id, ArtifactKind.DILOCO_GLOBAL.value):
        if old["id"] != artifact_id and ctx().store.delete_artifact(old["id"]):
            ctx().artifacts.delete(old["id"])


def holds(job: JobRecord, n: int) -> bool:
    """Whether the server holds the job's global weights after round ``n`` of its attempt."""
    held = _held(job)
    return held is not None and held.get("round") == n and held.get("attempt") == job.attempt


def joining_state(job: JobRecord, n: int) -> bytes | None:
    """What a worker joining after round ``n`` starts from: the server's own global weights and
    momentum after round ``n`` (safetensors, metadata ``round``: ``n + 1``, as a worker sends
    them); None where the server holds none after round ``n``."""
    if not holds(job, n):
        return None
    header, _, body = read(_bytes(_held(job)["id"]))
    return write({k: ("F32", t["shape"], bytes(body[slice(*t["data_offsets"])])) for k, t in header.items()},
                 {"round": str(n + 1)})


# -- the job's weights -----------------------------------------------------------------------------
def _newest_round(job: JobRecord) -> int | None:
    rounds = [a.get("round", -1) for a in ctx().store.list_artifacts(job.id, ArtifactKind.OUTER_GRADIENT.value)
              if a.get("attempt") == job.attempt]
    return max(rounds) if rounds else None


def weights(job: JobRecord, rank: int, uploaded: str | None) -> str | None:
    """The weights a DILOCO job returns, as worker ``rank`` reports its end with ``uploaded``:
    the server's own (a new weights artifact) once it holds the global weights after the
    attempt's newest round; else ``uploaded`` as it is (said in the job's log)."""
    settings = job.spec.diloco
    if job.spec.parallelism != Parallelism.DILOCO or not settings or not settings.start_weights:
        return uploaded
    if uploaded is None and rank != 0:
        return None  # a worker that uploads nothing for the job
    held, newest = _held(job), _newest_round(job)
    if held is None or newest is None or held.get("round") != newest:
        _say(job, f"diloco: the weights that came back are rank {rank}'s upload: the server does not hold the "
                  f"global weights (rounds averaged among the workers, or one it did not see)", warn=False)
        return uploaded
    start_header, start_meta, start_body = read(_bytes(settings.start_weights))
    g_header, _, g_body = read(_bytes(held["id"]))
    flat = np.frombuffer(g_body[slice(*g_header["global"]["data_offsets"])], np.float32)
    try:
        up_header, _, up_body = read(_bytes(uploaded)) if uploaded else ({}, {}, memoryview(b""))
    except ValueError:
        up_header, up_body = {}, memoryview(b"")
    tensors, offset, worst = {}, 0, 0.0
    for group in _parameters(start_header, start_meta):
        t = start_header[group[0]]
        count = int(np.prod(t["shape"]))
        values = flat[offset:offset + count]
        offset += count
        raw = from_f32(t["dtype"], values)
        for key in group:
            tensors[key] = (t["dtype"], t["shape"], raw)
            up = up_header.get(key)
            if up is not None and up["dtype"] == t["dtype"] and up["shape"] == t["shape"]:
                theirs = to_f32(t["dtype"], up_body[slice(*up["data_offsets"])])
                scale = float(np.abs(values).max()) if count else 0.0
                worst = max(worst, float(np.abs(theirs - to_f32(t["dtype"], raw)).max()) / max(scale, 1e-12)
                            if count else 0.0)
            else:
                worst = float("inf")
    taken = set(tensors)
    for key, t in start_header.items():
        if key in taken:
            continue
        up = up_header.get(key)
        source = (up, up_body) if up is not None and up["dtype"] == t["dtype"] and up["shape"] == t["shape"] \
            else (t, start_body)
        tensors[key] = (t["dtype"], t["shape"], bytes(source[1][slice(*source[0]["data_offsets"])]))
    data = write(tensors)
    artifact_id = uuid.uuid4().hex
    size, sha = ctx().artifacts.save(artifact_id, codec.ChunkReader(iter([data])), len(data))
    ctx().store.add_artifact({"id": artifact_id, "room_id": job.room_id, "kind": ArtifactKind.WEIGHTS.value,
                              "size": size, "sha256": sha, "job_id": job.id, "created_at": time.time(),
                              "global_fingerprint": fingerprint({k: tensors[k][2] for k in taken})})
    if uploaded and ctx().store.delete_artifact(uploaded):
        ctx().artifacts.delete(uploaded)
    if worst > UPLOAD_TOLERANCE:
        what = "uploaded no weights" if uploaded is None else \
            f"uploaded weights that are not the global weights (worst relative difference {worst:.2g})"
        _say(job, f"rank {rank} {what}; the weights that came back are the server's own global weights after "
                  f"round {newest}", warn=True)
    else:
        _say(job, f"diloco: the weights that came back are the server's global weights after round {newest} "
                  f"(rank {rank}'s upload agreed within {worst:.2g})", warn=False)
    return artifact_id


def fingerprint(tensors: dict[str, bytes]) -> str:
    """sha256 over the tensors' bytes in name order, each after its name: what a GPU client
    reports (``gpu_client``'s ``parallel.fingerprint``) over the same tensors."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name])
    return digest.hexdigest()


def _say(job: JobRecord, text: str, warn: bool) -> None:
    jobs.job_line(ctx(), job, text, "diloco-weights", warn)
