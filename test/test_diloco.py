"""DILOCO, in-process: the pseudo-gradients' codec (its error bound), the settings checked at
the edge, and the server's rounds (uploads with rank keys, one average, what is refused and
what is collected). The whole mode across network namespaces: test_diloco_netns.py."""
from __future__ import annotations

import hashlib
import io

import numpy as np
import pytest

from conftest import Api
from procs import SLACK, wait_until
from earlier_form import earlier_form
from workloads import start_placed
from zwdx import ZWDX, codec, defaults
from zwdx.errors import BadRequest

P = defaults.API_PREFIX


# -- the codec ------------------------------------------------------------------------------------
@pytest.mark.parametrize("numel", [0, 1, 4095, 4096, 4097, codec.FRAME + 3])
def test_int8_decodes_each_value_within_half_a_scale_of_its_block(numel):
    rng = np.random.default_rng(numel)
    values = (rng.standard_normal(numel) * rng.uniform(1e-4, 10, numel)).astype(np.float32)
    values[:7] = 0  # a block of zeros has scale 0
    data = codec.encode(values, "int8")
    assert len(data) == codec.Layout("int8", numel).size()
    assert len(data) < numel * 4 * 0.26 + 100  # about a quarter of float32
    decoded = codec.decode(data)
    for start in range(0, numel, codec.BLOCK):
        block, back = values[start:start + codec.BLOCK], decoded[start:start + codec.BLOCK]
        bound = np.abs(block).max() / 254 * (1 + 1e-6)
        assert np.abs(back - block).max() <= bound


def test_fp16_and_none_keep_what_they_promise():
    values = np.random.default_rng(1).standard_normal(10_000).astype(np.float32)
    assert np.array_equal(codec.decode(codec.encode(values, "none")), values)
    half = codec.decode(codec.encode(values, "fp16"))
    assert np.allclose(half, values, rtol=1e-3, atol=1e-4) and not np.array_equal(half, values)
    assert len(codec.encode(values, "fp16")) < len(codec.encode(values, "none")) / 1.9


def test_the_average_is_the_mean_of_the_uploads_in_their_compression():
    rng = np.random.default_rng(2)
    a, b = rng.standard_normal(9000).astype(np.float32), rng.standard_normal(9000).astype(np.float32)
    empty = codec.encode(np.zeros(0, np.float32), "int8")  # a worker with nothing to add
    layout, members, chunks = codec.average({0: io.BytesIO(codec.encode(a, "int8")),
                                             1: io.BytesIO(codec.encode(b, "int8")), 2: io.BytesIO(empty)})
    assert members == [0, 1] and layout.compression == "int8"
    mean = codec.decode(b"".join(chunks))
    assert np.abs(mean - (a + b) / 2).max() <= 2 * max(np.abs(a).max(), np.abs(b).max()) / 254


@pytest.mark.parametrize("compression", codec.COMPRESSIONS)
def test_the_average_is_the_mean_past_the_first_frame_in_every_compression(compression):
    # several frames (codec.FRAME values each) and a short last one: what a model past ~1 M parameters sends
    numel = 2 * codec.FRAME + codec.BLOCK + 5
    rng = np.random.default_rng(7)
    uploads = [codec.encode((rng.standard_normal(numel) * (i + 1)).astype(np.float32), compression) for i in range(3)]
    layout, members, chunks = codec.average({i: io.BytesIO(data) for i, data in enumerate(uploads)})
    assert members == [0, 1, 2] and (layout.compression, layout.numel) == (compression, numel)
    mean = codec.decode(b"".join(chunks))
    exact = np.mean([codec.decode(data).astype(np.float64) for data in uploads], axis=0)
    # the mean of what was sent, within the compression's own rounding of the result
    tolerance = {"none": 1e-6, "fp16": 2e-3, "int8": None}[compression]
    for start in range(0, numel, codec.FRAME):
        part, want = mean[start:start + codec.FRAME], exact[start:start + codec.FRAME]
        bound = tolerance * np.abs(want).max() if tolerance else np.abs(want).max() / 254 * 1.01
        assert np.abs(part - want).max() <= bound, f"frame at {start}: off by {np.abs(part - want).max()}"


