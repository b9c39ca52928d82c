"""Attacks on limits and clean values (the trust issue's items 2, 8, 9 and 11), each replayed and
shown to fail: one room's bad records never stop another room's jobs, and an impossible job
holds back no one; NaN and infinities travel as "NaN"/"Infinity"/"-Infinity" end to end and a
literal NaN is refused; request sizes, per-room quotas and rate limits hold, and what they
refuse stores nothing; unreferenced artifacts are swept; the dashboard's route is no oracle of
the server's files; every answer carries the security headers; the data dir is private.

In-process apps over both stores where the store matters (SQLite, and MongoDB over its wire
protocol: ``store_backends``); a real HTTP server (in a thread, or a process for gevent) where
the client side must be the real one (the rank's reporter, the SDK).
"""
from __future__ import annotations

import io
import json
import math
import os
import platform
import stat
import threading
import time

import pytest
import requests

from conftest import Api, placed_job
from procs import Server, free_port
from store_backends import *  # noqa: F401,F403  (fixtures: backend, mongo_uri, ...)
from zwdx import ZWDX, defaults
from zwdx.protocol.base import Answer, Message
from zwdx.protocol.rest import Query
from zwdx.server import SECURITY_HEADERS

PY = platform.python_version()


@pytest.fixture
def backend_app(backend, make_app, tmp_path):
    """make(**config) -> an in-process app over the backend's store (artifact bytes in files, or GridFS)."""
    def make(**config):
        if backend.name == "sqlite":
            return make_app(DATA_DIR=backend.where, **config)
        return make_app(DATA_DIR=str(tmp_path / "mongo-app"), MONGO_URI=backend.where, **config)
    return make


def strict_json(text: str):
    """JSON as a browser's JSON.parse reads it: no NaN, no Infinity."""
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in an answer: not JSON"))


def online_client(store, room_id: str, name: str, slots: int = 1, **doc):
    store.upsert_client({"id": name, "room_id": room_id, "hostname": name, "status": "online",
                         "versions": {"python": PY}, **doc},
                        [{"id": f"{name}:{i}", "client_id": name, "room_id": room_id, "index": i, "kind": "cpu",
                          "memory_total": 8 << 30, "memory_free": 8 << 30} for i in range(slots)])


# -- item 2: one room never stops another ------------------------------------------------------------
def corrupt_job(backend, store, job_id: str) -> None:
    """Make a job's stored record unreadable as a Job, as a bug or an older zwdx could leave it."""
    if backend.name == "sqlite":
        store.db.query("UPDATE jobs SET doc=json_set(doc, '$.spec.code.versions', json('[1, 2]')) WHERE id=?", (job_id,))
    else:
        store.db.jobs.update_one({"_id": job_id}, {"$set": {"spec.code.versions": [1, 2]}})


def test_one_rooms_bad_records_never_stop_another_rooms_jobs(backend, backend_app):
    app = backend_app()
    store, scheduler = app.extensions["zwdx"].store, app.extensions["zwdx"].scheduler
    bad, good = Api(app.test_client()).create_room("bad"), Api(app.test_client()).create_room("good")
    waiting = bad.submit(world_size=1).json
    # Room "bad": a GPU client whose record holds what the edge would refuse (free memory "x",
    # versions as a list), and a job that does not read as one, written straight into the store.
    store.upsert_client({"id": "bad-ver", "room_id": bad.room["id"], "status": "online", "versions": ["3.11"]},
                        [{"id": "bad-ver:0", "client_id": "bad-ver", "room_id": bad.room["id"], "index": 0,
                          "kind": "cpu", "memory_total": "x", "memory_free": "x"}])
    unreadable = bad.submit(world_size=1).json
    corrupt_job(backend, store, unreadable["id"])
    online_client(store, good.room["id"], "good-gpu")
    theirs = good.submit(world_size=1).json
    assert scheduler.schedule_once() == 1
    assert good.get(f"/jobs/{theirs['id']}").json["status"] == "starting"
    mine = bad.get(f"/jobs/{waiting['id']}").json
    assert mine["status"] == "queued" and "cannot place this room's jobs" in mine["waiting_reason"]
    # The bad room's records stay as they were; the next pass places the good room's next job too.
    second = good.submit(world_size=1).json
    online_client(store, good.room["id"], "good-gpu-2")
    assert scheduler.schedule_once() == 1 and good.get(f"/jobs/{second['id']}").json["status"] == "starting"


