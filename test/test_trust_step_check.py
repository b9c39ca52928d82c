"""DDP's step checks, the server's side (issue 33, ``verify`` for DDP; the design: the ranks'
shadows run in step with the job and every party reports the same ``StepCheck`` when a shadow
and its worker disagree), in process over both stores with fake rank reports: the placement
makes ceil(verify * W) shadows and tells each whom it shadows; the check a strict majority of the
attempt's ranks gave is believed, its named ranks are suspects and the job is placed again;
accounts that differ fail it, nobody named; a DDP shadow lost, exited or failed is like any
rank's. The ranks' side: test_step_check.py; DILOCO's shadows: test_trust_verify.py."""
from __future__ import annotations

import platform
import random


from conftest import Api
from store_backends import *  # noqa: F401,F403  (fixtures: backend, mongo_uri, ...)
from test_mutants_scheduler import asked, assignments, job_of, register  # noqa: F401  (asked: a fixture)
from test_trust_verify import backend_app, logs  # noqa: F401  (backend_app: a fixture)
from workloads import start_placed
from zwdx.protocol import ACTIVE, SlotKind
from zwdx.protocol.job import PlacementEntry


def submit_ddp(api: Api, workers: int | None, verify: float, kind: str = "ddp", strategy: dict | None = None,
               **resources):
    """A ``kind`` job (DDP, or FSDP: test_trust_fsdp_verify) with ``verify`` and ``strategy``'s
    other fields, on ``workers`` ranks (None: no world size)."""
    body = {"code": {"bundle_artifact": api.upload()["id"], "versions": {"python": platform.python_version()}},
            "strategy": {"type": kind, "verify": verify, **(strategy or {})},
            "resources": {**({} if workers is None else {"world_size": workers}), **resources}}
    return api.post("/jobs", json=body)


def checked(app, of: dict[int, int], workers: int = 2, verify: float = 1.0, kind: str = "ddp"):
    """A ``kind`` job of ``workers`` workers started as the scheduler starts one with ``verify``:
    the workers' ranks first, then the shadows' (``of``: shadow -> worker), each on a GPU client of
    its own. The room's Api, the job, each rank's Api (its key alone)."""
    room_api = Api(app.test_client()).create_room("step-check" if kind == "ddp" else f"{kind}-step-check")
    resp = submit_ddp(room_api, workers, verify, kind)
    assert resp.status_code == 201, resp.json
    job = resp.json
    return room_api, job, start_placed(app, room_api, job, workers + len(of), shadows=of, tokens=True)


def check(step: int, named: dict[int, str], bucket: int = 0, distances: dict | None = None) -> dict:
    return {"step": step, "bucket": bucket, "named": {str(r): why for r, why in named.items()},
            "distances": distances or {"0": {"1": 0.25}}}


def fail(rank_api: Api, job: dict, rank: int, account: dict | None):
    body = {"status": "failed", "error": "StepCheckFailed", "traceback": "tb"}
    return rank_api.post(f"/jobs/{job['id']}/ranks/{rank}", json={**body, "check": account} if account else body)


def settle(app) -> None:
    from zwdx.server import jobs
    ctx = app.extensions["zwdx"]
    with app.app_context():
        for room_id in ctx.store.job_rooms(ACTIVE):
            jobs.settle_suspects(ctx, room_id)


LIAR = {1: "disagreed with its shadow (relative distance 0.25); which one lies cannot be told",
        3: "disagreed with the worker it shadows (rank 1, relative distance 0.25); which one lies cannot be told"}