@pytest.mark.parametrize("data, says", [
    (b"", "ends within the header"), (b"NOTZWDX!\x00\x00\x00\x00", "first bytes"),
    (codec.MAGIC + b"\x05\x00\x00\x00[1,2]", "must be {"),
    (codec.Layout("int4", 3).header(), "compression must be"),
    (codec.encode(np.ones(100, np.float32), "int8")[:-1], "ends within values"),
    (codec.encode(np.ones(100, np.float32), "fp16") + b"x", "more bytes"),
    (codec.encode(np.array([1.0, np.inf], np.float32), "none"), "NaN or infinite")])
def test_bytes_that_are_not_a_pseudo_gradient_are_refused_saying_why(data, says):
    with pytest.raises(codec.CodecError, match=says):
        codec.check(io.BytesIO(data))


# -- the settings, at the edge --------------------------------------------------------------------
def test_a_diloco_job_takes_the_papers_defaults_unless_told_otherwise(api):
    job = api.submit(parallelism="diloco").json
    assert job["spec"]["parallelism"] == "DILOCO"
    assert job["spec"]["strategy"] == {"type": "diloco", "inner_steps": 500, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True,
                                     "compression": "int8", "round_timeout": None, "overlap": False, "all_reduce": True,
                                     "ranks_per_worker": 1, "aggregate": "robust", "trim": None, "suspect_after": 5,
                                     "verify": 0.0, "verify_tolerance": 0.0}
    job = api.submit(parallelism="DILOCO", diloco={"inner_steps": 50, "compression": "fp16", "outer_momentum": 0}).json
    assert job["spec"]["strategy"] == {"type": "diloco", "inner_steps": 50, "outer_lr": 0.7, "outer_momentum": 0.0, "nesterov": False,
                                     "compression": "fp16", "round_timeout": None, "overlap": False, "all_reduce": True,
                                     "ranks_per_worker": 1, "aggregate": "robust", "trim": None, "suspect_after": 5,
                                     "verify": 0.0, "verify_tolerance": 0.0}
    assert api.submit(parallelism="DDP").json["spec"]["strategy"] == {"type": "ddp", "lora": None, "verify": 0.0,
                                                                    "verify_tolerance": 0.0}


@pytest.mark.parametrize("fields, field", [
    ({"parallelism": "DDP", "diloco": {"inner_steps": 10}}, "diloco"),
    ({"parallelism": "DILOCO", "diloco": {"inner_steps": 0}}, "diloco.inner_steps"),
    ({"parallelism": "DILOCO", "diloco": {"outer_lr": -1}}, "diloco.outer_lr"),
    ({"parallelism": "DILOCO", "diloco": {"outer_momentum": 1.0}}, "diloco.outer_momentum"),
    ({"parallelism": "DILOCO", "diloco": {"outer_momentum": 0, "nesterov": True}}, "diloco.nesterov"),
    ({"parallelism": "DILOCO", "diloco": {"compression": "int4"}}, "diloco.compression"),
    ({"parallelism": "DILOCO", "diloco": {"inner_steps": "50"}}, "diloco.inner_steps"),
    ({"parallelism": "DILOCO", "diloco": {"round_timeout": 0}}, "diloco.round_timeout"),
    ({"parallelism": "DILOCO", "diloco": {"H": 50}}, "diloco.H"),
    ({"parallelism": "DILOCO", "diloco": {"ranks_per_worker": 0}}, "diloco.ranks_per_worker"),
    ({"parallelism": "DILOCO", "diloco": {"aggregate": "median"}}, "diloco.aggregate"),
    ({"parallelism": "DILOCO", "diloco": {"trim": -1}}, "diloco.trim"),
    ({"parallelism": "DILOCO", "diloco": {"suspect_after": -2}}, "diloco.suspect_after"),
    ({"parallelism": "DILOCO", "diloco": {"verify": -0.1}}, "diloco.verify"),
    ({"parallelism": "DILOCO", "diloco": {"verify": 5}}, "diloco.verify"),
    ({"parallelism": "DILOCO", "diloco": {"verify_tolerance": 2}}, "diloco.verify_tolerance"),
    ({"parallelism": "DILOCO", "world_size": 4, "diloco": {"verify": 0.5, "ranks_per_worker": 2}}, "diloco.verify"),
    ({"parallelism": "DILOCO", "diloco": {"verify": 0.5}}, "diloco.verify"),                    # no world_size
    ({"parallelism": "DILOCO", "diloco": {"ranks_per_worker": 2}}, "diloco"),                   # no world_size
    ({"parallelism": "DILOCO", "world_size": 3, "diloco": {"ranks_per_worker": 2}}, "diloco"),  # not a divisor
    ({"parallelism": "DILOCO", "world_size": 4, "gpus_per_client": 4, "diloco": {"ranks_per_worker": 2}}, "diloco")])
