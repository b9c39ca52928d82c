"""DILOCO's weights artifacts count against the room's artifact quota (issue 33): the start
weights the SDK uploads, and the global weights the server writes after every round, beside the
round's average. Over the quota, the upload that would make them is refused with the quota's
message, and nothing of the round is written. In-process."""
from __future__ import annotations

import hashlib

import numpy as np
import torch

from conftest import Api
from test_robust import honest
from test_trust_global import flat, model, placed, put
from zwdx import codec, defaults, start_weights
from zwdx.protocol import ArtifactKind

torch.set_num_threads(1)

OCTET = {"Content-Type": "application/octet-stream"}


def limit(app, **values: int) -> None:
    """Change the server's limits while it runs (``reconfigure`` where its settings are typed)."""
    ctx = app.extensions["zwdx"]
    if hasattr(ctx, "reconfigure"):
        ctx.reconfigure(**values)
    else:
        app.config.update(values)


def stored(app, room_id: str) -> int:
    store = app.extensions["zwdx"].store
    return store.room_artifact_bytes(room_id) + store.room_event_usage(room_id)["bytes"]


def upload(rank: Api, job: dict, n: int, values: np.ndarray):
    data = codec.encode(np.asarray(values, np.float32), "none")
    return rank.put(f"/jobs/{job['id']}/diloco/rounds/{n}?last=false", data=data,
                    headers={defaults.SHA256_HEADER: hashlib.sha256(data).hexdigest()})


def refused(answer) -> None:
    assert answer.status_code == 429 and answer.json["error"]["code"] == "quota_exceeded", answer.json
    assert "its quota is" in answer.json["error"]["message"]


def half_a_round(app):
    """A DILOCO job of two workers whose rank 0 uploaded round 0: its room, ranks and record, the
    number of values, and rank 1's pseudo-gradient, still to upload."""
    net = model()
    room, ranks, job = placed(app, start_weights.encode(net), world_size=2)
    numel = flat(net).numel()
    vectors = [0.01 * v for v in honest(2, numel, seed=0)]
    put(ranks[0], job, 0, vectors[0])
    return room, ranks, job, numel, vectors[1]


def test_start_weights_over_the_rooms_quota_are_refused_with_its_message(app):
    room = Api(app.test_client()).create_room("trust-quota-start")
    data = start_weights.encode(model())
    limit(app, ROOM_MAX_ARTIFACT_BYTES=stored(app, room.room["id"]) + len(data) // 2)
    refused(room.post("/diloco/start", data=data, headers=OCTET))
    assert app.extensions["zwdx"].store.room_artifact_bytes(room.room["id"]) == 0


def test_a_round_whose_global_weights_do_not_fit_the_quota_is_refused_and_writes_nothing(app):
    room, ranks, job, numel, second = half_a_round(app)
    size = len(codec.encode(second, "none"))
    # room for the second upload and the round's average, not for the server's global weights beside them
    limit(app, ROOM_MAX_ARTIFACT_BYTES=stored(app, room.room["id"]) + 2 * size + 4 * numel)
    refused(upload(ranks[1], job, 0, second))
    store = app.extensions["zwdx"].store
    assert store.list_artifacts(job["id"], ArtifactKind.OUTER_GRADIENT.value) == []
    assert store.list_artifacts(job["id"], ArtifactKind.DILOCO_GLOBAL.value) == []
    limit(app, ROOM_MAX_ARTIFACT_BYTES=0)  # the quota lifted: the round goes on
    put(ranks[1], job, 0, second)
    assert len(store.list_artifacts(job["id"], ArtifactKind.DILOCO_GLOBAL.value)) == 1


def test_the_quota_counts_the_global_weights_where_the_artifact_size_limit_is_lower(app):
    room, ranks, job, numel, second = half_a_round(app)
    size = len(codec.encode(second, "none"))
    # each artifact within the size limit, and more left of the quota than that limit, not enough for all
    limit(app, MAX_ARTIFACT_BYTES=size + 1024, ROOM_MAX_ARTIFACT_BYTES=stored(app, room.room["id"]) + 2 * size + 4 * numel)
    refused(upload(ranks[1], job, 0, second))
    assert app.extensions["zwdx"].store.list_artifacts(job["id"], ArtifactKind.DILOCO_GLOBAL.value) == []
