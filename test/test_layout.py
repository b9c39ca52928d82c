"""What a rank holds of the model (its layout, ``zwdx.protocol.layout``): the message's bounds,
and the server's rules for it (only the rank's own key writes it, while the rank runs; an
over-long or malformed one is a 400 that changes nothing), in process."""
from __future__ import annotations

import platform

import pytest

from zwdx.errors import BadRequest
from zwdx.protocol.base import parse
from zwdx.protocol.layout import MAX_MODULES, RankLayout

from conftest import Api

STAGE_0 = {"role": "stage", "text": "stage 0 of 2: embed, blocks.0-1", "modules": ["embed", "blocks.0-1"],
           "params": 1234, "stage": {"index": 0, "of": 2}, "device": "cpu"}


@pytest.mark.parametrize("layout", [
    {"role": "replica", "text": "the whole model"},
    STAGE_0,
    {"role": "fsdp+tp", "text": "1/2 of 3 units", "mesh": {"dp": 1, "tp": 0, "dp_size": 2, "tp_size": 2},
     "batch": 16, "weight": 0.25, "device": "cuda:1"},
    {"role": "stage", "text": "stages 0 and 2 of 4", "stage": {"index": 0, "of": 4, "virtual": [0, 2]}},
])
def test_a_layout_within_its_bounds_is_taken(layout):
    assert parse(RankLayout, layout).model_dump(mode="json", exclude_none=True) == layout


@pytest.mark.parametrize("layout, field", [
    ({"text": "no role"}, "role"),
    ({"role": "owner", "text": "a role zwdx does not know"}, "role"),
    ({"role": "replica", "text": ""}, "text"),
    ({"role": "replica", "text": "x" * 501}, "text"),
    ({"role": "replica", "text": "two\nlines"}, "text"),
    ({"role": "replica", "text": "t", "modules": ["m"] * (MAX_MODULES + 1)}, "modules"),
    ({"role": "replica", "text": "t", "modules": ["x" * 201]}, "modules.0"),
    ({"role": "replica", "text": "t", "params": -1}, "params"),
    ({"role": "replica", "text": "t", "params": "12"}, "params"),
    ({"role": "stage", "text": "t", "stage": {"index": 2, "of": 2}}, "stage"),
    ({"role": "tp", "text": "t", "mesh": {"dp": 0, "tp": 2, "dp_size": 1, "tp_size": 2}}, "mesh"),
    ({"role": "replica", "text": "t", "weight": 1.5}, "weight"),
    ({"role": "replica", "text": "t", "device": "<script>"}, "device"),
    ({"role": "replica", "text": "t", "colour": "red"}, "colour"),
])
def test_a_layout_out_of_bounds_is_refused_naming_the_field(layout, field):
    with pytest.raises(BadRequest) as err:
        parse(RankLayout, layout)
    assert err.value.to_dict()["error"]["field"] == field


def two_ranks(app) -> tuple[Api, list[Api], str]:
    """A job of two ranks placed on a GPU client's two CPU slots, under keys the test holds: the
    room's Api, each rank's Api (its key alone), and the job's id."""
    from zwdx.protocol import SlotKind
    from zwdx.protocol.job import PlacementEntry
    from zwdx.server.auth import hash_secret
    from zwdx.server.jobs import Job
    room = Api(app.test_client()).create_room("layout")
    job = room.post("/jobs", json={"bundle_artifact": room.upload()["id"], "world_size": 2,
                                   "versions": {"python": platform.python_version()}}).json
    store, client_id = app.extensions["zwdx"].store, "gpu-layout"
    store.upsert_client({"id": client_id, "room_id": room.room["id"], "hostname": "layout", "status": "online"},
                        [{"id": f"{client_id}:{i}", "client_id": client_id, "room_id": room.room["id"], "index": i,
                          "kind": "cpu"} for i in range(2)])
    placement = [PlacementEntry(rank=i, client_id=client_id, gpu_index=i, kind=SlotKind.CPU) for i in range(2)]
    assert Job.load(store, job["id"]).start(placement, [f"{client_id}:{i}" for i in range(2)],
                                            {i: hash_secret(f"rk_layout{i}") for i in range(2)})
    return room, [room.as_(None, rank_key=f"rk_layout{i}") for i in range(2)], job["id"]