def test_bad_settings_are_a_400_naming_the_field_and_store_nothing(api, fields, field):
    api.refused(field, **fields)


def test_the_sdk_refuses_bad_settings_before_uploading_anything():
    sdk = ZWDX("http://127.0.0.1:9", room_token="zs_unused", remember=False)  # nothing listens: nothing is sent
    with earlier_form():  # its errors name the earlier keywords
        with pytest.raises(BadRequest) as err:
            sdk.submit_job(object(), print, print, parallelism="DILOCO", diloco={"compression": "zip"})
        assert err.value.field == "diloco.compression"
        with pytest.raises(BadRequest) as err:
            sdk.submit_job(object(), print, print, parallelism="FSDP", diloco={})
        assert err.value.field == "diloco"


# -- the server's rounds --------------------------------------------------------------------------
def placed(app, world_size: int = 2, parallelism: str = "DILOCO", compression: str = "int8", **settings):
    """A room with a job placed on ``world_size`` CPU slots, one GPU client each, under rank keys
    the test holds: the room's Api, each rank's Api (its key alone), the job."""
    room = Api(app.test_client()).create_room(f"room-{parallelism}")
    extra = {"diloco": {"compression": compression, **settings}} if parallelism == "DILOCO" else {}
    job = room.submit(parallelism=parallelism, world_size=world_size, **extra).json
    return room, start_placed(app, room, job, world_size), job


def put(rank: Api, job: dict, n: int, values, compression: str = "int8", last: bool = False):
    data = codec.encode(np.asarray(values, np.float32), compression)
    return rank.put(f"/jobs/{job['id']}/diloco/rounds/{n}?last={'true' if last else 'false'}", data=data,
                    headers={defaults.SHA256_HEADER: hashlib.sha256(data).hexdigest()})


def kinds(app, job: dict) -> list[tuple[str, int, int | None]]:
    return sorted((a["kind"], a["round"], a.get("rank")) for a in app.extensions["zwdx"].store.list_artifacts(job["id"])
                  if a["kind"] in ("pseudo_gradient", "outer_gradient"))


def test_two_uploads_make_one_average_that_every_worker_fetches(app):
    room, (r0, r1), job = placed(app)
    a, b = np.linspace(-1, 1, 5000), np.linspace(2, -2, 5000)
    first = put(r0, job, 0, a)
    assert first.status_code == 201, first.json
    assert first.json["waiting_for"] == [1] and first.json["ready"] is False
    waiting = r1.get(f"/jobs/{job['id']}/diloco/rounds/0")
    assert waiting.status_code == 202 and waiting.json["uploaded"] == [0]
    second = put(r1, job, 0, b)
    assert second.status_code == 201 and second.json["ready"] is True and second.json["members"] == [0, 1]
    fetched = [r.get(f"/jobs/{job['id']}/diloco/rounds/0") for r in (r0, r1)]
    assert [f.status_code for f in fetched] == [200, 200] and fetched[0].data == fetched[1].data
    assert fetched[0].headers[defaults.SHA256_HEADER] == hashlib.sha256(fetched[0].data).hexdigest()
    assert np.abs(codec.decode(fetched[0].data) - (a + b) / 2).max() <= 2 * 2 / 254
    assert kinds(app, job) == [("outer_gradient", 0, None)]  # the uploads went once averaged
    log = [e["data"]["text"] for e in room.get(f"/jobs/{job['id']}/events").json["events"] if e["kind"] == "log"]
    assert any("round 0" in line and "through the server" in line for line in log)
    late = put(r0, job, 0, a)
    assert late.status_code == 409 and kinds(app, job) == [("outer_gradient", 0, None)]


