"""The REST API and the SDK facing bad input and the wrong people: clear typed errors naming the
field, nothing stored on a refusal, no room seeing another's jobs.

In-process (conftest's ``app``, ``client`` and ``api``: a fresh app per test), except the last
section, where a process is the point: the CLI, a GPU client, the SDK over HTTP.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

import pytest

import mnist
from procs import GpuClient, free_port
import zwdx
from zwdx import ZWDX, AuthError, BadRequest, NotFound, ServerUnreachable
from zwdx.errors import Forbidden, IntegrityError, PayloadTooLarge

SHA = "X-Zwdx-Sha256"


def test_health(client):
    resp = client.get("/health")
    assert resp.status_code == 200 and resp.json["status"] == "ok"


def test_room_tokens_are_shown_once_and_stored_hashed(app, api):
    room = api.create_room("secret-room").room
    assert room["submitter_token"].startswith("zs_") and len(room["submitter_token"]) > 40
    assert room["donor_token"].startswith("zd_") and len(room["donor_token"]) > 40
    assert room["token"] == room["submitter_token"]  # the name an earlier zwdx gave it
    seen = api.as_(room["token"]).get("/room").json
    assert seen["name"] == "secret-room" and not {"token", "token_hash", "submitter_token", "donor_token"} & set(seen)
    raw = b""
    data_dir = app.config["DATA_DIR"]
    for name in os.listdir(data_dir):  # the database file and its write-ahead log
        if name.startswith("zwdx.sqlite3"):
            with open(os.path.join(data_dir, name), "rb") as fh:
                raw += fh.read()
    for token in (room["submitter_token"], room["donor_token"]):
        assert token.encode() not in raw
        assert hashlib.sha256(token.encode()).hexdigest().encode() in raw


#: The REST routes anyone may call: creating a room, the API's description.
PUBLIC = {"/api/v1/rooms", "/api/v1/openapi.json", "/api/v1/docs"}


def _every_route(app) -> list[tuple[str, str]]:
    """(method, path) of every REST route but the public ones, with made-up ids in it."""
    from zwdx.server.http import Auth
    routes = []
    for rule in app.url_map.iter_rules():
        if not rule.rule.startswith("/api/v1/"):
            continue
        operation = getattr(app.view_functions[rule.endpoint], "operation", None)
        if operation is None:  # the API's "no such route"
            continue
        public = operation.auth is Auth.NONE
        assert public == (rule.rule in PUBLIC), rule.rule
        if public:
            continue
        path = re.sub(r"<int:[a-z_]+>", "0", rule.rule)
        path = re.sub(r"<[a-z_]+>", "abc", path)
        routes += [(method, path) for method in sorted(rule.methods - {"HEAD", "OPTIONS"})]
    return routes


# every route twice with a wrong token: more failures than the default rate limit lets one address make
@pytest.mark.app_config(RATE_LIMIT_AUTH_FAILURES="10000 per minute")
def test_wrong_or_missing_token_is_refused_everywhere_and_changes_nothing(app, api):
    job_id = api.submit().json["id"]
    routes = _every_route(app)
    assert ("POST", "/api/v1/jobs") in routes and ("GET", "/api/v1/dashboard/history") in routes
    assert len(routes) > 15
    for token, says in [(None, "needs a room token"), ("zr_wrong", "not recognised")]:
        for method, path in routes:
            path = path.replace("/abc", f"/{job_id}") if "/jobs/" in path else path
            resp = api.client.open(path, method=method, json={"status": "completed", "events": []},
                                   headers={"X-Zwdx-Room-Token": token} if token else {})
            assert resp.status_code == 401, (method, path, resp.text)
            rank_route = "needs the rank's key" in resp.json["error"]["message"]  # a room token is no rank's key
            assert resp.json["error"]["code"] == "unauthorized" and (says in resp.json["error"]["message"] or
                                                                      rank_route), (method, path, resp.text)
    job = api.get(f"/jobs/{job_id}").json
    assert job["status"] == "queued" and len(job["timeline"]) == 1
    assert [j["id"] for j in api.jobs()] == [job_id]
    assert api.get(f"/jobs/{job_id}/events").json["events"] == []


def test_jobs_of_another_room_are_invisible(api):
    job = api.submit().json
    other = api.create_room("other")
    for method, path in [("GET", f"/jobs/{job['id']}"), ("POST", f"/jobs/{job['id']}/cancel"),
                         ("GET", f"/jobs/{job['id']}/events"), ("GET", f"/jobs/{job['id']}/metrics"),
                         ("GET", f"/jobs/{job['id']}/checkpoints"), ("GET", f"/jobs/{job['id']}/weights"),
                         ("GET", f"/artifacts/{job['spec']['code']['bundle_artifact']}")]:
        resp = other.request(method, path)
        assert resp.status_code == 404 and resp.json["error"]["code"] == "not_found", (method, path, resp.text)
    assert other.jobs() == []
    assert [j["id"] for j in api.jobs()] == [job["id"]]
    mine = api.get(f"/jobs/{job['id']}").json
    assert mine["status"] == "queued" and "job_key_hash" not in mine
    taken = other.post("/jobs", json={"bundle_artifact": job["spec"]["code"]["bundle_artifact"],
                                      "versions": {"python": "3.11.7"}})
    assert taken.status_code == 400 and taken.json["error"]["field"] == "bundle_artifact"


def test_rank_writes_need_the_ranks_key(api):
    job_id = api.submit().json["id"]
    resp = api.post(f"/jobs/{job_id}/events", json={"events": [{"kind": "log", "data": "x"}]})
    assert resp.status_code == 401 and "rank's key" in resp.json["error"]["message"]  # the room token is none
    for method, path, body in [("POST", f"/jobs/{job_id}/ranks/0", {"status": "completed"}),
                               ("POST", f"/jobs/{job_id}/events", {"events": [{"kind": "log", "data": "x"}]}),
                               ("PUT", f"/jobs/{job_id}/weights", None),
                               ("GET", f"/jobs/{job_id}/bundle", None)]:
        resp = api.as_(api.token, rank_key="rk_forged").request(method, path, json=body)
        assert resp.status_code == 403 and resp.json["error"]["code"] == "forbidden", (method, path, resp.text)
    job = api.get(f"/jobs/{job_id}").json
    assert job["status"] == "queued" and job.get("weights_artifact") is None
    assert api.get(f"/jobs/{job_id}/events").json["events"] == []


@pytest.mark.parametrize("body, field", [
    ("not json", "JSON object"),
    ([1, 2], "JSON object"),
    ({}, "'versions'"),
    ({"versions": {"python": "3.11.7"}}, "'bundle_artifact'"),
    ({"versions": {"python": "3.11.7"}, "bundle_artifact": "nope"}, "bundle_artifact"),
    ({"versions": {"python": "3.11.7"}, "bundle_artifact": "x", "parallelism": "MPI"}, "parallelism"),
    ({"versions": {"python": "3.11.7"}, "bundle_artifact": "x", "epochs": "3"}, "'epochs' must be int"),
    ({"versions": {"python": "3.11.7"}, "bundle_artifact": "x", "epochs": 0}, "'epochs'"),
    ({"versions": {"python": "3.11.7"}, "bundle_artifact": "x", "world_size": -1}, "'world_size'"),
    ({"versions": {"python": "3.11.7"}, "bundle_artifact": "x", "memory_required": True}, "'memory_required'"),
])
def test_malformed_job_bodies_get_400_naming_the_field(api, body, field):
    if isinstance(body, str):
        resp = api.post("/jobs", data=body, content_type="application/json")
    else:
        resp = api.post("/jobs", json=body)
    assert resp.status_code == 400, resp.text
    assert field in resp.json["error"]["message"]
    assert api.jobs() == []


def test_artifacts_are_checked_by_sha256_and_size(api, make_app, room_api):
    resp = api.post("/artifacts", data=b"abc", headers={SHA: "0" * 64})
    assert resp.status_code == 422 and resp.json["error"]["code"] == IntegrityError.code
    good = hashlib.sha256(b"abc").hexdigest()
    resp = api.post("/artifacts", data=b"abc", headers={SHA: good})
    assert resp.status_code == 201 and resp.json["sha256"] == good and resp.json["size"] == 3
    back = api.get(f"/artifacts/{resp.json['id']}")
    assert back.data == b"abc" and back.headers[SHA] == good

    small = make_app(MAX_ARTIFACT_BYTES=1000)
    room = room_api(app=small)
    resp = room.post("/artifacts", data=b"x" * 5000)
    assert resp.status_code == 413 and resp.json["error"]["code"] == PayloadTooLarge.code
    assert os.listdir(os.path.join(small.config["DATA_DIR"], "artifacts")) == []  # nothing half-written is kept


def test_job_with_its_new_events_in_one_call(api):
    job_id = api.submit().json["id"]
    resp = api.get(f"/jobs/{job_id}?events_after=0")
    assert resp.status_code == 200 and resp.json["events"] == [] and resp.json["id"] == job_id
    assert "events" not in api.get(f"/jobs/{job_id}").json
    resp = api.get(f"/jobs/{job_id}?events_after=x")
    assert resp.status_code == 400 and "events_after" in resp.json["error"]["message"]


def test_a_held_poll_answers_as_soon_as_the_job_has_news_and_not_before(app):
    """``?wait=``: what ``ZWDX.wait`` calls, one call where polls every 0.5 s would be many."""
    import threading
    import time

    from conftest import Api, placed_job
    room, rank0, job = placed_job(app, "held")
    seen = room.get(f"/jobs/{job['id']}?events_after=0").json
    last = seen["events"][-1]["seq"] if seen["events"] else 0

    started = time.monotonic()  # nothing new: held the whole wait, then the job as it is
    quiet = room.get(f"/jobs/{job['id']}?events_after={last}&wait=0.6")
    assert quiet.status_code == 200 and quiet.json["events"] == [] and quiet.json["status"] == seen["status"]
    assert time.monotonic() - started >= 0.6

    def report():
        time.sleep(0.4)  # the event comes while the request waits: the pause is what is tested
        Api(app.test_client(), rank_key=rank0.rank_key).post(f"/jobs/{job['id']}/events", json={"events": [
            {"kind": "metric", "rank": 0, "key": "0:1", "step": 0, "data": {"loss": 1.5}, "ts": time.time()}]})
    reporter = threading.Thread(target=report)
    started = time.monotonic()
    reporter.start()
    news = room.get(f"/jobs/{job['id']}?events_after={last}&wait=20")
    reporter.join()
    assert news.status_code == 200 and [e["data"] for e in news.json["events"]] == [{"loss": 1.5}]
    assert 0.4 <= time.monotonic() - started < 5, "answered when the event came, not at the end of the wait"

    started = time.monotonic()  # a job that changed status (cancelled) ends the wait as well
    canceller = threading.Timer(0.3, lambda: Api(app.test_client(), room.token).post(f"/jobs/{job['id']}/cancel"))
    canceller.start()
    ended = room.get(f"/jobs/{job['id']}?events_after={news.json['events'][-1]['seq']}&wait=20")
    canceller.join()
    assert ended.json["status"] in ("cancelled", "cancelling") or ended.json["events"], ended.json
    assert time.monotonic() - started < 5

    for query, field in (("wait=5", "wait"), ("events_after=0&wait=26", "wait"), ("events_after=0&wait=x", "wait")):
        bad = room.get(f"/jobs/{job['id']}?{query}")
        assert bad.status_code == 400 and field in bad.json["error"]["message"], (query, bad.json)


@pytest.mark.parametrize("namespace", ["/gpu", "/ui"])
def test_socketio_refuses_a_missing_or_wrong_token(api, socket_client, namespace):
    assert not socket_client(namespace).is_connected(namespace)
    assert not socket_client(namespace, "zr_wrong").is_connected(namespace)
    right, wrong_role = (api.donor, api.token) if namespace == "/gpu" else (api.token, api.donor)
    assert not socket_client(namespace, wrong_role).is_connected(namespace)
    assert socket_client(namespace, right).is_connected(namespace)


def test_a_dashboard_gets_the_rooms_gpu_clients_when_it_connects(api, socket_client):
    gpu = socket_client("/gpu", api.donor)
    answer = gpu.emit("register", {"client_id": "c1", "hostname": "h", "versions": {"python": "3.11.7"},
                                   "slots": [{"index": 0, "kind": "cpu", "memory_total": 10, "memory_free": 10}]},
                      namespace="/gpu", callback=True)
    assert answer["ok"] and answer["room_id"] == api.room["id"], answer
    ui = socket_client("/ui", api.token)
    pushed = [m for m in ui.get_received("/ui") if m["name"] == "clients_update"]
    assert [c["id"] for c in pushed[0]["args"][0]["clients"]] == ["c1"]
    other = socket_client("/ui", api.create_room("other").token)
    pushed = [m for m in other.get_received("/ui") if m["name"] == "clients_update"]
    assert pushed[0]["args"][0]["clients"] == []  # another room's dashboard sees none of them


def test_history_names_a_wrong_status_and_starts_empty(api):
    resp = api.get("/dashboard/history?status=done")
    assert resp.status_code == 400
    assert resp.json["error"]["field"] == "status" and "done" in resp.json["error"]["message"]
    assert api.as_(None).get("/dashboard/history").status_code == 401
    assert api.get("/dashboard/history").json == {"jobs": []}


def test_the_sdk_checks_its_arguments_before_it_calls_the_server():
    sdk = ZWDX(f"http://127.0.0.1:{free_port()}", remember=False)  # nothing listens there
    fine = dict(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=mnist.train,
                run=zwdx.Run(room_token="zr_x"))
    for wrong, message in [({"parallelism": "ZeRO"}, "parallelism"), ({"train_func": 42}, "train_func must be a function"),
                           ({"model": "net"}, "model must be a torch.nn.Module"),
                           ({"run": zwdx.Run()}, "room token")]:
        with pytest.raises(BadRequest, match=message):
            sdk.submit_job(**{**fine, **wrong})


def test_unreachable_server_is_a_typed_error():
    with pytest.raises(ServerUnreachable, match="cannot reach"):
        ZWDX(f"http://127.0.0.1:{free_port()}").list_jobs("zr_x")


# -- real processes: the SDK over HTTP, the CLI, a GPU client -----------------------------------------
def test_the_sdk_raises_typed_errors_for_the_wrong_token_and_unknown_jobs(server, sdk, room):
    with pytest.raises(AuthError, match="not recognised"):
        sdk.list_jobs("zr_wrong")
    with pytest.raises(AuthError, match="not recognised"):
        sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=mnist.train,
                       run=zwdx.Run(room_token="zr_wrong"), wait=False)
    with pytest.raises(NotFound, match="no job nope"):
        sdk.get_job("nope", room["token"])
    with pytest.raises(NotFound):
        sdk.cancel_job("nope", room["token"])
    assert sdk.list_jobs(room["token"]) == []


def test_room_create_cli_prints_each_token_after_what_it_is_for(server):
    out = subprocess.run([sys.executable, "-m", "zwdx.cli", "room", "create", "--server", server.url, "--name", "x"],
                         capture_output=True, text=True, check=True).stdout
    lines = out.strip().splitlines()
    submitter, donor = lines[-3], lines[-1]
    assert lines[-4].startswith("submitter token") and lines[-2].startswith("donor token"), out
    assert submitter.startswith("zs_") and donor.startswith("zd_")
    assert ZWDX(server.url).get_room(submitter)["name"] == "x"
    with pytest.raises(Forbidden, match="donor token"):
        ZWDX(server.url).get_room(donor)
    out = subprocess.run([sys.executable, "-m", "zwdx.cli", "room", "create", "--server", server.url, "--json"],
                         capture_output=True, text=True, check=True).stdout
    made = json.loads(out)
    assert made["token"] == made["submitter_token"] and made["donor_token"].startswith("zd_")


def test_gpu_client_with_a_bad_token_exits_with_a_clear_message(server, tmp_path):
    client = GpuClient(server.url, "zr_bad", str(tmp_path / "bad"))
    assert client.popen.wait(30) == 2
    assert "room token not recognised" in client.output()