def ranks_of(room: Api, job_id: str) -> dict:
    resp = room.get(f"/jobs/{job_id}")
    assert resp.status_code == 200, resp.text
    return resp.json["ranks"]


def test_a_running_rank_reports_its_own_layout_and_no_other_ranks(app):
    room, (rank0, rank1), job_id = two_ranks(app)
    # before it runs, a rank's layout is not kept
    resp = rank0.post(f"/jobs/{job_id}/ranks/0/layout", json=STAGE_0)
    assert resp.status_code == 200 and resp.json["ok"] is False, resp.text
    assert ranks_of(room, job_id) == {}

    for i, rank in enumerate((rank0, rank1)):
        assert rank.post(f"/jobs/{job_id}/ranks/{i}", json={"status": "running"}).status_code == 200
    resp = rank0.post(f"/jobs/{job_id}/ranks/0/layout", json=STAGE_0)
    assert resp.status_code == 200 and resp.json["ok"] is True, resp.text
    assert ranks_of(room, job_id)["0"]["layout"] == STAGE_0

    # rank 1's key cannot write rank 0's layout, nor can the room's token or no key
    forged = {**STAGE_0, "text": "forged by rank 1"}
    resp = rank1.post(f"/jobs/{job_id}/ranks/0/layout", json=forged)
    assert resp.status_code == 403, resp.text
    assert room.post(f"/jobs/{job_id}/ranks/0/layout", json=forged).status_code in (401, 403)
    assert ranks_of(room, job_id)["0"]["layout"] == STAGE_0
    assert "layout" not in ranks_of(room, job_id)["1"]

    # too long, malformed, or for a rank the job lacks: 400, and nothing changes
    too_long = {**STAGE_0, "modules": [f"blocks.{i}" for i in range(MAX_MODULES + 1)]}
    for path, body in ((f"/jobs/{job_id}/ranks/0/layout", too_long),
                       (f"/jobs/{job_id}/ranks/0/layout", {**STAGE_0, "text": "<b>" * 200}),
                       (f"/jobs/{job_id}/ranks/0/layout", {**STAGE_0, "stage": {"index": "0", "of": 2}}),
                       (f"/jobs/{job_id}/ranks/0/layout", ["not", "an", "object"]),
                       (f"/jobs/{job_id}/ranks/7/layout", STAGE_0)):
        resp = rank0.post(path, json=body)
        assert resp.status_code == 400, (body, resp.text)
        assert resp.json["error"]["message"]
    assert ranks_of(room, job_id)["0"]["layout"] == STAGE_0

    # a rank's layout stays on its state once it completed
    assert rank1.post(f"/jobs/{job_id}/ranks/1/layout", json={"role": "stage", "text": "stage 1 of 2",
                                                             "stage": {"index": 1, "of": 2}}).json["ok"]
    assert rank1.post(f"/jobs/{job_id}/ranks/1", json={"status": "completed"}).status_code == 200
    assert ranks_of(room, job_id)["1"]["layout"]["text"] == "stage 1 of 2"


def test_jobs_show_prints_the_plan_and_a_pipelines_stage_order():
    from zwdx.jobs_cli import plan_lines
    job = {"spec": {"parallelism": "PIPELINE", "pipeline": {"schedule": "1f1b", "microbatches": None}},
           "placement": [{"rank": 0, "client_id": "gpu-b", "hostname": "beta", "gpu_index": 0},
                         {"rank": 1, "client_id": "gpu-a", "hostname": "alpha", "gpu_index": 0}],
           "ranks": {"0": {"status": "running", "layout": {**STAGE_0, "stage": {"index": 1, "of": 2}}},
                     "1": {"status": "running", "layout": {"role": "stage", "text": "stage 0 of 2: embed",
                                                           "stage": {"index": 0, "of": 2}, "device": "cuda:0"}}}}
    assert plan_lines(job) == [
        "", "plan:",
        "  rank 0 on beta (cpu), stage: stage 0 of 2: embed, blocks.0-1, 1,234 params",
        "  rank 1 on alpha (cuda:0), stage: stage 0 of 2: embed",
        "  stages: 0 (rank 1) -> 1 (rank 0); schedule 1f1b, 2 micro-batches a batch"]
    assert plan_lines({"ranks": {"0": {"status": "running"}}}) == []