def test_a_rank_key_opens_its_own_jobs_rounds_only_and_a_refusal_stores_nothing(app):
    room, (r0, r1), job = placed(app)
    other_room, (o0, _), other = placed(app)
    ctx = app.extensions["zwdx"]
    before = [a["id"] for a in ctx.store.list_artifacts(job["id"])]
    assert put(o0, job, 0, [1.0]).status_code == 403                       # another job's rank key
    assert put(r0.as_(None, rank_key="rk_forged"), job, 0, [1.0]).status_code == 403
    assert put(room, job, 0, [1.0]).status_code == 401                     # a submitter token is no rank key
    assert room.get(f"/jobs/{job['id']}/diloco/rounds/0").status_code == 401
    assert put(r0, job, 0, [1.0, 2.0], compression="fp16").status_code == 400  # not the job's compression
    bad = r0.put(f"/jobs/{job['id']}/diloco/rounds/0", data=b"\x80\x04 a pickle, say")
    assert bad.status_code == 400 and bad.json["error"]["field"] == "body"
    assert [a["id"] for a in ctx.store.list_artifacts(job["id"])] == before
    assert put(r0, job, 0, np.ones(10)).status_code == 201
    mismatch = put(r1, job, 0, np.ones(11))
    assert mismatch.status_code == 400 and "rank 0" in mismatch.json["error"]["message"]
    _, (d0,), ddp = placed(app, world_size=1, parallelism="DDP")
    assert put(d0, ddp, 0, [1.0]).status_code == 409                       # a DDP job has no rounds


def test_a_worker_that_leaves_is_not_waited_for_and_old_rounds_are_collected(app):
    _, (r0, r1), job = placed(app, compression="none")
    assert put(r0, job, 0, [1.0, 1.0], 'none').status_code == 201
    assert put(r1, job, 0, [], 'none', last=True).json["left"] == [1]  # nothing to add: not in the mean
    assert codec.decode(r0.get(f"/jobs/{job['id']}/diloco/rounds/0").data).tolist() == [1.0, 1.0]
    for n in (1, 2, 3):
        state = put(r0, job, n, [float(n), 0.0], 'none').json
        assert state["ready"] and state["expected"] == [0] and state["members"] == [0]
    assert put(r1, job, 4, [1.0, 1.0], 'none').status_code == 409  # it left
    assert kinds(app, job) == [("outer_gradient", 2, None), ("outer_gradient", 3, None)]
    assert r0.get(f"/jobs/{job['id']}/diloco/rounds/0").status_code == 404
    assert codec.decode(r0.get(f"/jobs/{job['id']}/diloco/rounds/3").data).tolist() == [3.0, 0.0]


def test_a_round_goes_on_without_a_worker_that_misses_its_deadline(app):
    _, (r0, r1), job = placed(app, compression="none", round_timeout=0.2)
    assert put(r0, job, 0, [2.0, 4.0], "none").json["waiting_for"] == [1]
    # before the deadline an ask is answered 202 (waiting); the first ask past it averages what is in
    fetched = wait_until(lambda: (f := r0.get(f"/jobs/{job['id']}/diloco/rounds/0")).status_code != 202 and f,
                         0.2 + SLACK, 0.05, what="round 0 past its deadline")
    assert fetched.status_code == 200 and codec.decode(fetched.data).tolist() == [2.0, 4.0]
    late = put(r1, job, 0, [0.0, 0.0], "none")
    assert late.status_code == 409 and "without it" in late.json["error"]["message"]
    assert r1.get(f"/jobs/{job['id']}/diloco/rounds/0").data == fetched.data  # it takes that average
    assert put(r0, job, 1, [1.0, 1.0], "none").json["expected"] == [0, 1]  # and the next round waits for it again


