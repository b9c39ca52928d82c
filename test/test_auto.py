"""parallelism="AUTO": the rule (``zwdx.server.auto.decide``) on fake slots and links, each rule and
each boundary with the reason it gives; the spec's ``Auto``; and the scheduler resolving an AUTO job
in process (the mode stored on the record, in its log, and what the GPU clients are assigned)."""
from __future__ import annotations

import re

import pytest

from zwdx.protocol import Parallelism
from zwdx.server.auto import Choice, Need, Place, Rules, decide, need_of
from zwdx.protocol.spec import Auto

GiB = 1024**3
FAST, SLOW = 10e9 / 8, 100e6 / 8  # 10 Gbit/s, 100 Mbit/s
RULES = Rules(min_link=1e9 / 8, margin=0.2)


def two(free_gib: float, link: float | None = FAST, hosts=("h1", "h2"), per_client: int = 1) -> list[Place]:
    return [Place(f"c{i}", tuple([int(free_gib * GiB)] * per_client), hosts[i], link) for i in range(2)]


# state, activations (GiB); the slots; what it chooses; words its reason holds
CASES = [
    ("replica fits every slot with margin", (4, 2), two(10), set(), Parallelism.DDP,
     ["DDP", "fits every slot", "8.00 GiB usable"]),
    ("replica exactly at the usable bound", (6, 2), two(10), set(), Parallelism.DDP, ["DDP"]),
    ("replica one GiB past the margin: sharded", (7, 2), two(10), set(), Parallelism.FSDP,
     ["FSDP", "sharded over 2 ranks", "5.50 GiB"]),
    ("sharded exactly at the bound", (12, 2), two(10), set(), Parallelism.FSDP, ["FSDP"]),
    ("sharded past the bound, one slot per client: pipeline", (14, 2), two(10), set(), Parallelism.PIPELINE,
     ["PIPELINE", "cut into 2 stages", "8.00 GiB"]),
    ("activations too large to shard: TP on a client of 2 slots", (20, 6), two(10, per_client=2), set(),
     Parallelism.FSDP_TP, ["FSDP+TP", "2 slots", "8.00 GiB a rank"]),
    ("even cut into stages it does not fit", (30, 8), two(10), set(), None, ["no mode fits", "19.00 GiB"]),
    ("clients apart: DILOCO", (4, 2), two(10), {frozenset(("c0", "c1"))}, Parallelism.DILOCO,
     ["DILOCO", "c0 and c1 cannot reach each other", "syncs through the server"]),
    ("clients apart and no replica fits a slot", (9, 2), two(10), {frozenset(("c0", "c1"))}, None,
     ["no mode fits", "cannot reach each other"]),
    ("a slow link between hosts: DILOCO", (4, 2), two(10, SLOW), set(), Parallelism.DILOCO,
     ["DILOCO", "0.10 Gbit/s, below AUTO_MIN_LINK (1.00 Gbit/s)"]),
    ("a link exactly at the threshold is fast", (4, 2), two(10, 1e9 / 8), set(), Parallelism.DDP,
     ["DDP", "links of at least 1.00 Gbit/s"]),
    ("a slow link on one host does not count", (4, 2), two(10, SLOW, hosts=("h", "h")), set(), Parallelism.DDP,
     ["DDP", "one host"]),
    ("links not measured are taken as fast", (4, 2), two(10, None), set(), Parallelism.DDP,
     ["links not measured (taken as fast)"]),
    ("one slot that does not hold a replica", (9, 2), two(10)[:1], set(), None, ["no mode fits one slot"]),
    ("no slot says its memory: taken to fit", (400, 2), [Place("c0", (None,)), Place("c1", (None,))], set(),
     Parallelism.DDP, ["no slot reported its free memory"]),
    ("no idle slot", (1, 1), [Place("c0", ())], set(), None, ["no idle slot"]),
]


