"""DILOCO's spot checks through the server (issue 33, ``verify``), in process over both stores:
a shadow's uploads are compared with its worker's once the round is averaged and never in the
average; identical bytes agree, anything else is a disagreement that names both (two workers:
no third opinion); a shadow that fails is noted and the job goes on. The rule itself:
test_verify.py; with real GPU-client processes: test_diloco_verify.py."""
from __future__ import annotations

import hashlib
import itertools
import random

import numpy as np
import pytest

from conftest import Api
from workloads import start_placed
from store_backends import *  # noqa: F401,F403  (fixtures: backend, mongo_uri, ...)
from zwdx import codec, defaults


@pytest.fixture
def backend_app(backend, make_app, tmp_path):
    if backend.name == "sqlite":
        return make_app(DATA_DIR=backend.where)
    return make_app(DATA_DIR=str(tmp_path / "mongo-app"), MONGO_URI=backend.where)


def shadowed(app, verify: float = 0.5, of: dict[int, int] | None = None, workers: int = 2):
    """A DILOCO job of two ``workers`` started as the scheduler starts one with ``verify``: ranks 0
    and 1 the workers, rank 2 a shadow of worker 1, each on a GPU client of its own. The room's job,
    and each rank's Api (its key alone)."""
    room = Api(app.test_client()).create_room("verify")
    job = room.submit(parallelism="DILOCO", world_size=workers, diloco={"compression": "none", "verify": verify}).json
    of = of or {workers: 1}
    return room, job, start_placed(app, room, job, workers + len(of), shadows=of)


def put(rank, job: dict, n: int, values):
    data = codec.encode(np.asarray(values, np.float32), "none")
    return rank.put(f"/jobs/{job['id']}/diloco/rounds/{n}", data=data,
                    headers={defaults.SHA256_HEADER: hashlib.sha256(data).hexdigest()})


def logs(room, job: dict) -> list[str]:
    return [e["data"]["text"] for e in room.get(f"/jobs/{job['id']}/events").json["events"] if e["kind"] == "log"]


def test_the_world_size_is_the_workers_and_a_shadow_is_never_averaged(backend_app):
    room, job, (r0, r1, shadow) = shadowed(backend_app)
    record = room.get(f"/jobs/{job['id']}").json
    assert record["world_size"] == 2 and record["shadows"]["2"]["of"] == 1
    a, b = np.linspace(-1, 1, 300), np.linspace(2, -2, 300)
    first = put(shadow, job, 0, [9.0] * 300)  # first in, and far off: it must not count
    assert first.status_code == 201 and first.json["waiting_for"] == [0, 1], first.json
    assert put(r0, job, 0, a).status_code == 201
    done = put(r1, job, 0, b)
    assert done.status_code == 201 and done.json["ready"] and done.json["members"] == [0, 1], done.json
    average = codec.decode(r0.get(f"/jobs/{job['id']}/diloco/rounds/0").data)
    assert np.allclose(average, (a + b) / 2)  # the shadow's nines are not in it
    assert shadow.get(f"/jobs/{job['id']}/diloco/rounds/0").status_code == 200  # it stays in step


def test_identical_uploads_agree_and_name_nobody(backend_app):
    room, job, (r0, r1, shadow) = shadowed(backend_app)
    a, b = np.linspace(-1, 1, 300), np.linspace(2, -2, 300)
    for n in range(2):
        assert put(r0, job, n, a).status_code == 201
        assert put(r1, job, n, b).status_code == 201  # averaged: its shadow comes later
        assert put(shadow, job, n, b).status_code == 201
    record = room.get(f"/jobs/{job['id']}").json
    assert record["shadows"]["2"]["agreed"] == [0, 1] and record["shadows"]["2"]["disagreed"] == {}
    assert record["suspects"] == {}
    for n in range(2):
        line = f"diloco spot check, round {n}: rank 1 and its shadow(s) agree (shadow rank 2: identical bytes)"
        assert line in logs(room, job), logs(room, job)
    left = {(a["round"], a["rank"]) for a in backend_app.extensions["zwdx"].store.list_artifacts(job["id"], "pseudo_gradient")}
    assert left == set()  # compared, then deleted