def test_a_lost_worker_is_dropped_and_the_job_goes_on_without_a_restart(app):
    from zwdx.server.jobs import lifecycle
    room, (r0, r1), job = placed(app, compression="none")
    ctx = app.extensions["zwdx"]
    for rank in (r0, r1):
        assert rank.post(f"/jobs/{job['id']}/ranks/{0 if rank is r0 else 1}", json={"status": "running"}).json["ok"]
    assert put(r0, job, 0, [1.0], "none").json["waiting_for"] == [1]
    lifecycle.client_lost(ctx, f"gpu-{job['id']}-1", "no heartbeat for 9 s (staged)")
    after = room.get(f"/jobs/{job['id']}").json
    assert after["status"] == "running" and after["restarts"] == 0
    assert after["ranks"]["1"]["status"] == "dropped"
    assert "rank(s) 1 dropped, 1 worker(s) go on" in after["timeline"][-1]["reason"]
    state = r0.get(f"/jobs/{job['id']}/diloco/rounds/0")  # the round no longer waits for it
    assert state.status_code == 200 and codec.decode(state.data).tolist() == [1.0]
    assert r1.post(f"/jobs/{job['id']}/ranks/1", json={"status": "failed", "error": "late"}).json["ok"] is False
    weights = r0.put(f"/jobs/{job['id']}/weights", data=b"weights").json["id"]
    assert r0.post(f"/jobs/{job['id']}/ranks/0", json={"status": "completed", "final_loss": 0.5,
                                                      "weights_artifact": weights}).json["ok"]
    done = room.get(f"/jobs/{job['id']}").json
    assert done["status"] == "completed" and done["weights_artifact"] == weights and done["final_loss"] == 0.5


def test_a_lost_worker_restarts_a_ddp_job_and_a_diloco_job_left_with_no_worker(app):
    from zwdx.server.jobs import lifecycle
    ctx = app.extensions["zwdx"]
    for parallelism in ("DDP", "DILOCO"):
        room, ranks, job = placed(app, world_size=1 if parallelism == "DILOCO" else 2, parallelism=parallelism)
        lifecycle.client_lost(ctx, f"gpu-{job['id']}-0", "staged")
        after = room.get(f"/jobs/{job['id']}").json
        assert after["status"] == "resuming" and after["restarts"] == 1, parallelism


def test_a_rank_cannot_report_itself_dropped(app):
    _, (r0, _), job = placed(app)
    resp = r0.post(f"/jobs/{job['id']}/ranks/0", json={"status": "dropped"})
    assert resp.status_code == 400 and "the server drops" in resp.json["error"]["message"]


def test_with_rank_0_dropped_the_first_worker_left_brings_the_weights_and_the_results(app):
    from zwdx.server.jobs import lifecycle
    room, (r0, r1), job = placed(app)
    lifecycle.client_lost(app.extensions["zwdx"], f"gpu-{job['id']}-0", "staged")
    assert put(r1, job, 0, [1.0]).json["dropped"] == [0]
    assert r0.put(f"/jobs/{job['id']}/weights", data=b"w").status_code == 403  # it was dropped
    weights = r1.put(f"/jobs/{job['id']}/weights", data=b"w")
    assert weights.status_code == 201
    assert r1.post(f"/jobs/{job['id']}/ranks/1", json={"status": "completed", "final_loss": 0.25,
                                                      "weights_artifact": weights.json["id"]}).json["ok"]
    done = room.get(f"/jobs/{job['id']}").json
    assert done["status"] == "completed" and done["final_loss"] == 0.25 and done["weights_artifact"] == weights.json["id"]