# -- placement -------------------------------------------------------------------------------------
def test_a_ddp_job_with_verify_gets_a_shadow_per_worker_and_each_shadow_is_told_whom(app, api, socket_client, asked):
    ctx = app.extensions["zwdx"]
    socks = {cid: register(socket_client, api, cid, slots=2) for cid in "ab"}
    resp = submit_ddp(api, 2, 1.0)
    assert resp.status_code == 201, resp.json
    job_id = resp.json["id"]
    assert ctx.scheduler.schedule_once() == 1
    job = job_of(api, job_id)
    assert job["status"] == "starting" and job["world_size"] == 2  # the workers; the shadows come on top
    assert [(p["rank"], p["client_id"]) for p in job["placement"]] == [(0, "a"), (1, "a"), (2, "b"), (3, "b")]
    assert {s: (v["of"], v["client_id"]) for s, v in job["shadows"].items()} == {"2": (0, "b"), "3": (1, "b")}
    for sock in socks.values():
        sock.get_received("/gpu")
    asked[0][3]({"addr": "10.1.2.3", "port": 29555})
    assert ctx.scheduler.finish_placements() == 1
    [to_a], [to_b] = assignments(socks["a"]), assignments(socks["b"])
    assert to_a["world_size"] == to_b["world_size"] == 2
    assert [(r["rank"], r["shadow_of"]) for r in to_a["ranks"]] == [(0, None), (1, None)]
    assert [(r["rank"], r["shadow_of"]) for r in to_b["ranks"]] == [(2, 0), (3, 1)]


def test_the_named_ranks_gpu_clients_are_left_out_when_the_job_is_placed_again(app, api, socket_client, asked):
    from zwdx.server import jobs
    ctx = app.extensions["zwdx"]
    for cid in "abcd":
        register(socket_client, api, cid)
    job_id = submit_ddp(api, 1, 1.0).json["id"]
    assert ctx.scheduler.schedule_once() == 1
    request = ctx.scheduler._asked[job_id]
    first = {p["rank"]: p["client_id"] for p in job_of(api, job_id)["placement"]}
    asked[0][3]({"addr": "10.1.2.3", "port": 29555})
    assert ctx.scheduler.finish_placements() == 1
    both = check(0, {0: "disagreed with its shadow", 1: "disagreed with the worker it shadows (rank 0)"})
    for rank, key in request.rank_keys.items():
        assert fail(api.as_(None, rank_key=key), {"id": job_id}, rank, both).json["ok"]
    settle(app)
    for rank, client in first.items():  # their GPU clients say the ranks exited
        with app.app_context():
            jobs.ranks_exited(ctx, client, job_id, {str(rank): 1}, 0)
    assert ctx.scheduler.schedule_once() == 1
    job = job_of(api, job_id)
    assert job["status"] == "starting" and job["attempt"] == 1 and job["world_size"] == 1, job
    assert sorted(job["avoid"]) == sorted(first.values())
    assert {p["client_id"] for p in job["placement"]}.isdisjoint(first.values()) and len(job["shadows"]) == 1


def test_ranks_named_again_in_a_later_attempt_keep_the_earlier_suspects(app, api, socket_client, asked):
    """Rank 0 and its shadow named in attempt 0, and the GPU clients of attempt 1 at the same ranks
    named too: four suspects, none overwritten, each with its rank and attempt, in the SDK's
    result, ``zwdx jobs show`` and ``zwdx room clients``."""
    from zwdx.job_text import suspect_lines
    from zwdx.sdk.results import result_of
    from zwdx.server import jobs
    ctx = app.extensions["zwdx"]
    for cid in "abcd":
        register(socket_client, api, cid)
    job_id = submit_ddp(api, 1, 1.0).json["id"]
    both = check(0, {0: "disagreed with its shadow", 1: "disagreed with the worker it shadows (rank 0)"})
    clients = []
    for attempt in (0, 1):
        assert ctx.scheduler.schedule_once() == 1
        request = ctx.scheduler._asked[job_id]
        placed = {p["rank"]: p["client_id"] for p in job_of(api, job_id)["placement"]}
        clients.append(placed)
        asked[attempt][3]({"addr": "10.1.2.3", "port": 29555})
        assert ctx.scheduler.finish_placements() == 1
        for rank, key in request.rank_keys.items():
            assert fail(api.as_(None, rank_key=key), {"id": job_id}, rank, both).json["ok"]
        settle(app)
        for rank, client in placed.items():
            with app.app_context():
                jobs.ranks_exited(ctx, client, job_id, {str(rank): 1}, attempt)
    job = job_of(api, job_id)
    assert {k: (s["rank"], s["attempt"], s["client_id"]) for k, s in job["suspects"].items()} == {
        "0": (0, 0, clients[0][0]), "1": (1, 0, clients[0][1]), "0@1": (0, 1, clients[1][0]),
        "1@1": (1, 1, clients[1][1])}
    assert len({s["client_id"] for s in job["suspects"].values()}) == 4
    result = result_of(job, raise_on_failure=False)
    assert [(s["attempt"], s["rank"], s["client_id"]) for s in result["suspects"]] == [
        (0, 0, clients[0][0]), (0, 1, clients[0][1]), (1, 0, clients[1][0]), (1, 1, clients[1][1])]
    lines = suspect_lines(job)
    assert len(lines) == 4 and lines[2].startswith(f"SUSPECT: rank 0 (gpu client {clients[1][0]}), at the end, attempt 1")
    listed = {c["id"]: c["suspected_in"] for c in api.get("/room").json["clients"]}
    assert all(listed[c] == [job_id] for c in "abcd"), listed