def test_a_disagreement_with_no_third_opinion_names_both_with_the_round_and_distance(backend_app):
    room, job, (r0, r1, shadow) = shadowed(backend_app)
    a, b = np.linspace(-1, 1, 300), np.linspace(2, -2, 300)
    assert put(shadow, job, 0, b).status_code == 201
    assert put(r0, job, 0, a).status_code == 201
    assert put(r1, job, 0, b + 1e-3).status_code == 201  # the same length, other values
    record = room.get(f"/jobs/{job['id']}").json
    assert sorted(record["suspects"]) == ["1", "2"], record["suspects"]
    reason = record["suspects"]["1"]["reason"]
    assert reason.startswith("spot check, round 0: disagreed with its shadow (relative distance ") and \
        "cannot be told" in reason
    assert record["suspects"]["1"]["rounds"] == [0]
    assert any("rank 1 (gpu client" in t and "is a suspect: spot check, round 0" in t and "cannot be told, in round 0;"
               in t for t in logs(room, job)), logs(room, job)
    assert record["shadows"]["2"]["disagreed"].keys() == {"0"} and record["shadows"]["2"]["gone"] == "named a suspect"
    assert record["ranks"]["1"]["status"] == "dropped" and record["status"] in ("starting", "running")


def test_a_worker_the_rounds_robust_rule_flags_is_named_alone_by_its_one_disagreeing_shadow(backend_app):
    # rule 4 of zwdx.verify.decide with the flag the round's robust rule itself raised (zwdx.robust)
    room, job, (r0, r1, r2, shadow) = shadowed(backend_app, verify=0.34, workers=3)
    a = np.linspace(-1, 1, 300)
    noise = np.random.default_rng(0).normal(0, 5, 300)  # about 40 times an honest norm
    assert put(shadow, job, 0, a * 0.9).status_code == 201  # the honest one
    assert put(r0, job, 0, a).status_code == 201
    assert put(r2, job, 0, a * 1.1).status_code == 201
    assert put(r1, job, 0, a * 0.9 + noise).status_code == 201
    record = room.get(f"/jobs/{job['id']}").json
    assert list(record["suspects"]) == ["1"], record["suspects"]
    reason = record["suspects"]["1"]["reason"]
    assert reason.startswith("spot check, round 0: disagreed with its shadow") and "robust rule" in reason, reason
    assert list(record["shadows"]["3"]["disagreed"]) == ["0"] and record["shadows"]["3"].get("gone") is None
    assert record["ranks"]["1"]["status"] == "dropped"


def test_a_shadow_that_fails_is_noted_and_the_job_goes_on(backend_app):
    room, job, (r0, r1, shadow) = shadowed(backend_app)
    said = shadow.post(f"/jobs/{job['id']}/ranks/2", json={"status": "failed", "error": "boom", "traceback": "tb"})
    assert said.status_code == 200 and said.json["ok"], said.json
    record = room.get(f"/jobs/{job['id']}").json
    assert record["shadows"]["2"]["gone"] == "it failed: boom"
    assert record["failures"] == {} and record["failing_since"] is None and record["status"] in ("starting", "running")
    assert any("shadow rank 2 (of rank 1" in t and "the job goes on without it" in t for t in logs(room, job))
    assert put(shadow, job, 0, [1.0] * 300).status_code == 409  # gone: no more uploads
    for r in (r0, r1):
        assert r.post(f"/jobs/{job['id']}/ranks/{0 if r is r0 else 1}", json={"status": "running"}).status_code == 200


def test_a_shadow_behind_catches_up_on_what_the_server_kept_for_it(backend_app):
    room, job, (r0, r1, shadow) = shadowed(backend_app)
    a, b = np.linspace(-1, 1, 300), np.linspace(2, -2, 300)
    for n in range(4):  # the workers run four rounds before their shadow starts
        assert put(r0, job, n, a * (n + 1)).status_code == 201
        assert put(r1, job, n, b * (n + 1)).status_code == 201
    for n in range(4):
        assert put(shadow, job, n, b * (n + 1)).status_code == 201
        assert shadow.get(f"/jobs/{job['id']}/diloco/rounds/{n}").status_code == 200  # kept for it
    assert r0.get(f"/jobs/{job['id']}/diloco/rounds/0").status_code == 200
    record = room.get(f"/jobs/{job['id']}").json
    assert record["shadows"]["2"]["agreed"] == [0, 1, 2, 3] and record["shadows"]["2"]["round"] == 3
    store = backend_app.extensions["zwdx"].store
    assert store.list_artifacts(job["id"], "pseudo_gradient") == []
    assert put(r0, job, 4, a).status_code == 201 and put(r1, job, 4, b).status_code == 201
    assert sorted(x["round"] for x in store.list_artifacts(job["id"], "outer_gradient")) == [3, 4]  # caught up: swept