def test_a_worker_that_misses_two_rounds_in_a_row_is_dropped(app):
    room, (r0, r1), job = placed(app, compression="none", round_timeout=0.1)
    for n in (0, 1):
        put(r0, job, n, [1.0], "none")
        wait_until(lambda: r0.get(f"/jobs/{job['id']}/diloco/rounds/{n}").status_code == 200, 0.1 + SLACK, 0.05,
                   what=f"round {n} past its deadline")
    after = room.get(f"/jobs/{job['id']}").json
    assert after["ranks"]["1"]["status"] == "dropped" and after["status"] == "starting"
    assert "missed diloco rounds 0 and 1" in after["timeline"][-1]["reason"]
    assert put(r0, job, 2, [1.0], "none").json["expected"] == [0]


def test_a_diloco_checkpoint_is_rank_0s_alone_so_a_dropped_worker_never_holds_it_back(app):
    _, (r0, r1), job = placed(app)
    for name in ("state.pt", "rng-0.pt"):
        assert r0.put(f"/jobs/{job['id']}/checkpoints/0/{name}", data=b"x").status_code == 201
    resp = r0.post(f"/jobs/{job['id']}/checkpoints/0/commit", json={"files": ["rng-0.pt", "state.pt"]})
    assert resp.status_code == 201 and sorted(resp.json["files"]) == ["rng-0.pt", "state.pt"], resp.json


def test_a_worker_of_two_ranks_uploads_once_and_one_rank_lost_drops_the_whole_worker(app):
    from zwdx.server.jobs import lifecycle
    room, ranks, job = placed(app, world_size=4, compression="none", ranks_per_worker=2)
    assert job["spec"]["resources"]["gpus_per_client"] == 2  # a worker's ranks are placed on one GPU client
    refused = put(ranks[1], job, 0, [9.0, 9.0], "none")
    assert refused.status_code == 409 and "rank 0 uploads for its worker" in refused.json["error"]["message"]
    assert put(ranks[0], job, 0, [1.0, 3.0], "none").json["waiting_for"] == [2]  # workers, not ranks
    both = put(ranks[2], job, 0, [3.0, 1.0], "none").json
    assert both["ready"] and both["expected"] == [0, 2] and both["members"] == [0, 2]
    fetched = [r.get(f"/jobs/{job['id']}/diloco/rounds/0") for r in ranks]  # any rank of the job may fetch
    assert {f.status_code for f in fetched} == {200} and codec.decode(fetched[3].data).tolist() == [2.0, 2.0]
    lifecycle.client_lost(app.extensions["zwdx"], f"gpu-{job['id']}-3", "staged")  # one rank of worker 1
    after = room.get(f"/jobs/{job['id']}").json
    assert {r: s["status"] for r, s in after["ranks"].items()} == {"2": "dropped", "3": "dropped"}
    assert after["restarts"] == 0
    assert after["timeline"][-1]["reason"].endswith("rank(s) 2, 3 dropped, 1 worker(s) go on")
    alone = put(ranks[0], job, 1, [1.0, 1.0], "none").json
    assert alone["ready"] and alone["expected"] == [0] and alone["dropped"] == [2, 3]


def test_an_upload_still_being_checked_is_not_averaged_into_its_round(app):
    # Two uploads in flight: rank 1's bytes are stored but not yet checked (its record has no
    # numel) when rank 0's upload closes the round. It must wait for rank 1's check: an upload
    # averaged before it is checked could be one the check then refuses.
    import time as clock
    room, (r0, r1), job = placed(app, compression="none")
    store = app.extensions["zwdx"].store
    store.add_artifact({"id": "in-flight", "room_id": room.room["id"], "kind": "pseudo_gradient", "size": 1,
                        "sha256": "0" * 64, "job_id": job["id"], "created_at": clock.time(), "round": 0, "rank": 1,
                        "attempt": 0, "last": False})
    first = put(r0, job, 0, [1.0, 2.0], "none")
    assert first.status_code == 201 and first.json["ready"] is False and first.json["waiting_for"] == [1]
    second = put(r1, job, 0, [3.0, 4.0], "none")
    assert second.status_code == 201 and second.json["ready"] is True
    assert codec.decode(r0.get(f"/jobs/{job['id']}/diloco/rounds/0").data).tolist() == [2.0, 3.0]