def test_a_ddp_job_gets_exactly_its_count_of_shadows_however_many_slots_came(app):
    from zwdx.server.placement import shadows as placing
    api = Api(app.test_client()).create_room("step-check-placement")
    job = submit_ddp(api, 3, 0.5, ).json
    record = app.extensions["zwdx"].store.get_job(job["id"])
    assert placing.extra(record) == 2  # ceil(0.5 * 3)
    asked_for = placing.asked(record, {"spec": record.spec.model_dump(mode="json"), "status": "queued",
                                       "world_size": None})
    assert asked_for["spec"]["resources"]["world_size"] == 5
    clients = {c: {"token_id": c} for c in "abcdefg"}
    chosen = [{"client_id": c, "index": 0} for c in "abcdefg"]
    # seven slots (an elastic job's plan may bring more): 4 workers would need 6, so 4 + ceil(0.5 * 4);
    # a DDP job's ranks count their shadows from the workers, so the seventh slot is let go
    slots, of = placing.arrange(record, chosen, clients, random.Random(0))
    assert slots == chosen[:6] and sorted(of) == [4, 5] and len(set(of.values())) == 2
    slots, of = placing.arrange(record, chosen[:5], clients, random.Random(0))
    assert slots == chosen[:5] and sorted(of) == [3, 4]


# -- the checks' verdict ---------------------------------------------------------------------------
def test_the_majoritys_check_names_its_ranks_and_the_job_is_placed_again(backend_app):
    room_api, job, ranks = checked(backend_app, {2: 0, 3: 1})
    liar = {0: "disagreed with its shadow ...", 2: "disagreed with the worker it shadows (rank 0) ..."}
    assert fail(ranks[3], job, 3, check(5, liar)).json["ok"]  # rank 3, the liar, first, blames the others
    for rank in (0, 1, 2):  # the same account, whatever the order of its names
        assert fail(ranks[rank], job, rank, check(5, dict(reversed(LIAR.items())) if rank else LIAR)).json["ok"]
    settle(backend_app)
    record = room_api.get(f"/jobs/{job['id']}").json
    assert record["status"] == "resuming" and record["restarts"] == 1, record
    assert sorted(record["suspects"]) == ["1", "3"], record["suspects"]
    assert record["suspects"]["3"]["reason"] == f"step check, step 5, bucket 0: {LIAR[3]}"
    assert record["suspects"]["1"]["client_id"] == f"gpu-{job['id']}-1" and record["suspects"]["1"]["rounds"] == []
    assert record["avoid"] == sorted([f"gpu-{job['id']}-1", f"gpu-{job['id']}-3"])
    assert "ddp step check, step 5, bucket 0" in record["waiting_reason"] and "rank(s) 1, 3 named" in \
        record["waiting_reason"]
    texts = logs(room_api, job)
    said = f"ddp step check: rank 1 (gpu client gpu-{job['id']}-1) is a suspect: step check, step 5, bucket 0: "
    assert any(t.startswith(said)
               and "its client is not given this job again; `zwdx room tokens revoke tok-1`" in t for t in texts), texts
    assert not any(t.startswith("diloco") for t in texts)