@pytest.mark.parametrize("state, places, pairs, mode, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_rule_and_boundary_says_why(state, places, pairs, mode, words):
    choice = decide(Need(state=int(state[0] * GiB), activations=int(state[1] * GiB)), places, pairs, None, RULES)
    assert choice.parallelism == mode, choice.reason
    for word in words:
        assert word in choice.reason, (word, choice.reason)


def test_world_size_takes_the_roomiest_slots_and_shards_over_them():
    places = [Place("small", (int(3 * GiB),), "h"), Place("big", (int(10 * GiB), int(10 * GiB)), "h")]
    need = Need(state=int(4 * GiB), activations=int(0.5 * GiB))
    choice = decide(need, places, set(), 2, RULES)
    assert (choice.parallelism, choice.ranks) == (Parallelism.DDP, 2)  # the 3 GiB slot is left out
    choice = decide(need, places, set(), 3, RULES)
    assert (choice.parallelism, choice.ranks) == (Parallelism.FSDP, 3), choice.reason


def test_fsdp_tp_wants_the_same_slots_on_every_client_and_says_its_group():
    uneven = [Place("a", (int(10 * GiB),) * 2, "h1", FAST), Place("b", (int(10 * GiB),), "h2", FAST)]
    need = Need(state=int(16 * GiB), activations=int(6 * GiB))
    assert decide(need, uneven, set(), None, RULES).parallelism == Parallelism.PIPELINE
    even = decide(need, two(10, per_client=2), set(), None, RULES)
    assert isinstance(even, Choice) and (even.tp, even.ranks) == (2, 4)


def test_the_spec_takes_auto_and_the_flat_string():
    from zwdx.protocol.spec import JobSpec
    code = {"bundle_artifact": "a", "versions": {"python": "3.11"}}
    tree = JobSpec.model_validate({"code": code, "strategy": {"type": "auto", "parameter_bytes": 10}})
    assert tree.parallelism == Parallelism.AUTO and isinstance(tree.strategy, Auto)
    flat = JobSpec.model_validate({**code, "parallelism": "AUTO"})
    assert flat.strategy == Auto()


def test_need_counts_the_state_and_states_activations_when_not_measured():
    assert need_of(Auto(parameter_bytes=100), 1.0) == Need(state=400, activations=100)
    assert need_of(Auto(parameter_bytes=100, state_bytes=300, activation_bytes=7), 1.0) == Need(300, 7)


# -- the scheduler, in process --------------------------------------------------------------------
def hello(client_id: str, free: int, **fields) -> dict:
    import platform
    return {"client_id": client_id, "hostname": f"host-{client_id}", "versions": {"python": platform.python_version()},
            "slots": [{"index": 0, "kind": "cpu", "memory_total": free, "memory_free": free}], **fields}


def auto_job(api, parameter_bytes: int) -> str:
    import platform
    code = {"bundle_artifact": api.upload()["id"], "versions": {"python": platform.python_version()}}
    resp = api.post("/jobs", json={"spec": {"code": code, "resources": {"world_size": 2},
                                            "strategy": {"type": "auto", "parameter_bytes": parameter_bytes}}})
    assert resp.status_code == 201, resp.json
    assert resp.json["spec"]["parallelism"] == "AUTO" and resp.json["auto"] is None
    return resp.json["id"]


@pytest.mark.parametrize("where, mode, why", [  # not "room": that names the process fixture (slow)
    ("near", "DDP", "DDP: a replica needs 0.62 GiB"),
    ("small", "FSDP", "FSDP: a replica needs 1.25 GiB"),
    ("apart", "DILOCO", "DILOCO: gpu clients a and b cannot reach each other"),
    ("slow", "DILOCO", "DILOCO: gpu client a's link measures 0.10 Gbit/s"),
])
def test_the_scheduler_gives_an_auto_job_its_mode_records_why_and_logs_it(app, api, socket_client, where, mode, why):
    import time
    ctx = app.extensions["zwdx"]
    link = {"rtt": 0.01, "up": 12.5e6 if where == "slow" else 1.25e9, "down": 1.25e9, "measured_at": 1.7e9}
    for cid in ("a", "b"):
        sock = socket_client("/gpu", api.donor)
        assert sock.emit("register", hello(cid, GiB, link=link), namespace="/gpu", callback=True)["ok"]
    if where == "apart":
        ctx.store.update_client("a", {"unreachable": [{"client_id": "b", "until": time.time() + 60}]})
    job_id = auto_job(api, (GiB // 4 if where == "small" else GiB // 8))  # state 4x, activations 1x the parameters
    ctx.scheduler.schedule_once()
    job = api.get(f"/jobs/{job_id}").json
    assert job["status"] == "starting" and job["spec"]["parallelism"] == mode, job
    assert job["auto"]["parallelism"] == mode and job["auto"]["reason"].startswith(why), job["auto"]
    assert sorted(p["client_id"] for p in job["placement"]) == ["a", "b"]
    logs = api.get(f"/jobs/{job_id}/events", query_string={"kind": "log"}).json["events"]
    assert [e["data"]["text"] for e in logs] == [f"AUTO chose {job['auto']['reason']}"]


def test_an_auto_job_no_mode_fits_waits_saying_why_and_holds_back_no_one(app, api, socket_client):
    ctx = app.extensions["zwdx"]
    for cid in ("a", "b"):
        assert socket_client("/gpu", api.donor).emit("register", hello(cid, GiB), namespace="/gpu", callback=True)["ok"]
    big = auto_job(api, GiB)  # 5 GiB a replica, 2.5 GiB a stage: neither fits 0.8 GiB
    small = api.submit(world_size=2).json["id"]
    ctx.scheduler.schedule_once()
    waiting = api.get(f"/jobs/{big}").json
    assert waiting["status"] == "queued" and waiting["spec"]["parallelism"] == "AUTO" and waiting["auto"] is None
    assert waiting["waiting_reason"].startswith("AUTO: no mode fits: a replica needs 5.00 GiB"), waiting
    assert api.get(f"/jobs/{small}").json["status"] == "starting"


def test_the_sdk_counts_what_a_replica_needs_from_the_model_and_optimizer():
    import torch
    from zwdx.sdk.auto import counted
    torch.set_num_threads(1)
    model = torch.nn.Linear(10, 10)  # 110 float32 parameters: 440 bytes
    adam = counted({"type": "auto", "parameter_bytes": 0, "state_bytes": 0}, model, torch.optim.AdamW(model.parameters()))
    assert (adam["parameter_bytes"], adam["state_bytes"]) == (440, 440 * 4)
    sgd = counted({"type": "auto", "parameter_bytes": 0, "state_bytes": 0}, model, torch.optim.SGD(model.parameters()))
    assert sgd["state_bytes"] == 440 * 2  # parameters and gradients, no momentum buffer
    assert counted({"type": "auto", "parameter_bytes": 0, "state_bytes": 7}, model, None)["state_bytes"] == 7


def test_zwdx_jobs_show_says_what_auto_chose_and_why(capsys):
    from types import SimpleNamespace
    from zwdx.jobs_cli import jobs_show
    reason = "DDP: a replica needs 0.62 GiB (state 0.50 GiB + activations 0.12 GiB), which fits every slot"
    job = {"id": "j1", "status": "running", "spec": {"parallelism": "DDP", "strategy": {"type": "ddp"}},
           "auto": {"parallelism": "DDP", "reason": reason, "at": 1.0}}
    assert jobs_show(SimpleNamespace(get_job=lambda job_id: job), SimpleNamespace(job_id="j1", json=False)) == 0
    assert re.search(rf"^AUTO chose +{re.escape(reason)}$", capsys.readouterr().out, re.M)


def test_the_sdk_result_says_what_auto_chose():
    from zwdx.sdk.results import result_of
    chosen = {"parallelism": "DILOCO", "reason": "DILOCO: gpu clients a and b cannot reach each other", "at": 1.0}
    job = {"id": "j1", "status": "completed", "auto": chosen}
    assert result_of(job, True).auto == chosen and result_of({**job, "auto": None}, True)["auto"] is None


@pytest.mark.parametrize("choice, strategy, world, per_client", [
    (Choice(Parallelism.FSDP_TP, "", tp=2, ranks=4), {"type": "fsdp", "lora": None, "tp": {"plan": None, "size": 2}}, 4, 2),
    (Choice(Parallelism.PIPELINE, "", ranks=3), {"type": "pipeline", "schedule": "gpipe"}, 3, None),
    (Choice(Parallelism.DILOCO, "", ranks=2), {"type": "diloco", "inner_steps": 500}, None, None),
])
def test_the_stored_spec_takes_the_mode_chosen_with_what_it_decides_of_the_resources(choice, strategy, world,
                                                                                      per_client):
    from zwdx.protocol.spec import JobSpec
    from zwdx.server.auto import _strategy
    spec = JobSpec.model_validate({"code": {"bundle_artifact": "a", "versions": {"python": "3.11"}},
                                   "strategy": {"type": "auto", "parameter_bytes": 10}})
    resolved = JobSpec.model_validate(_strategy(choice, spec).model_dump(mode="json"))  # as the store reads it back
    assert resolved.parallelism == choice.parallelism
    dumped = resolved.strategy.model_dump(mode="json")
    assert {k: dumped[k] for k in strategy} == strategy
    assert (resolved.resources.world_size, resolved.resources.gpus_per_client) == (world, per_client)


@pytest.mark.parametrize("where, mode", [("near", "DDP"), ("apart", "DILOCO")])
def test_an_auto_jobs_start_weights_are_the_global_weights_diloco_steps_or_go_when_it_chooses_another(
        app, api, socket_client, where, mode):
    import time

    import torch

    from zwdx import start_weights
    ctx = app.extensions["zwdx"]
    for cid in ("a", "b"):
        assert socket_client("/gpu", api.donor).emit("register", hello(cid, GiB), namespace="/gpu", callback=True)["ok"]
    if where == "apart":
        ctx.store.update_client("a", {"unreachable": [{"client_id": "b", "until": time.time() + 60}]})
    start = api.post("/diloco/start", data=start_weights.encode(torch.nn.Linear(3, 2)),
                     headers={"Content-Type": "application/octet-stream"})
    assert start.status_code == 201, start.json
    import platform
    code = {"bundle_artifact": api.upload()["id"], "versions": {"python": platform.python_version()}}
    resp = api.post("/jobs", json={"spec": {"code": code, "resources": {"world_size": 2}, "strategy": {
        "type": "auto", "parameter_bytes": GiB // 8, "start_weights": start.json["id"]}}})
    assert resp.status_code == 201, resp.json
    assert ctx.store.get_artifact(start.json["id"])["job_id"] == resp.json["id"]  # the job's, swept with it
    ctx.scheduler.schedule_once()
    job = api.get(f"/jobs/{resp.json['id']}").json
    assert job["spec"]["parallelism"] == mode, job
    if mode == "DILOCO":  # the server steps its own global weights from the submitter's start
        assert job["spec"]["strategy"]["start_weights"] == start.json["id"]
        assert ctx.store.get_artifact(start.json["id"]) is not None
    else:
        assert ctx.store.get_artifact(start.json["id"]) is None  # no job will step them: out of the quota