def test_settling_one_rooms_jobs_never_stops_another_rooms(backend, backend_app):
    app = backend_app()
    ctx = app.extensions["zwdx"]
    _, _, broken = placed_job(app, "broken")
    room, rank0, job = placed_job(app, "settled")
    corrupt_job(backend, ctx.store, broken["id"])
    rank0.post(f"/jobs/{job['id']}/ranks/0", json={"status": "failed", "error": "boom", "traceback": "tb"})
    ctx.scheduler.settle()
    assert room.get(f"/jobs/{job['id']}").json["status"] == "failed"


def test_a_job_the_room_could_never_run_holds_back_no_one(api, app):
    store, scheduler = app.extensions["zwdx"].store, app.extensions["zwdx"].scheduler
    online_client(store, api.room["id"], "one-slot")
    impossible = api.submit(world_size=100_000).json
    assert "world_size 100000" in impossible["unschedulable"]
    behind = api.submit(world_size=1).json
    assert scheduler.schedule_once() == 1
    assert api.get(f"/jobs/{behind['id']}").json["status"] == "starting"
    waits = api.get(f"/jobs/{impossible['id']}").json
    assert waits["status"] == "queued" and waits["waiting_reason"].startswith("waiting for 100000 free slot(s)")
    # A job that could run but finds its slot busy still holds the queue behind it (FIFO).
    head, tail = api.submit(world_size=1).json, api.submit(world_size=1).json
    assert scheduler.schedule_once() == 0
    assert "busy" in api.get(f"/jobs/{head['id']}").json["waiting_reason"]
    assert api.get(f"/jobs/{tail['id']}").json["status"] == "queued"