def test_the_attempt_settles_once_the_shadows_gave_their_accounts_too(backend_app):
    room_api, job, ranks = checked(backend_app, {2: 0, 3: 1})
    for rank in (0, 1):
        assert fail(ranks[rank], job, rank, check(5, LIAR)).json["ok"]
    settle(backend_app)  # the workers alone are no majority of the four: the shadows are waited for
    assert room_api.get(f"/jobs/{job['id']}").json["status"] in ("starting", "running")
    for rank in (2, 3):
        assert fail(ranks[rank], job, rank, check(5, LIAR)).json["ok"]
    settle(backend_app)
    record = room_api.get(f"/jobs/{job['id']}").json
    assert record["status"] == "resuming" and sorted(record["suspects"]) == ["1", "3"], record


def test_accounts_that_differ_fail_the_job_and_name_nobody(backend_app):
    room_api, job, ranks = checked(backend_app, {1: 0}, workers=1)
    assert fail(ranks[0], job, 0, check(2, {0: "it", 1: "it"})).json["ok"]
    assert fail(ranks[1], job, 1, check(2, {0: "it"})).json["ok"]
    settle(backend_app)
    record = room_api.get(f"/jobs/{job['id']}").json
    assert record["status"] == "failed" and record["suspects"] == {} and record["avoid"] == [], record
    assert "the ranks' accounts of the step check differ" in record["reason"] and "nobody is named" in \
        record["reason"], record["reason"]


def test_accounts_of_the_weights_and_of_the_gradients_are_not_the_same_account(backend_app):
    """The same step, bucket and names, but one says the weights disagreed and the other the
    gradients: two accounts, neither a majority's (rules.step_verdict keys on ``what`` too)."""
    room_api, job, ranks = checked(backend_app, {1: 0}, workers=1)
    assert fail(ranks[0], job, 0, {**check(2, {0: "it"}), "what": "weights"}).json["ok"]
    assert fail(ranks[1], job, 1, check(2, {0: "it"})).json["ok"]
    settle(backend_app)
    record = room_api.get(f"/jobs/{job['id']}").json
    assert record["status"] == "failed" and record["suspects"] == {}, record


def earlier(app, job: dict, seconds: float) -> None:
    """The job's first failure came ``seconds`` earlier than it did."""
    store = app.extensions["zwdx"].store
    assert store.set_job(job["id"], {"failing_since": store.get_job(job["id"]).failing_since - seconds})


def test_a_lone_account_while_the_others_train_names_nobody(backend_app):
    from zwdx import defaults
    from zwdx.server.jobs import FAILURE_GRACE
    room_api, job, ranks = checked(backend_app, {2: 0, 3: 1})
    assert fail(ranks[3], job, 3, check(5, {0: "it lies"})).json["ok"]  # the others never stopped
    earlier(backend_app, job, FAILURE_GRACE + 1)
    settle(backend_app)  # a step check's accounts are waited for longer than another failure's
    assert room_api.get(f"/jobs/{job['id']}").json["status"] in ("starting", "running")
    earlier(backend_app, job, defaults.CLIENT_TIMEOUT)  # CLIENT_TIMEOUT is over
    settle(backend_app)
    record = room_api.get(f"/jobs/{job['id']}").json
    assert record["status"] == "failed" and record["suspects"] == {} and record["avoid"] == [], record
    assert "none is a strict majority's of the 4 ranks" in record["reason"], record["reason"]


