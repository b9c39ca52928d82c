"""The REST API and SDK facing bad input and the wrong people: clear typed errors, nothing lost."""
from __future__ import annotations

import hashlib
import os

import pytest
import requests

import mnist
from procs import Server
from zwdx import ZWDX, AuthError, BadRequest, NotFound, ServerUnreachable
from zwdx.errors import IntegrityError, PayloadTooLarge

H = "X-Zwdx-Room-Token"


def api(server, path):
    return f"{server.url}/api/v1{path}"


def test_health(server):
    resp = requests.get(f"{server.url}/health")
    assert resp.status_code == 200 and resp.json()["status"] == "ok"


def test_room_token_is_shown_once_and_stored_hashed(server, sdk):
    room = sdk.create_room("secret-room")
    assert room["token"].startswith("zr_") and len(room["token"]) > 40
    seen = sdk.get_room(room["token"])
    assert seen["name"] == "secret-room" and "token" not in seen and "token_hash" not in seen
    raw = b""
    for name in os.listdir(server.data_dir):  # the database file and its write-ahead log
        if name.startswith("zwdx.sqlite3"):
            with open(os.path.join(server.data_dir, name), "rb") as fh:
                raw += fh.read()
    assert room["token"].encode() not in raw
    assert hashlib.sha256(room["token"].encode()).hexdigest().encode() in raw


def test_room_create_cli_prints_the_token_last(server):
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "zwdx.cli", "room", "create", "--server", server.url, "--name", "x"],
                         capture_output=True, text=True, check=True).stdout
    token = out.strip().splitlines()[-1]
    assert ZWDX(server.url).get_room(token)["name"] == "x"
    out = subprocess.run([sys.executable, "-m", "zwdx.cli", "room", "create", "--server", server.url, "--json"],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["token"].startswith("zr_")


def test_wrong_or_missing_token_is_refused_everywhere(server, sdk, room):
    with pytest.raises(AuthError, match="not recognised"):
        sdk.list_jobs("zr_wrong")
    with pytest.raises(AuthError, match="not recognised"):
        sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=mnist.train,
                       room_token="zr_wrong", wait=False)
    for method, path in [("get", "/room"), ("get", "/jobs"), ("post", "/artifacts"), ("post", "/jobs"),
                         ("get", "/jobs/abc"), ("get", "/jobs/abc/metrics"), ("get", "/jobs/abc/weights"),
                         ("post", "/jobs/abc/cancel"), ("post", "/jobs/abc/events"), ("get", "/artifacts/abc")]:
        resp = getattr(requests, method)(api(server, path))
        assert resp.status_code == 401, (method, path, resp.text)
        assert resp.json()["error"]["code"] == "unauthorized"


def test_jobs_of_another_room_are_invisible(server, sdk, room, start_client):
    job_id = sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=mnist.train,
                            room_token=room["token"], wait=False)
    other = sdk.create_room("other")
    with pytest.raises(NotFound):
        sdk.get_job(job_id, other["token"])
    with pytest.raises(NotFound):
        sdk.cancel_job(job_id, other["token"])
    assert sdk.list_jobs(other["token"]) == []
    assert [j["id"] for j in sdk.list_jobs(room["token"])] == [job_id]
    assert "job_key_hash" not in sdk.get_job(job_id, room["token"])


def test_rank_writes_need_the_job_key(server, sdk, room):
    job_id = sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=mnist.train,
                            room_token=room["token"], wait=False)
    headers = {H: room["token"]}
    resp = requests.post(api(server, f"/jobs/{job_id}/events"), json={"events": []}, headers=headers)
    assert resp.status_code == 401 and "job key" in resp.json()["error"]["message"]
    resp = requests.post(api(server, f"/jobs/{job_id}/ranks/0"), json={"status": "completed"},
                         headers={**headers, "X-Zwdx-Job-Key": "jk_forged"})
    assert resp.status_code == 403
    assert sdk.get_job(job_id)["status"] == "queued"


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
def test_malformed_job_bodies_get_400_naming_the_field(server, room, body, field):
    headers = {H: room["token"]}
    if isinstance(body, str):
        resp = requests.post(api(server, "/jobs"), data=body, headers={**headers, "Content-Type": "application/json"})
    else:
        resp = requests.post(api(server, "/jobs"), json=body, headers=headers)
    assert resp.status_code == 400, resp.text
    assert field in resp.json()["error"]["message"]
    assert requests.get(api(server, "/jobs"), headers=headers).json()["jobs"] == []


def test_sdk_checks_its_arguments(sdk, room):
    with pytest.raises(BadRequest, match="parallelism"):
        sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=mnist.train,
                       parallelism="TP", room_token=room["token"])
    with pytest.raises(BadRequest, match="train_func must be a function"):
        sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=42,
                       room_token=room["token"])
    with pytest.raises(BadRequest, match="model must be a torch.nn.Module"):
        sdk.submit_job(model="net", data_loader_func=mnist.create_loader, train_func=mnist.train,
                       room_token=room["token"])
    with pytest.raises(BadRequest, match="room token"):
        sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=mnist.train)


def test_unreachable_server_is_a_typed_error():
    from procs import free_port
    with pytest.raises(ServerUnreachable, match="cannot reach"):
        ZWDX(f"http://127.0.0.1:{free_port()}").list_jobs("zr_x")


def test_artifacts_are_checked_by_sha256_and_size(server, room, tmp_path):
    headers = {H: room["token"]}
    resp = requests.post(api(server, "/artifacts"), data=b"abc", headers={**headers, "X-Zwdx-Sha256": "0" * 64})
    assert resp.status_code == 422 and resp.json()["error"]["code"] == IntegrityError.code
    good = hashlib.sha256(b"abc").hexdigest()
    resp = requests.post(api(server, "/artifacts"), data=b"abc", headers={**headers, "X-Zwdx-Sha256": good})
    assert resp.status_code == 201 and resp.json()["sha256"] == good and resp.json()["size"] == 3
    back = requests.get(api(server, f"/artifacts/{resp.json()['id']}"), headers=headers)
    assert back.content == b"abc"

    small = Server(str(tmp_path / "small"), extra=["--max-artifact-bytes", "1000"])
    try:
        token = ZWDX(small.url).create_room()["token"]
        resp = requests.post(f"{small.url}/api/v1/artifacts", data=b"x" * 5000, headers={H: token})
        assert resp.status_code == 413 and resp.json()["error"]["code"] == PayloadTooLarge.code
        leftovers = os.listdir(os.path.join(small.data_dir, "artifacts"))
        assert leftovers == []  # nothing half-written is kept
    finally:
        small.stop()


def test_gpu_client_with_a_bad_token_exits_with_a_clear_message(server, tmp_path):
    from procs import GpuClient
    client = GpuClient(server.url, "zr_bad", str(tmp_path / "bad"))
    assert client.popen.wait(30) == 2
    assert "room token not recognised" in client.output()


def test_job_with_its_new_events_in_one_call(server, sdk, room):
    job_id = sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=mnist.train,
                            room_token=room["token"], wait=False)
    headers = {H: room["token"]}
    resp = requests.get(api(server, f"/jobs/{job_id}"), params={"events_after": 0}, headers=headers)
    assert resp.status_code == 200 and resp.json()["events"] == [] and resp.json()["id"] == job_id
    assert "events" not in requests.get(api(server, f"/jobs/{job_id}"), headers=headers).json()
    resp = requests.get(api(server, f"/jobs/{job_id}"), params={"events_after": "x"}, headers=headers)
    assert resp.status_code == 400 and "events_after" in resp.json()["error"]["message"]