# -- item 8: NaN and infinities, end to end -------------------------------------------------------------
@pytest.fixture
def http_app(make_app):
    """An in-process app served over real HTTP (a Werkzeug server in a thread): its URL."""
    from werkzeug.serving import make_server
    app = make_app()
    server = make_server("127.0.0.1", free_port(), app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield app, f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join(10)


def test_a_nan_loss_never_jams_the_reporter_and_comes_back_a_float(http_app):
    from gpu_client.rank.reporter import Reporter
    app, url = http_app
    room, rank0, job = placed_job(app, "diverged")
    reporter = Reporter(url, rank0.rank_key, job["id"], 0, flush_interval=0.05)
    reporter.log_metrics(loss=float("nan"))
    reporter.log_metrics(loss=float("inf"), accuracy=0.5)
    reporter.log_metrics(loss=-math.inf)
    reporter.log_metrics(loss=1.25)
    reporter.log("NaN")  # a line of text that reads like a number stays text
    assert reporter.flush(timeout=30), "the reporter kept a batch it cannot send"
    reporter.status("completed", final_loss=float("nan"), results={"eval_loss": float("inf"), "curve": [1.0, -math.inf]})
    reporter.close()
    raw = requests.get(f"{url}/api/v1/jobs/{job['id']}/metrics", headers={defaults.TOKEN_HEADER: room.token}).text
    assert [p["value"] for p in strict_json(raw)["series"]["loss"]] == ["NaN", "Infinity", "-Infinity", 1.25]
    sdk = ZWDX(url, room_token=room.token, remember=False)
    loss = [p["value"] for p in sdk.get_job_metrics(job["id"])["loss"]]
    assert math.isnan(loss[0]) and loss[1:] == [math.inf, -math.inf, 1.25]
    assert [line["text"] for line in sdk.get_job_logs(job["id"])] == ["NaN"]
    done = sdk.get_job(job["id"])
    assert done["status"] == "completed" and math.isnan(done["final_loss"])
    assert done["results"] == {"eval_loss": math.inf, "curve": [1.0, -math.inf]}
    strict_json(requests.get(f"{url}/api/v1/jobs", headers={defaults.TOKEN_HEADER: room.token}).text)
    strict_json(requests.get(f"{url}/api/v1/dashboard/history", headers={defaults.TOKEN_HEADER: room.token}).text)


def test_a_literal_nan_in_any_body_is_400_and_changes_nothing(app):
    room, rank0, job = placed_job(app, "nan")
    store = app.extensions["zwdx"].store
    before = (store.get_job(job["id"]), store.get_events(job["id"]), len(room.jobs()))
    both = room.as_(room.token, rank_key=rank0.rank_key)  # each route finds the credential it takes
    bodies = 0
    for rule in app.url_map.iter_rules():
        op = getattr(app.view_functions[rule.endpoint], "operation", None)
        if op is None or not isinstance(op.body, type):
            continue
        path = rule.rule.replace("<job_id>", job["id"]).replace("<rank>", "0").replace("<n>", "0")
        for token in ("NaN", "Infinity", "-Infinity", "1e400"):
            resp = both.request(op.method, path[len(defaults.API_PREFIX):], content_type="application/json",
                                 data='{"events": [], "status": "running", "name": %s, "x": %s}' % (token, token))
            assert resp.status_code == 400 and resp.json["error"]["field"] == "body", (path, token, resp.text)
        bodies += 1
    assert bodies >= 5
    assert (store.get_job(job["id"]), store.get_events(job["id"]), len(room.jobs())) == before


def test_every_message_refuses_nan_unless_it_declares_a_measured_number():
    import zwdx.protocol.gpu, zwdx.protocol.rank, zwdx.protocol.report, zwdx.protocol.rest  # noqa: E401,F401
    def every(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from every(sub)
    models = [*every(Message), *every(Query), *every(Answer)]
    assert len(models) > 30
    for model in models:
        assert model.model_config.get("allow_inf_nan") is False, model.__name__


def test_a_stored_nan_never_makes_an_answer_unparseable(backend, backend_app):
    """A record an older zwdx stored with NaN floats in it: every answer stays JSON."""
    app = backend_app()
    ctx = app.extensions["zwdx"]
    room, rank0, job = placed_job(app, "old")
    ctx.store.set_job(job["id"], {"final_loss": float("nan"), "results": {"acc": float("inf")}})
    ctx.store.add_events(job["id"], [{"kind": "metric", "rank": 0, "key": "k", "step": 0, "data": {"loss": 1.0}}])
    for path in ("/jobs", f"/jobs/{job['id']}?events_after=0", f"/jobs/{job['id']}/metrics", "/dashboard/history",
                 f"/jobs/{job['id']}/events"):
        strict_json(room.get(path).get_data(as_text=True))
    assert room.get(f"/jobs/{job['id']}").json["final_loss"] == "NaN"


def test_a_metric_that_is_a_list_is_refused_and_the_series_stay_readable(api, app):
    room, rank0, job = placed_job(app, "lists")
    resp = rank0.post(f"/jobs/{job['id']}/events", json={"events": [{"kind": "metric", "data": {"loss": [1, 2]}}]})
    assert resp.status_code == 400 and resp.json["error"]["field"] == "events.0"
    assert room.get(f"/jobs/{job['id']}/metrics").status_code == 200


# -- item 9: sizes, quotas, rate limits, garbage collection -------------------------------------------------
def test_a_50_mb_body_is_refused_before_anything_reads_it(app, socket_client):
    room, rank0, job = placed_job(app, "big")
    rooms = len(app.extensions["zwdx"].store.list_jobs())
    resp = Api(app.test_client()).post("/rooms", data=b'{"name": "' + b"x" * (50 << 20) + b'"}',
                                       content_type="application/json")
    assert resp.status_code == 413 and resp.json["error"]["code"] == "payload_too_large"
    dashboard = socket_client("/ui", room.token)
    dashboard.get_received("/ui")
    huge = {"events": [{"kind": "log", "rank": 0, "data": {"text": "y" * (50 << 20)}}]}
    assert rank0.post(f"/jobs/{job['id']}/events", json=huge).status_code == 413
    one_too_long = {"events": [{"kind": "log", "rank": 0, "data": {"text": "y" * 100_001}}]}
    assert rank0.post(f"/jobs/{job['id']}/events", json=one_too_long).status_code == 400
    assert not [m for m in dashboard.get_received("/ui") if m["name"] == "job_events"]
    assert app.extensions["zwdx"].store.get_events(job["id"]) == []
    assert len(app.extensions["zwdx"].store.list_jobs()) == rooms


def test_the_reporter_sends_many_long_lines_in_batches_under_the_limit(http_app):
    from gpu_client.rank.reporter import Reporter
    app, url = http_app
    room, rank0, job = placed_job(app, "chatty")
    reporter = Reporter(url, rank0.rank_key, job["id"], 0)
    for i in range(120):  # 12 MB of text: more than one request body may hold
        reporter.log(f"{i:03d}" + "z" * 99_990)
    assert reporter.flush(timeout=120)
    reporter.close()
    assert len(app.extensions["zwdx"].store.get_events(job["id"], kind="log")) == 120


def test_a_room_over_its_job_quota_is_refused_and_others_are_not(make_app):
    app = make_app(ROOM_MAX_JOBS=2)
    full, other = Api(app.test_client()).create_room("full"), Api(app.test_client()).create_room("other")
    assert [full.submit().status_code for _ in range(2)] == [201, 201]
    resp = full.submit()
    assert resp.status_code == 429 and resp.json["error"]["code"] == "quota_exceeded"
    assert resp.json["error"]["limit"] == 2 and len(full.jobs()) == 2
    assert full.get("/room").json["usage"]["jobs"] == 2 and full.get("/room").json["usage"]["jobs_limit"] == 2
    assert other.submit().status_code == 201
    full.post(f"/jobs/{full.jobs()[0]['id']}/cancel")
    assert full.submit().status_code == 201


def test_a_room_over_its_artifact_quota_stores_nothing(backend, backend_app):
    app = backend_app(ROOM_MAX_ARTIFACT_BYTES=100)
    room, other = Api(app.test_client()).create_room("a"), Api(app.test_client()).create_room("b")
    room.upload(b"x" * 80)
    ctx = app.extensions["zwdx"]
    held = ctx.artifacts.stored(time.time() + 60)
    chunked = {"input_stream": io.BytesIO(b"y" * 30), "environ_overrides": {"wsgi.input_terminated": True}}
    for kwargs in ({"data": b"y" * 30}, chunked):  # with its length, and without (chunked)
        resp = room.post("/artifacts", **kwargs)
        assert resp.status_code == 429 and resp.json["error"]["code"] == "quota_exceeded", resp.text
    assert ctx.artifacts.stored(time.time() + 60) == held and ctx.store.room_artifact_bytes(room.room["id"]) == 80
    assert ctx.artifacts.discard_partial(time.time() + 60) == 0  # no upload left anything half-written
    assert room.get("/room").json["usage"]["artifact_bytes"] == 80
    other.upload(b"z" * 90)


def test_room_creation_and_failed_logins_are_rate_limited_per_address(make_app, socket_client):
    app = make_app(RATE_LIMIT_ROOMS="3 per minute", RATE_LIMIT_AUTH_FAILURES="4 per minute")
    here, there = app.test_client(), app.test_client()
    there.environ_base["REMOTE_ADDR"] = "10.0.0.2"
    answers = [here.post("/api/v1/rooms", json={}).status_code for _ in range(4)]
    assert answers == [201, 201, 201, 429]
    assert there.post("/api/v1/rooms", json={}).status_code == 201
    token = there.post("/api/v1/rooms", json={}).json["token"]
    wrong = {defaults.TOKEN_HEADER: "zr_guessed"}
    assert [here.get("/api/v1/jobs", headers=wrong).status_code for _ in range(5)] == [401] * 4 + [429]
    blocked = here.get("/api/v1/jobs", headers={defaults.TOKEN_HEADER: token})
    assert blocked.status_code == 429 and blocked.json["error"]["code"] == "too_many_requests"
    assert there.get("/api/v1/jobs", headers={defaults.TOKEN_HEADER: token}).status_code == 200
    assert here.get("/health").status_code == 200  # what needs no token is not refused
    for _ in range(4):
        assert not socket_client("/gpu", "zr_guessed").is_connected("/gpu")
    assert not socket_client("/gpu", token).is_connected("/gpu")  # this address failed too often


@pytest.mark.slow
def test_rate_limits_hold_in_a_gevent_server(tmp_path):
    server = Server(str(tmp_path / "server"), env={"ZWDX_RATE_LIMIT_ROOMS": "2 per minute"})
    try:
        assert requests.get(f"{server.url}/health", timeout=10).json()["async_mode"] == "gevent"
        codes = [requests.post(f"{server.url}/api/v1/rooms", json={}, timeout=10).status_code for _ in range(3)]
        assert codes == [201, 201, 429]
    finally:
        server.stop()


def test_unreferenced_artifacts_are_swept_and_referenced_ones_kept(backend, backend_app):
    app = backend_app(UNATTACHED_GRACE=3600)
    ctx = app.extensions["zwdx"]
    stray = Api(app.test_client()).create_room("stray").upload(b"a bundle never submitted")
    room, rank0, job = placed_job(app, "done")
    jid = job["id"]
    kept = rank0.put(f"/jobs/{jid}/checkpoints/0/state.pt", data=b"committed").json
    rng = rank0.put(f"/jobs/{jid}/checkpoints/0/rng-0.pt", data=b"generators").json
    assert rank0.post(f"/jobs/{jid}/checkpoints/0/commit", json={"files": ["state.pt", "rng-0.pt"]}).status_code == 201
    loose = rank0.put(f"/jobs/{jid}/checkpoints/1/state.pt", data=b"never committed").json
    unreported = rank0.put(f"/jobs/{jid}/weights", data=b"weights never reported").json
    weights = rank0.put(f"/jobs/{jid}/weights", data=b"the weights").json
    assert rank0.put(f"/jobs/{jid}/weights", data=b"bad", headers={defaults.SHA256_HEADER: "0" * 64}).status_code == 422
    rank0.post(f"/jobs/{jid}/ranks/0", json={"status": "completed", "weights_artifact": weights["id"]})
    ctx.artifacts.save("orphan0", io.BytesIO(b"bytes no record names"), 100)
    now = time.time()
    # The job ended: what its record does not name goes at once; the stray bundle and the bytes
    # without a record wait out the grace (a bundle's job may still come).
    assert ctx.sweeper.sweep(now) == {"unreferenced": 2}
    assert ctx.store.get_artifact(stray["id"]) is not None
    assert ctx.sweeper.sweep(now + 3601) == {"unattached": 1, "orphaned": 1}
    left = {a["id"] for a in ctx.store.list_artifacts(jid)}
    assert left == {job["spec"]["code"]["bundle_artifact"], kept["id"], rng["id"], weights["id"]}
    assert ctx.store.get_artifact(stray["id"]) is None and ctx.store.get_artifact(loose["id"]) is None
    assert ctx.store.get_artifact(unreported["id"]) is None
    assert set(ctx.artifacts.stored(now + 7200)) == left
    assert room.get(f"/jobs/{jid}/weights").data == b"the weights"


def test_a_finished_jobs_artifacts_go_after_the_retention(make_app):
    app = make_app(ARTIFACT_RETENTION=60)
    ctx = app.extensions["zwdx"]
    room, rank0, job = placed_job(app, "old")
    weights = rank0.put(f"/jobs/{job['id']}/weights", data=b"w").json
    rank0.post(f"/jobs/{job['id']}/ranks/0", json={"status": "completed", "weights_artifact": weights["id"]})
    assert ctx.sweeper.sweep(time.time() + 30)["retention"] == 0
    assert ctx.sweeper.sweep(time.time() + 61)["retention"] == 2  # the bundle and the weights
    assert ctx.store.room_artifact_bytes(room.room["id"]) == 0 and ctx.artifacts.stored(time.time() + 99) == []
    assert room.get(f"/jobs/{job['id']}/weights").status_code == 404
    assert room.get(f"/jobs/{job['id']}").json["status"] == "completed"


def test_an_upload_cut_short_or_refused_leaves_nothing(http_app):
    import socket
    app, url = http_app
    ctx = app.extensions["zwdx"]
    api = Api(app.test_client()).create_room("cut")
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as sock:  # announces 2,000 bytes, sends 1,000
        sock.sendall(f"POST /api/v1/artifacts HTTP/1.1\r\nHost: x\r\n{defaults.TOKEN_HEADER}: {api.token}\r\n"
                     f"Content-Length: 2000\r\n\r\n".encode() + b"x" * 1000)
        sock.shutdown(socket.SHUT_WR)
        sock.recv(1000)
    bad_sha = api.post("/artifacts", data=b"x", headers={defaults.SHA256_HEADER: "0" * 64})
    assert bad_sha.status_code == 422
    assert api.as_(api.token, "jk_x").put("/jobs/x/checkpoints/0/..", data=b"x").status_code in (403, 404)
    assert api.get("/room").json["usage"]["artifact_bytes"] == 0
    assert ctx.artifacts.stored(time.time() + 60) == [] and ctx.artifacts.discard_partial(time.time() + 60) == 0


# -- item 11 ---------------------------------------------------------------------------------------------
def test_an_empty_commit_wipes_no_checkpoint(app):
    room, rank0, job = placed_job(app, "ckpt")
    rank0.put(f"/jobs/{job['id']}/checkpoints/0/state.pt", data=b"real")
    rank0.put(f"/jobs/{job['id']}/checkpoints/0/rng-0.pt", data=b"generators")
    assert rank0.post(f"/jobs/{job['id']}/checkpoints/0/commit",
                      json={"files": ["state.pt", "rng-0.pt"]}).status_code == 201
    for n in (1, 2, 3):
        resp = rank0.post(f"/jobs/{job['id']}/checkpoints/{n}/commit", json={"files": []})
        assert resp.status_code == 400 and resp.json["error"]["field"] == "files"
    assert [c["n"] for c in room.get(f"/jobs/{job['id']}/checkpoints").json["checkpoints"]] == [0]
    assert room.get(f"/jobs/{job['id']}/checkpoints/0/state.pt").data == b"real"


@pytest.fixture
def ui_app(make_app, tmp_path):
    dist = tmp_path / "dist"
    (dist / "assets").mkdir(parents=True)
    (dist / "index.html").write_text("<!doctype html><title>zwdx</title>")
    (dist / "assets" / "app.js").write_text("console.log(1)")
    return make_app(UI_DIR=str(dist))


def test_the_dashboard_route_tells_nothing_about_the_servers_files(ui_app, tmp_path):
    (tmp_path / "secret.txt").write_text("s")
    client = ui_app.test_client()
    for prefix in ("/", "/assets/"):
        there = client.get(prefix + "..%2fsecret.txt")
        nowhere = client.get(prefix + "..%2fno-such-file.txt")
        deep = client.get(prefix + "..%2f..%2f..%2f..%2f..%2fetc%2fpasswd")
        assert there.status_code == nowhere.status_code == deep.status_code == 200
        assert there.data == nowhere.data == deep.data == b"<!doctype html><title>zwdx</title>"
    assert client.get("/assets/app.js").data == b"console.log(1)"
    assert client.get("/assets/missing.js").status_code == 404


def test_every_answer_carries_the_security_headers(ui_app):
    client, token = ui_app.test_client(), Api(ui_app.test_client()).create_room().token
    answers = [client.get("/"), client.get("/jobs/abc"), client.get("/assets/app.js"), client.get("/health"),
               client.get("/api/v1/jobs"), client.get("/api/v1/jobs", headers={defaults.TOKEN_HEADER: token}),
               client.get("/api/v1/nothing"), client.post("/api/v1/rooms", data="[", content_type="application/json"),
               client.get("/api/v1/openapi.json")]
    for resp in answers:
        for name, value in SECURITY_HEADERS.items():
            assert resp.headers.get(name) == value, (resp.request.path, name)
    page = client.get("/api/v1/docs")
    assert page.headers["X-Frame-Options"] == "DENY" and page.headers["X-Content-Type-Options"] == "nosniff"
    csp = page.headers["Content-Security-Policy"]
    assert "script-src 'sha256-" in csp and "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp


def test_the_data_dir_and_the_store_file_are_private(make_app, tmp_path):
    data = tmp_path / "shared-data"
    data.mkdir(mode=0o755)
    os.chmod(data, 0o755)
    app = make_app(DATA_DIR=str(data))
    Api(app.test_client()).create_room().upload()
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    assert mode(data) == 0o700 and mode(data / "artifacts") == 0o700
    for name in os.listdir(data):
        if name.startswith("zwdx.sqlite3"):
            assert mode(data / name) == 0o600, name
    assert all(mode(data / "artifacts" / f) == 0o600 for f in os.listdir(data / "artifacts"))


@pytest.mark.slow
def test_the_built_dashboard_and_the_api_docs_work_under_their_csp(tmp_path):
    """Real Chromium on a server process: sign in, the room overview, a job's page, the history,
    the API's docs page; no Content-Security-Policy violation anywhere."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (./setup.sh --test)")
    from procs import build_ui
    if not os.path.exists("/usr/bin/chromium"):
        pytest.skip("/usr/bin/chromium is missing: apt-get install chromium (./setup.sh --test)")
    build_ui()
    server = Server(str(tmp_path / "server"))
    try:
        room = requests.post(f"{server.url}/api/v1/rooms", json={"name": "csp"}, timeout=10).json()
        headers = {defaults.TOKEN_HEADER: room["token"]}
        bundle = requests.post(f"{server.url}/api/v1/artifacts", data=b"b", headers=headers, timeout=10).json()
        job = requests.post(f"{server.url}/api/v1/jobs", headers=headers, timeout=10, json={
            "bundle_artifact": bundle["id"], "versions": {"python": PY}, "world_size": 1}).json()
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium",
                                         args=["--headless", "--no-sandbox", "--disable-gpu"])
            context = browser.new_context()
            context.add_init_script("window.__csp = []; document.addEventListener('securitypolicyviolation', "
                                    "(e) => window.__csp.push(e.violatedDirective + ' ' + e.blockedURI));")
            context.set_default_timeout(30_000)
            page = context.new_page()
            console = []
            page.on("console", lambda msg: console.append(msg.text) if msg.type == "error" else None)
            page.goto(server.url)
            page.get_by_label("Submitter token").fill(room["token"])
            page.get_by_role("button", name="Sign in").click()
            page.get_by_test_id("overview").wait_for()
            page.get_by_test_id("quota-jobs").wait_for()
            violations = page.evaluate("window.__csp")
            page.goto(f"{server.url}/jobs/{job['id']}")
            page.get_by_test_id("job-page").wait_for()
            violations += page.evaluate("window.__csp")
            page.goto(f"{server.url}/history")
            page.wait_for_load_state("networkidle")
            violations += page.evaluate("window.__csp")
            page.goto(f"{server.url}/api/v1/docs")
            page.get_by_text("Submit a job over an uploaded bundle").first.wait_for()
            violations += page.evaluate("window.__csp")
            browser.close()
        assert not violations, violations
        assert not [m for m in console if "Content Security Policy" in m], console
    finally:
        server.stop()