def test_the_placement_puts_a_shadow_on_another_donor_token_than_its_worker(app):
    from zwdx.server.placement import shadows as placing
    room = Api(app.test_client()).create_room("verify-placement")
    job = room.submit(parallelism="DILOCO", world_size=2, diloco={"verify": 1.0}).json
    record = app.extensions["zwdx"].store.get_job(job["id"])
    assert placing.extra(record) == 2
    asked = {"spec": record.spec.model_dump(mode="json"), "status": "resuming", "world_size": 2}
    assert placing.asked(record, asked)["spec"]["resources"]["world_size"] == 4
    assert placing.asked(record, asked)["world_size"] == 4  # a resuming job is planned from it
    clients = {"a": {"token_id": "t1"}, "b": {"token_id": "t2"}, "c": {"token_id": "t1"}, "d": {"token_id": "t2"}}
    chosen = [{"client_id": c, "index": 0} for c in "abcd"]
    for seed in range(10):  # workers on a (t1) and b (t2): each shadow on the other token
        assert placing.arrange(record, chosen, clients, random.Random(seed)) == (chosen, {2: 1, 3: 0})
    fewer = placing.arrange(record, chosen[:3], clients)  # resuming on three: the most workers whose shadows fit
    assert fewer == (chosen[:3], {1: 0, 2: 0})
    assert placing.arrange(record, chosen[:2], clients) == (chosen[:2], {1: 0})  # two: one worker, its shadow


def test_two_shadows_are_compared_once_both_are_in_however_late_the_second(backend_app):
    room, job, (r0, r1, early, late) = shadowed(backend_app, verify=1.0, of={2: 1, 3: 1})
    a, b = np.linspace(-1, 1, 300), np.linspace(2, -2, 300)
    for n in range(4):
        assert put(r0, job, n, a).status_code == 201
        assert put(early, job, n, b * 3 if n == 2 else b).status_code == 201  # it lies in round 2
        assert put(r1, job, n, b).status_code == 201
    assert room.get(f"/jobs/{job['id']}").json["shadows"]["2"]["agreed"] == []  # the other is not in yet
    for n in range(4):
        assert put(late, job, n, b).status_code == 201
    record = room.get(f"/jobs/{job['id']}").json
    assert record["shadows"]["3"]["agreed"] == [0, 1, 2, 3]
    assert record["shadows"]["2"]["agreed"] == [0, 1] and list(record["shadows"]["2"]["disagreed"]) == ["2"]
    assert list(record["suspects"]) == ["2"] and "another shadow confirmed" in record["suspects"]["2"]["reason"]


def test_among_server_processes_a_shadows_comparison_takes_the_rounds_lease(app, monkeypatch, caplog):
    from zwdx.server import diloco
    room, job, (r0, r1, shadow) = shadowed(app)
    ctx = app.extensions["zwdx"]
    monkeypatch.setattr(ctx.lease, "shared", True)
    a, b = np.linspace(-1, 1, 300), np.linspace(2, -2, 300)
    assert put(r0, job, 0, a).status_code == 201 and put(r1, job, 0, b).status_code == 201
    assert put(shadow, job, 0, b).status_code == 201
    assert ctx.store.lease_holder(f"diloco:{job['id']}:0") is None  # taken and given back
    assert room.get(f"/jobs/{job['id']}").json["shadows"]["2"]["agreed"] == [0]
    assert put(r0, job, 1, a).status_code == 201 and put(r1, job, 1, b).status_code == 201
    assert ctx.store.take_lease(f"diloco:{job['id']}:1", "another-server", 60)
    clock = itertools.count(0, 5)  # each look at the clock 5 s on: the 10 s wait is over at once
    monkeypatch.setattr(diloco.time, "time", lambda: float(next(clock)))
    monkeypatch.setattr(diloco.time, "sleep", lambda s: None)
    assert put(shadow, job, 1, b).status_code == 201  # another process holds the round: not compared, no error
    assert room.get(f"/jobs/{job['id']}").json["shadows"]["2"]["agreed"] == [0]
    assert "round 1's spot check of shadow rank 2 skipped (its lease is held)" in caplog.text


def test_zwdx_jobs_show_says_what_each_shadow_found():
    from zwdx.job_text import shadow_lines
    job = {"shadows": {"3": {"of": 1, "client_id": "c", "agreed": [0, 1], "disagreed": {}},
                       "2": {"of": 0, "client_id": "b", "agreed": [0], "disagreed": {"1": "relative distance 0.5"},
                             "gone": "named a suspect"}}}
    assert shadow_lines(job) == [
        "SHADOW: rank 2 runs rank 0 again (gpu client b): agreed in 1 round(s), disagreed in round(s) 1; gone: named a "
        "suspect",
        "SHADOW: rank 3 runs rank 1 again (gpu client c): agreed in 2 round(s)"]
    assert shadow_lines({}) == []