def test_a_check_that_names_a_rank_not_of_the_attempt_is_refused(backend_app):
    room_api, job, ranks = checked(backend_app, {2: 0, 3: 1})
    for stranger in ({4: "a stranger"}, {1: "x", 17: "y"}):
        said = fail(ranks[0], job, 0, check(1, stranger))
        assert said.status_code == 400 and said.json["error"]["field"] == "check", said.json
    said = fail(ranks[0], job, 0, {**check(1, {1: "x"}), "distances": {"1": {"9": 0.5}}})
    assert said.status_code == 400, said.json
    record = room_api.get(f"/jobs/{job['id']}").json
    assert record["failures"] == {} and record["failing_since"] is None


def test_a_check_from_a_job_without_verify_is_ignored(backend_app, caplog):
    from zwdx.server.auth import hash_secret
    from zwdx.server.jobs import Job
    store = backend_app.extensions["zwdx"].store
    room_api = Api(backend_app.test_client()).create_room("no-verify")
    job = room_api.submit(world_size=1).json
    store.upsert_client({"id": "g", "room_id": room_api.room["id"], "hostname": "h", "status": "online"},
                        [{"id": "g:0", "client_id": "g", "room_id": room_api.room["id"], "index": 0, "kind": "cpu"}])
    assert Job.load(store, job["id"]).start([PlacementEntry(rank=0, client_id="g", gpu_index=0, kind=SlotKind.CPU)],
                                            ["g:0"], {0: hash_secret("rk_x_0")})
    assert fail(room_api.as_(None, rank_key="rk_x_0"), job, 0, check(1, {0: "me"}, distances={"0": {"0": 0.5}})).json["ok"]
    assert store.get_job(job["id"]).failures["0"].check is None
    assert "reported a step check, but the job's steps are not checked: ignored" in caplog.text
    settle(backend_app)
    record = room_api.get(f"/jobs/{job['id']}").json
    assert record["status"] == "failed" and record["suspects"] == {} and "rank 0 failed" in record["reason"]


# -- a DDP shadow is a rank like any ---------------------------------------------------------------
def test_a_ddp_shadows_lost_gpu_client_interrupts_the_job(backend_app):
    from zwdx.server import jobs
    room_api, job, ranks = checked(backend_app, {2: 1})
    ctx = backend_app.extensions["zwdx"]
    with backend_app.app_context():
        jobs.client_lost(ctx, f"gpu-{job['id']}-2", "no heartbeat")
    record = room_api.get(f"/jobs/{job['id']}").json
    assert record["status"] == "resuming" and record["restarts"] == 1, record
    assert record["shadows"]["2"].get("gone") is None  # not "noted, the job goes on": DILOCO's meaning


def test_a_ddp_shadows_failure_and_bad_exit_are_any_ranks(backend_app):
    from zwdx.server import jobs
    room_api, job, ranks = checked(backend_app, {2: 1})
    ctx = backend_app.extensions["zwdx"]
    said = ranks[2].post(f"/jobs/{job['id']}/ranks/2", json={"status": "failed", "error": "boom", "traceback": "tb",
                                                             "collective": True})
    assert said.json == {"ok": True}, said.json
    record = room_api.get(f"/jobs/{job['id']}").json
    assert record["suspect_since"] is not None and "2" in record["failures"] and record["shadows"]["2"].get("gone") is None
    with backend_app.app_context():
        jobs.ranks_exited(ctx, f"gpu-{job['id']}-2", job["id"], {"2": 1}, 0)
        for r in (0, 1):  # the workers lost their peer, and exited
            jobs.ranks_exited(ctx, f"gpu-{job['id']}-{r}", job["id"], {str(r): 1}, 0)
    settle(backend_app)
    record = room_api.get(f"/jobs/{job['id']}").json
    assert record["status"] == "failed", record  # every rank heard, no GPU client lost


def test_a_ddp_shadows_exit_before_a_word_makes_the_job_suspect(backend_app):
    from zwdx.server import jobs
    room_api, job, ranks = checked(backend_app, {2: 1})
    with backend_app.app_context():
        jobs.ranks_exited(backend_app.extensions["zwdx"], f"gpu-{job['id']}-2", job["id"], {"2": -9}, 0)
    record = room_api.get(f"/jobs/{job['id']}").json
    assert record["suspect_since"] is not None and "rank 2 exit code -9" in record["suspect_reason"], record
    assert record["shadows"]["2"].get("gone") is None


