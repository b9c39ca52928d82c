"""FSDP's step checks, the server's side (issue 33, ``verify`` for FSDP): the same as DDP's
(test_trust_step_check.py), keyed on the mode: the submit refuses FSDP+TP with ``verify`` and
``verify`` without a world size, naming the field; the placement makes ceil(verify * W) shadows,
lets the slots past them go, and tells each whom it shadows; the check a strict majority of the
attempt's ranks gave names its suspects and places the job again; a shadow lost is any rank's.
The ranks' side: test_fsdp_check.py."""
from __future__ import annotations

import random

import pytest

from conftest import Api
from store_backends import *  # noqa: F401,F403  (fixtures: backend, mongo_uri, ...)
from test_mutants_scheduler import asked, assignments, job_of, register  # noqa: F401  (asked: a fixture)
from test_trust_step_check import LIAR, check, checked as checked_ddp, fail, settle, submit_ddp
from test_trust_verify import backend_app, logs  # noqa: F401  (backend_app: a fixture)


def submit_fsdp(api: Api, workers: int | None, verify: float, **strategy):
    return submit_ddp(api, workers, verify, "fsdp", strategy)


def checked(app, of: dict[int, int], workers: int = 2):
    """An FSDP job with ``verify`` 1 started as the scheduler starts it: workers, then shadows."""
    return checked_ddp(app, of, workers, kind="fsdp")


@pytest.mark.parametrize("workers, strategy, field, said", [
    (4, {"tp": {"size": 2}}, "verify", "step checks run with FSDP alone, not FSDP+TP"),
    (None, {}, "verify", "needs resources.world_size"),
], ids=["with-tp", "without-world-size"])
def test_an_fsdp_job_with_verify_that_cannot_be_checked_is_refused_naming_the_field(api, workers, strategy, field,
                                                                                    said):
    resp = submit_fsdp(api, workers, 1.0, **strategy)
    assert resp.status_code == 400, resp.json
    assert resp.json["error"]["field"] == field and said in resp.json["error"]["message"], resp.json


def test_an_fsdp_job_with_verify_gets_a_shadow_per_worker_and_each_shadow_is_told_whom(app, api, socket_client,
                                                                                        asked):
    ctx = app.extensions["zwdx"]
    socks = {cid: register(socket_client, api, cid, slots=2) for cid in "ab"}
    resp = submit_fsdp(api, 2, 1.0)
    assert resp.status_code == 201, resp.json
    job_id = resp.json["id"]
    assert ctx.scheduler.schedule_once() == 1
    job = job_of(api, job_id)
    assert job["status"] == "starting" and job["world_size"] == 2  # the workers; the shadows come on top
    assert {s: v["client_id"] for s, v in job["shadows"].items()} == {"2": "b", "3": "b"}
    assert sorted(v["of"] for v in job["shadows"].values()) == [0, 1]
    for sock in socks.values():
        sock.get_received("/gpu")
    asked[0][3]({"addr": "10.1.2.3", "port": 29555})
    assert ctx.scheduler.finish_placements() == 1
    [to_a], [to_b] = assignments(socks["a"]), assignments(socks["b"])
    assert to_a["world_size"] == to_b["world_size"] == 2
    assert [r["shadow_of"] for r in to_a["ranks"]] == [None, None]
    assert sorted(r["shadow_of"] for r in to_b["ranks"]) == [0, 1]


def test_an_fsdp_job_gets_exactly_its_count_of_shadows_however_many_slots_came(app):
    from zwdx.server.placement import shadows as placing
    api = Api(app.test_client()).create_room("fsdp-step-check-placement")
    record = app.extensions["zwdx"].store.get_job(submit_fsdp(api, 3, 0.5).json["id"])
    assert placing.extra(record) == 2  # ceil(0.5 * 3)
    clients = {c: {"token_id": c} for c in "abcdefg"}
    chosen = [{"client_id": c, "index": 0} for c in "abcdefg"]
    slots, of = placing.arrange(record, chosen, clients, random.Random(0))  # 4 + 2: the seventh is let go
    assert slots == chosen[:6] and sorted(of) == [4, 5]


def test_the_majoritys_check_names_its_ranks_and_the_fsdp_job_is_placed_again(backend_app):
    room_api, job, ranks = checked(backend_app, {2: 0, 3: 1})
    for rank in range(4):
        assert fail(ranks[rank], job, rank, check(5, LIAR)).json["ok"]
    settle(backend_app)
    record = room_api.get(f"/jobs/{job['id']}").json
    assert record["status"] == "resuming" and record["restarts"] == 1, record
    assert sorted(record["suspects"]) == ["1", "3"], record["suspects"]
    assert record["suspects"]["3"]["reason"] == f"step check, step 5, bucket 0: {LIAR[3]}"
    assert record["avoid"] == sorted([f"gpu-{job['id']}-1", f"gpu-{job['id']}-3"])
    # the job's log and its waiting reason say which mode's checks named them
    texts = logs(room_api, job)
    assert any(t.startswith(f"fsdp step check: rank 1 (gpu client gpu-{job['id']}-1) is a suspect") for t in texts), texts
    assert record["waiting_reason"].startswith("fsdp step check, step 5, bucket 0"), record["waiting_reason"]


def test_an_fsdp_shadows_lost_gpu_client_interrupts_the_job(backend_app):
    from zwdx.server import jobs
    room_api, job, ranks = checked(backend_app, {2: 1})
    with backend_app.app_context():
        jobs.client_lost(backend_app.extensions["zwdx"], f"gpu-{job['id']}-2", "no heartbeat")
    record = room_api.get(f"/jobs/{job['id']}").json
    assert record["status"] == "resuming" and record["restarts"] == 1, record
    assert record["shadows"]["2"].get("gone") is None  # not "noted, the job goes on": DILOCO's meaning
