"""Safetensors bytes a donor (or a submitter) sends are read by their header on the server, never
unpickled (``zwdx.server.global_weights.read``): a DILOCO job's start weights, a joining worker's
global weights, and every job's weights that come back, which the server now reads whole to check
them against the ranks' fingerprints. A header forged to break the reader (nested past Python's
recursion limit, entries that are lists, offsets that are strings, no dtype, metadata that is
not an object) is refused as not safetensors: a 400 where the sender is answered, a suspect
where the bytes are rank 0's weights, never a 500 that leaves the job's record half-written."""
from __future__ import annotations

import json

import pytest
import torch

from test_diloco import placed as placed_ddp
from test_robust import honest
from test_trust_global import complete, downloaded, flat, model, placed as placed_diloco, rounds
from zwdx import start_weights
from zwdx.server import global_weights

HEADERS = {
    "nested past the recursion limit": b"[" * 100_000,
    "an entry that is a list": json.dumps({"w": [1, 2]}).encode(),
    "offsets that are a string": json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": "ab"}}).encode(),
    "a shape that is a string": json.dumps({"w": {"dtype": "F32", "shape": "x", "data_offsets": [0, 4]}}).encode(),
    "no dtype": json.dumps({"w": {"shape": [1], "data_offsets": [0, 4]}}).encode(),
    "metadata that is a number": json.dumps({"__metadata__": 5}).encode(),
    "a size past int64": json.dumps({"w": {"dtype": "F32", "shape": [10 ** 30], "data_offsets": [0, 4]}}).encode(),
}


def forged(header: bytes) -> bytes:
    return len(header).to_bytes(8, "little") + header + b"\0" * 4


@pytest.mark.parametrize("what", sorted(HEADERS))
def test_a_forged_header_is_not_safetensors(what):
    with pytest.raises(ValueError, match="not safetensors|not a safetensors entry|offsets are not its size"):
        global_weights.read(forged(HEADERS[what]))


@pytest.mark.parametrize("what", ["nested past the recursion limit", "an entry that is a list", "no dtype"])
def test_forged_start_weights_are_a_400_naming_the_body(app, what):
    from conftest import Api
    room = Api(app.test_client()).create_room("forged-start")
    answer = room.post("/diloco/start", data=forged(HEADERS[what]), headers={"Content-Type": "application/octet-stream"})
    assert answer.status_code == 400 and answer.json["error"]["field"] == "body", answer.json


@pytest.mark.parametrize("what", ["nested past the recursion limit", "offsets that are a string"])
def test_rank_0s_forged_weights_are_named_and_the_job_completes(app, what):
    room, ranks, job = placed_ddp(app, world_size=2, parallelism="DDP")
    for r, api in enumerate(ranks):
        assert api.post(f"/jobs/{job['id']}/ranks/{r}", json={"status": "running"}).json["ok"]
    weights = ranks[0].put(f"/jobs/{job['id']}/weights", data=forged(HEADERS[what])).json["id"]
    for r, api in enumerate(ranks):
        body = {"status": "completed", "fingerprint": "a" * 64, **({"weights_artifact": weights} if r == 0 else {})}
        answer = api.post(f"/jobs/{job['id']}/ranks/{r}", json=body)
        assert answer.status_code == 200 and answer.json["ok"], answer.json
    record = room.get(f"/jobs/{job['id']}").json
    assert record["status"] == "completed" and set(record["suspects"]) == {"0"}
    assert "unreadable (not safetensors)" in record["suspects"]["0"]["reason"]


def test_a_diloco_workers_forged_weights_bring_back_the_servers_own(app):
    net = model()
    room, ranks, job = placed_diloco(app, start_weights.encode(net), world_size=2)
    weights = torch.nn.Parameter(flat(net).clone())
    sgd = torch.optim.SGD([weights], lr=0.7, momentum=0.9, nesterov=True)  # the settings' defaults
    rounds(ranks, job, [[v * 0.01 for v in honest(2, weights.numel(), seed=0)]], sgd, weights)
    complete(ranks[1], job, 1)
    upload = ranks[0].put(f"/jobs/{job['id']}/weights", data=forged(HEADERS["nested past the recursion limit"]))
    assert upload.status_code == 201
    answer = ranks[0].post(f"/jobs/{job['id']}/ranks/0", json={"status": "completed",
                                                               "weights_artifact": upload.json["id"]})
    assert answer.status_code == 200 and answer.json["ok"], answer.json
    record = room.get(f"/jobs/{job['id']}").json
    assert record["status"] == "completed"
    assert any("rank 0 uploaded weights that are not the global weights" in w for w in record["warnings"]), record
    net.load_state_dict(downloaded(room, job))
    assert torch.equal(flat(net), weights.detach())  # the server's global weights, to the bit