def test_the_job_completes_when_its_workers_do_and_a_shadows_reports_are_not_its(backend_app):
    room_api, job, ranks = checked(backend_app, {2: 1})
    for r in (0, 1, 2):
        assert ranks[r].post(f"/jobs/{job['id']}/ranks/{r}", json={"status": "running"}).status_code == 200
    said = ranks[2].post(f"/jobs/{job['id']}/ranks/2", json={"status": "completed", "final_loss": 9.0})
    assert said.json["ignored"] == "rank 2 is a shadow: what it reports is not the job's"
    assert room_api.get(f"/jobs/{job['id']}").json["status"] == "running"
    for r in (0, 1):
        assert ranks[r].post(f"/jobs/{job['id']}/ranks/{r}", json={"status": "completed", "final_loss": 0.5}).json["ok"]
    record = room_api.get(f"/jobs/{job['id']}").json
    assert record["status"] == "completed" and record["final_loss"] == 0.5 and "2" not in record["ranks"], record


def test_the_shadows_fingerprints_make_the_majority_that_names_a_rank_whose_weights_are_not_theirs(backend_app):
    """Two ranks that disagree on their final weights leave no majority alone; their shadows,
    which report theirs first (``Checked.report_end``), make one: the odd rank is a suspect and
    the weights that came back (rank 0's, the majority's) bring no warning. A shadow's report
    after the job is over is refused and changes nothing."""
    from safetensors.torch import save

    from test_fingerprints import STATES, digest
    room_api, job, ranks = checked(backend_app, {2: 0, 3: 1})
    for r in range(4):
        assert ranks[r].post(f"/jobs/{job['id']}/ranks/{r}", json={"status": "running"}).status_code == 200
    for r in (2, 3):
        said = ranks[r].post(f"/jobs/{job['id']}/ranks/{r}", json={"status": "completed", "fingerprint": digest("a")})
        assert "its fingerprint is kept for the weights check" in said.json["ignored"], said.json
    weights = ranks[0].put(f"/jobs/{job['id']}/weights", data=save(STATES["a"])).json["id"]
    assert ranks[1].post(f"/jobs/{job['id']}/ranks/1", json={"status": "completed", "fingerprint": digest("b")}).json["ok"]
    assert ranks[0].post(f"/jobs/{job['id']}/ranks/0", json={"status": "completed", "fingerprint": digest("a"),
                                                             "weights_artifact": weights}).json["ok"]
    record = room_api.get(f"/jobs/{job['id']}").json
    assert record["status"] == "completed" and record["shadows"]["3"]["fingerprint"] == digest("a")
    assert set(record["suspects"]) == {"1"}, record["suspects"]
    assert "not those of rank(s) 0, 2, 3 (the majority)" in record["suspects"]["1"]["reason"]
    assert len(record["warnings"]) == 1 and "do not trust" not in record["warnings"][0]  # the ranks differ; no more
    late = ranks[2].post(f"/jobs/{job['id']}/ranks/2", json={"status": "completed", "fingerprint": digest("c")})
    assert late.status_code == 403, late.json  # the job is over: its keys say nothing more
    assert room_api.get(f"/jobs/{job['id']}").json["shadows"]["2"]["fingerprint"] == digest("a")


def test_zwdx_jobs_show_says_a_ddp_shadow_is_checked_at_every_step():
    from zwdx.job_text import shadow_lines
    job = {"spec": {"strategy": {"type": "ddp", "verify": 0.5}}, "shadows": {"2": {"of": 1, "client_id": "c"}}}
    assert shadow_lines(job) == ["SHADOW: rank 2 runs rank 1 again (gpu client c): its gradients checked against "
                                 "the worker's at every step"]