# -- what the strategies say (a process group of one, in process) ---------------------------------
def spec(parallelism: str, rank: int = 0, world_size: int = 1):
    from types import SimpleNamespace

    from zwdx.protocol.vocab import Parallelism
    return SimpleNamespace(parallelism=Parallelism(parallelism), rank=rank, world_size=world_size)


def test_the_modules_a_rank_holds_are_named_top_level_ish_with_runs_of_blocks_folded():
    import models
    from gpu_client.rank.strategies.layout import fold, held_modules
    model = models.stage_lm()
    assert held_modules(model) == ["wte", "wpe", "h.0-3", "ln_f", "head"]
    assert held_modules(model, [k for k in model.state_dict() if k.startswith(("h.2.", "h.3.", "head"))]) \
        == ["h.2-3", "head"]
    assert fold(["h.0", "h.1", "x", "h.2", "h.4", "h.5"]) == ["h.0-1", "x", "h.2", "h.4-5"]
    assert fold([f"m{i}" for i in range(70)], 64)[-1] == "... and 7 more"


@pytest.mark.parametrize("parallelism", ["DDP", "FSDP"])
def test_ddp_says_a_replica_and_fsdp_its_units_and_share(group_of_one, parallelism):
    import torch

    import models
    from gpu_client.rank.strategies.parallel import Collective
    strategy = Collective(spec(parallelism))
    model = strategy.wrap(models.stage_lm(), torch.device("cpu"), {}, report=lambda line: None)
    layout = parse(RankLayout, strategy.layout(model)).model_dump(mode="json")  # within the message's bounds
    assert layout["params"] == sum(p.numel() for p in models.stage_lm().parameters())
    assert layout["device"] == "cpu"
    if parallelism == "DDP":
        assert layout["role"] == "replica" and layout["modules"] == ["wte", "wpe", "h.0-3", "ln_f", "head"]
        assert layout["text"] == "the whole model (replica 0 of 1)"
    else:
        assert layout["role"] == "shard" and layout["modules"] == ["h.0-3", "(root)"]
        assert layout["text"].startswith("1/1 of each of 5 FSDP units' weights (h.0-3, then the root)")


# -- FSDP over two ranks (real processes over gloo: one rank cannot tell a shard from the whole) ---
RANK = '''\
import json, sys
import torch
import torch.distributed as dist
sys.path.insert(0, sys.argv[3])
import models
from digests import state_digest
from test_layout import spec
from gpu_client.rank.strategies.parallel import Collective
torch.set_num_threads(1)
rank = int(sys.argv[1])
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[2], 2), rank=rank, world_size=2)
try:
    strategy = Collective(spec("FSDP", rank, 2))
    model = strategy.wrap(models.stage_lm(), torch.device("cpu"), {}, report=lambda line: None)
    local = {n: (p.to_local() if hasattr(p, "to_local") else p).numel() for n, p in model.named_parameters()}
    print(json.dumps({"layout": strategy.layout(model), "local": local,
                      "full": state_digest(strategy.full_state(model))}))
finally:
    dist.destroy_process_group()
'''


@pytest.mark.slow
def test_fsdp_over_two_ranks_holds_half_of_each_weight_and_gathers_the_whole(tmp_path):
    import json
    import os
    import subprocess
    import sys

    import models
    from digests import state_digest
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(here), here])}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(tmp_path / "store"), here], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], [err[-3000:] for _, err in outs]
    seen = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    whole = models.stage_lm()
    full = {n: p.numel() for n, p in whole.named_parameters()}
    for r, rank in enumerate(seen):
        layout = parse(RankLayout, rank["layout"]).model_dump(mode="json")
        assert layout["role"] == "shard" and layout["modules"] == ["h.0-3", "(root)"], layout
        assert layout["text"].startswith("1/2 of each of 5 FSDP units' weights (h.0-3, then the root)"), layout
        assert layout["params"] == sum(rank["local"].values()) < sum(full.values()), (r, layout["params"])
        assert rank["full"] == state_digest(whole.state_dict())  # the shards gather back to the whole
    # each weight split between the two ranks: their local parts add up to it, neither holds it all
    assert set(seen[0]["local"]) == set(seen[1]["local"]) == set(full)
    for name, numel in full.items():
        parts = [rank["local"][name] for rank in seen]
        assert sum(parts) == numel and max(parts) < numel, (name, parts, numel)
