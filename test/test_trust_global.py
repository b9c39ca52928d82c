"""DILOCO's global weights held by the server (issue 33): the SDK uploads the model's start
weights, the server steps its own global weights with every round's aggregate (numpy, torch's
SGD arithmetic bit for bit), and the weights the submitter downloads are the server's: a donor
that uploads forged final weights, or none, changes nothing, and one that uploads a forged
pseudo-gradient moves them no further than the robust rule admits. In-process, over both stores."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load as load_safetensors

from conftest import Api
from store_backends import *  # noqa: F401,F403  (fixtures: backend, mongo_uri, ...)
from test_robust import honest
from workloads import start_placed
from zwdx import codec, defaults, start_weights
from zwdx.server import global_weights

torch.set_num_threads(1)


@pytest.fixture
def backend_app(backend, make_app, tmp_path):
    if backend.name == "sqlite":
        return make_app(DATA_DIR=backend.where)
    return make_app(DATA_DIR=str(tmp_path / "mongo-app"), MONGO_URI=backend.where)


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(7, 4)
        self.mid = torch.nn.Linear(4, 4).to(torch.bfloat16)
        self.head = torch.nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("seen", torch.zeros(3))


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Tanh(), torch.nn.Linear(30, 10))


def flat(m: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in m.parameters()])


# -- the arithmetic ---------------------------------------------------------------------------------
@pytest.mark.parametrize("lr,m,nesterov", [(0.7, 0.9, True), (1.0, 0.0, False), (0.3, 0.8, False)])
def test_the_servers_outer_step_is_torchs_sgd_bit_for_bit(lr, m, nesterov, monkeypatch):
    monkeypatch.setattr(global_weights, "SLICE", 1000)  # a slice at a time, the last one short
    rng = np.random.default_rng(1)
    start = rng.standard_normal(5003).astype(np.float32)
    weights = torch.nn.Parameter(torch.from_numpy(start.copy()))
    sgd = torch.optim.SGD([weights], lr=lr, momentum=m, nesterov=nesterov)
    params, momentum = start, None
    for _ in range(6):
        grad = (0.01 * rng.standard_normal(start.size)).astype(np.float32)
        weights.grad = torch.from_numpy(grad.copy())
        sgd.step()
        params, momentum = global_weights.outer_step(params, momentum, grad, lr, m, nesterov)
    assert np.array_equal(weights.detach().numpy(), params)  # a plain a + m * b would differ (torch fuses it)


def test_bf16_and_fp16_are_cast_as_torch_casts():
    values = torch.randn(10000) * 3
    for dtype, name in [(torch.bfloat16, "BF16"), (torch.float16, "F16")]:
        ours = global_weights.from_f32(name, values.numpy())
        assert ours == values.to(dtype).view(torch.int16).numpy().tobytes()
        assert np.array_equal(global_weights.to_f32(name, ours), values.to(dtype).float().numpy())


def test_start_weights_name_each_parameter_once_with_its_tied_names():
    m = Tied()
    groups = start_weights.parameter_keys(m)
    assert groups == [["embed.weight", "head.weight"], ["mid.weight"], ["mid.bias"]]
    data = start_weights.encode(m)
    assert global_weights.check_start(data) == sum(p.numel() for p in m.parameters())
    header, meta, _ = global_weights.read(data)
    assert set(header) == set(m.state_dict()) and json.loads(meta["parameters"]) == groups
    with pytest.raises(ValueError, match="parameters"):
        global_weights.check_start(global_weights.write({"w": ("F32", [2], b"\0" * 8)}, {"parameters": '[["x"]]'}))


def test_a_workers_fingerprint_of_its_parameters_is_the_servers_of_the_same_weights():
    from gpu_client.rank.strategies.diloco import Diloco
    m = Tied()
    m.seen += 3  # a buffer, each worker's own: not in the global weights' fingerprint
    header, meta, body = global_weights.read(start_weights.encode(m))
    params = {k: bytes(body[slice(*header[k]["data_offsets"])]) for g in json.loads(meta["parameters"]) for k in g}
    worker = Diloco.global_fingerprint(None, m, m.state_dict())  # it uses nothing of its worker
    assert worker == global_weights.fingerprint(params)


# -- a job's rounds and weights ---------------------------------------------------------------------
def placed(app, start: bytes | None, world_size: int = 3, **settings):
    """``test_diloco.placed``, the job submitted with start weights as the SDK sends them."""
    room = Api(app.test_client()).create_room("trust")
    diloco = {"compression": "none", **settings}
    if start is not None:
        answer = room.post("/diloco/start", data=start, headers={"Content-Type": "application/octet-stream"})
        assert answer.status_code == 201, answer.json
        diloco["start_weights"] = answer.json["id"]
    job = room.submit(parallelism="DILOCO", world_size=world_size, diloco=diloco).json
    ranks = start_placed(app, room, job, world_size)
    for r, api in enumerate(ranks):
        assert api.post(f"/jobs/{job['id']}/ranks/{r}", json={"status": "running"}).json["ok"]
    return room, ranks, job


def put(rank: Api, job: dict, n: int, values: np.ndarray, last: bool = False):
    data = codec.encode(np.asarray(values, np.float32), "none")
    resp = rank.put(f"/jobs/{job['id']}/diloco/rounds/{n}?last={'true' if last else 'false'}", data=data,
                    headers={defaults.SHA256_HEADER: hashlib.sha256(data).hexdigest()})
    assert resp.status_code == 201, resp.json


def complete(rank: Api, job: dict, r: int, state: dict | None = None, fingerprint: str | None = None) -> None:
    """Rank ``r`` reports its end (and ``fingerprint`` as its global weights'); with ``state``,
    uploading it as the job's weights first."""
    weights = None
    if state is not None:
        from safetensors.torch import save
        answer = rank.put(f"/jobs/{job['id']}/weights", data=save(state))
        assert answer.status_code == 201, answer.json
        weights = answer.json["id"]
    report = {"status": "completed", "weights_artifact": weights, "global_fingerprint": fingerprint}
    assert rank.post(f"/jobs/{job['id']}/ranks/{r}", json=report).json["ok"]


def parameters_fingerprint(m: torch.nn.Module) -> str:
    """sha256 over the parameters' names and bytes, in name order (what a worker reports)."""
    digest = hashlib.sha256()
    named = {k: v for k, v in m.state_dict(keep_vars=True).items() if isinstance(v, torch.nn.Parameter)}
    for name in sorted(named):
        digest.update(name.encode())
        digest.update(named[name].detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def rounds(ranks: list[Api], job: dict, vectors: list[list[np.ndarray]], sgd: torch.optim.SGD,
           weights: torch.nn.Parameter) -> None:
    """Every round's uploads (the last marked so); the honest workers' global weights stepped
    with the aggregate each fetches, as ``gpu_client``'s DILOCO does."""
    for n, uploads in enumerate(vectors):
        for r, values in enumerate(uploads):
            put(ranks[r], job, n, values, last=n == len(vectors) - 1)
        weights.grad = torch.from_numpy(codec.decode(ranks[0].get(f"/jobs/{job['id']}/diloco/rounds/{n}").data))
        sgd.step()


def downloaded(room: Api, job: dict) -> dict:
    resp = room.get(f"/jobs/{job['id']}/weights")
    assert resp.status_code == 200, resp.json
    return load_safetensors(resp.data)


def test_forged_final_weights_and_a_forged_pseudo_gradient_do_not_make_the_weights(backend_app):
    app, net = backend_app, model()
    start = flat(net)
    room, ranks, job = placed(app, start_weights.encode(net), suspect_after=0)
    weights = torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([weights], lr=0.7, momentum=0.9, nesterov=True)  # the settings' defaults
    vectors = []
    for n in range(3):
        good = honest(2, start.numel(), seed=n)
        vectors.append([0.01 * good[0], 0.01 * good[1], -0.4 * good[0]])  # rank 2 forges: 40x, pointing back
    rounds(ranks, job, vectors, sgd, weights)
    forged = {k: v + 100.0 for k, v in net.state_dict().items()}
    complete(ranks[1], job, 1)
    complete(ranks[2], job, 2)
    complete(ranks[0], job, 0, forged)  # rank 0 uploads weights of its own making
    after = room.get(f"/jobs/{job['id']}").json
    assert after["status"] == "completed"
    got = downloaded(room, job)
    assert set(got) == set(net.state_dict())
    net.load_state_dict(got)
    assert torch.equal(flat(net), weights.detach())  # the server's global weights, to the bit
    honest_only = start.clone()
    plain = start.clone()
    for uploads in vectors:  # the same rounds, outer SGD of lr 1 for the comparison's sake: the rule's bound
        honest_only -= torch.from_numpy((uploads[0] + uploads[1]) / 2)
        plain -= torch.from_numpy(sum(uploads) / 3)
    moved = float((flat(net) - start).norm())
    assert moved < 3 * float((honest_only - start).norm())  # the liar's 40x vector was clipped to the median
    assert any("rank 0 uploaded weights that are not the global weights" in w for w in after["warnings"])


def test_a_rank_that_uploads_no_weights_still_brings_the_servers(app):
    net = model()
    room, ranks, job = placed(app, start_weights.encode(net), world_size=2)
    weights = torch.nn.Parameter(flat(net).clone())
    sgd = torch.optim.SGD([weights], lr=0.7, momentum=0.9, nesterov=True)
    rounds(ranks, job, [[v * 0.01 for v in honest(2, weights.numel(), seed=n)] for n in range(2)], sgd, weights)
    complete(ranks[1], job, 1)
    complete(ranks[0], job, 0)
    net.load_state_dict(downloaded(room, job))
    assert torch.equal(flat(net), weights.detach())


def test_without_start_weights_the_weights_are_the_uploads_and_a_chain_broken_says_so(app):
    net = model()
    room, ranks, job = placed(app, None, world_size=2)
    put(ranks[0], job, 0, flat(net) * 0, last=True)
    put(ranks[1], job, 0, flat(net) * 0, last=True)
    complete(ranks[1], job, 1)
    complete(ranks[0], job, 0, net.state_dict())
    assert torch.equal(downloaded(room, job)["0.weight"], net.state_dict()["0.weight"])
    room, ranks, job = placed(app, start_weights.encode(net), world_size=2)
    put(ranks[0], job, 1, flat(net) * 0, last=True)  # round 0 went elsewhere (the workers' all-reduce)
    put(ranks[1], job, 1, flat(net) * 0, last=True)
    complete(ranks[1], job, 1)
    complete(ranks[0], job, 0, net.state_dict())
    log = [e["data"]["text"] for e in room.get(f"/jobs/{job['id']}/events").json["events"] if e["kind"] == "log"]
    assert any("rank 0's upload: the server does not hold the global weights" in t for t in log), log


def test_start_weights_are_the_rooms_own_and_checked_by_their_header(app):
    room = Api(app.test_client()).create_room("trust-start")
    bad = room.post("/diloco/start", data=b"\x08\0\0\0\0\0\0\0{}      ", headers={"Content-Type": "application/octet-stream"})
    assert bad.status_code == 400 and bad.json["error"]["field"] == "body"
    documented = app.test_client().get("/api/v1/openapi.json").json["paths"]["/api/v1/diloco/start"]["post"]
    assert "400" in documented["responses"]  # the answer it gives is the one it declares (the fuzz found it missing)
    other = Api(app.test_client()).create_room("trust-other")
    theirs = other.post("/diloco/start", data=start_weights.encode(model()),
                        headers={"Content-Type": "application/octet-stream"}).json["id"]
    error = room.refused("diloco.start_weights", parallelism="DILOCO", world_size=2,
                         diloco={"start_weights": theirs})
    assert "no start weights" in error["message"]
    ours = room.post("/diloco/start", data=start_weights.encode(model()),
                     headers={"Content-Type": "application/octet-stream"}).json["id"]
    room.refused("datasets.0", parallelism="DILOCO", world_size=2, diloco={"start_weights": ours}, datasets=["none"])
    assert app.extensions["zwdx"].store.get_artifact(ours) is None  # a refused submit's start weights go at once


# -- the global weights against every worker's fingerprint (issue 33 §1, workers that all-reduce) -----
def suspects_of(room: Api, job: dict) -> dict:
    after = room.get(f"/jobs/{job['id']}").json
    assert after["status"] == "completed", after["status"]
    return after["suspects"]


def test_a_worker_whose_final_weights_are_not_the_servers_is_a_suspect(app, capsys):
    net = model()
    room, ranks, job = placed(app, start_weights.encode(net))
    weights = torch.nn.Parameter(flat(net).clone())
    sgd = torch.optim.SGD([weights], lr=0.7, momentum=0.9, nesterov=True)
    rounds(ranks, job, [[v * 0.01 for v in honest(3, weights.numel(), seed=n)] for n in range(2)], sgd, weights)
    torch.nn.utils.vector_to_parameters(weights.detach(), net.parameters())
    right = parameters_fingerprint(net)
    complete(ranks[1], job, 1, fingerprint=right)
    complete(ranks[2], job, 2, fingerprint="f" * 64)  # it says it holds other weights
    complete(ranks[0], job, 0, net.state_dict(), fingerprint=right)
    named = suspects_of(room, job)
    assert list(named) == ["2"] and "not the server's global weights" in named["2"]["reason"], named
    assert named["2"]["client_id"] == f"gpu-{job['id']}-2"
    from types import SimpleNamespace
    from zwdx.jobs_cli import jobs_show
    jobs_show(SimpleNamespace(get_job=lambda _: room.get(f"/jobs/{job['id']}").json),
              SimpleNamespace(job_id=job["id"], json=False))
    shown = [line for line in capsys.readouterr().out.splitlines() if line.startswith("SUSPECT")]
    assert len(shown) == 1 and "rank 2" in shown[0] and "at the end: its final weights" in shown[0], shown
    assert "dropped" not in shown[0]  # it finished: named, not dropped


@pytest.mark.parametrize("world_size,says,suspect", [(3, ["a", "a", "b"], ["2"]), (3, ["b", "a", "a"], ["0"]),
                                                     (2, ["a", "b"], [])])
def test_workers_that_averaged_among_themselves_are_checked_against_the_majority(app, world_size, says, suspect):
    net = model()
    room, ranks, job = placed(app, start_weights.encode(net), world_size=world_size)  # no round reaches the server
    for r in reversed(range(world_size)):
        complete(ranks[r], job, r, net.state_dict() if r == 0 else None, fingerprint=says[r] * 64)
    named = suspects_of(room, job)
    assert sorted(named) == suspect, named
    if suspect:
        assert "(the majority)" in named[suspect[0]]["reason"]
