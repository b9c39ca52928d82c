"""Where jobs may go, with a real server and real GPU-client processes (in-process where no GPU
client is needed): what a waiting job says, what the room cannot run at all (said at submit,
refused on request), CPU slots of one host sharing its RAM, and packages missing on GPU clients."""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import pathlib
import platform
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest
import requests
import torch

import mnist
import needs
from procs import wait_until
from workloads import slow_train
import zwdx
from zwdx.bundle import pack, required_modules
from zwdx.protocol import runtime_versions

H = "X-Zwdx-Room-Token"
EXTRA = "zwdx_extra_pkg"  # a package only the test process (and GPU clients told so) can import


def post_job(server, room, blob: bytes, **fields) -> requests.Response:
    """Upload a bundle and create a job from it through the REST API, as the SDK does."""
    headers = {H: room["token"]}
    artifact = requests.post(f"{server.url}/api/v1/artifacts", data=blob,
                             headers={**headers, "X-Zwdx-Sha256": hashlib.sha256(blob).hexdigest()})
    assert artifact.status_code == 201, artifact.text
    body = {"bundle_artifact": artifact.json()["id"], "versions": runtime_versions(),
            "required_modules": required_modules(blob), **fields}
    return requests.post(f"{server.url}/api/v1/jobs", json=body, headers=headers)


def example() -> bytes:
    model = mnist.Net()
    return pack(model, mnist.create_loader, mnist.train, mnist.test, torch.optim.AdamW(model.parameters(), lr=3e-3))


def jobs(server, room) -> list[dict]:
    return requests.get(f"{server.url}/api/v1/jobs", headers={H: room["token"]}).json()["jobs"]


def waiting_reason(sdk, room, job_id: str, *fragments: str) -> str:
    return wait_until(lambda: (r := sdk.get_job(job_id, room["token"]).get("waiting_reason") or "") and
                      all(f in r for f in fragments) and r, 30, what=f"a waiting reason with {fragments}")


def test_the_submit_hint_sees_a_gpu_client_that_joined_a_moment_ago(api, socket_client):
    # the hint reads the room's clients at most every 5 s, and anew after a join or a loss
    assert api.submit(world_size=1).json["unschedulable"] == "the room has no GPU clients online"
    gpu = socket_client("/gpu", api.donor)
    answer = gpu.emit("register", {"client_id": "c1", "hostname": "h", "versions": {"python": platform.python_version()},
                                   "slots": [{"index": 0, "kind": "cpu", "memory_total": 10, "memory_free": 10}]},
                      namespace="/gpu", callback=True)
    assert answer["ok"], answer
    assert api.submit(world_size=1).json["unschedulable"] is None
    gpu.disconnect(namespace="/gpu")
    assert api.submit(world_size=1).json["unschedulable"]  # and a moment after it left, that it left


@pytest.mark.app_config(SCHEDULER=True)  # in-process; the scheduler writes the waiting reason
def test_a_room_without_gpu_clients_says_so_and_refuses_on_request(app, api):
    resp = api.submit(world_size=2, memory_required=3 << 30)
    assert resp.status_code == 201 and resp.json["unschedulable"] == "the room has no GPU clients online"
    job_id = resp.json["id"]
    assert wait_until(lambda: api.get(f"/jobs/{job_id}").json.get("waiting_reason"), 30,
                      what="a waiting reason") == "the room has no GPU clients online"

    resp = api.submit(world_size=2, fail_if_unschedulable=True)
    assert resp.status_code == 409, resp.text
    error = resp.json["error"]
    assert error["code"] == "unschedulable" and "the room has no GPU clients online" in error["message"]
    waiting = api.jobs()
    assert len(waiting) == 1  # only the first job; the refused one's bundle is gone, bytes and metadata
    assert os.listdir(os.path.join(app.config["DATA_DIR"], "artifacts")) == [waiting[0]["spec"]["code"]["bundle_artifact"]]


@pytest.mark.parametrize("fields, message", [
    ({"fail_if_unschedulable": "yes"}, "'fail_if_unschedulable' must be bool"),
    ({"required_modules": "numpy"}, "'required_modules' must be list"),
    ({"required_modules": ["numpy", "not a module"]}, "'required_modules' must be a list of at most"),
    ({"required_modules": [3]}, "'required_modules'"),
    ({"epochs": 0}, "'epochs' must be at least 1"),
])
def test_bad_new_job_fields_get_400_and_change_nothing(api, fields, message):
    resp = api.submit(**fields)
    assert resp.status_code == 400 and message in resp.json["error"]["message"], resp.text
    assert api.jobs() == []


def test_a_gpu_client_with_a_bad_module_list_is_refused_with_the_reason(api, socket_client):
    sio = socket_client("/gpu", api.donor)
    assert sio.is_connected("/gpu")
    base = {"client_id": "bad", "hostname": "h", "versions": {"python": "3.11.7"},
            "slots": [{"index": 0, "kind": "cpu", "memory_total": 1000, "memory_free": 1000}]}
    for wrong, field in [({"modules": "numpy"}, "modules"), ({"modules": ["os", "a b"]}, "modules.1"),
                         ({"host_id": 7}, "host_id"), ({"host_id": "x" * 65}, "host_id")]:
        answer = sio.emit("register", {**base, **wrong}, namespace="/gpu", callback=True)
        assert not answer["ok"] and f"field '{field}'" in answer["error"], answer
    assert api.get("/room").json["clients"] == []  # a refused registration stores nothing
    answer = sio.emit("register", {**base, "host_id": "h1", "modules": ["os", "numpy"]}, namespace="/gpu",
                      callback=True)
    assert answer["ok"], answer
    client = api.get("/room").json["clients"][0]
    assert client["host_id"] == "h1" and "modules" not in client  # hundreds of names: not shown


def test_too_many_ranks_are_said_at_submit_and_the_job_runs_when_a_client_joins(server, sdk, room, start_client):
    start_client("a")
    resp = post_job(server, room, example(), world_size=2, epochs=1)
    assert resp.status_code == 201
    assert resp.json()["unschedulable"].startswith("world_size 2 is more than the 1 slot(s) this room could give")
    assert waiting_reason(sdk, room, resp.json()["id"], "waiting for 2 free slot(s); 1 available")
    refused = post_job(server, room, example(), world_size=2, fail_if_unschedulable=True)
    assert refused.status_code == 409 and "world_size 2" in refused.json()["error"]["message"]
    start_client("b")
    result = sdk.wait(resp.json()["id"], room["token"], progress=False, timeout=240)
    assert result["status"] == "completed" and result["world_size"] == 2


def test_cpu_slots_of_one_host_share_its_ram(server, sdk, room, start_client):
    start_client.together("a", "b")
    info = sdk.get_room(room["token"])
    assert len({c["host_id"] for c in info["clients"]}) == 1  # two GPU clients, one machine
    slots = [s for c in info["clients"] for s in c["slots"]]
    total, free = slots[0]["memory_total"], min(s["memory_free"] for s in slots)
    assert info["totals"]["memory_total"] == total  # its RAM counted once, not once per GPU client
    memory = total // 2 + (256 << 20)  # one rank fits this host, two never do
    if memory > free * 0.9:
        needs.missing(f"free RAM (this host has {free >> 20} of {total >> 20} MiB free; the test needs more than "
                      "half of it)", "run the suite on a host with more than half of its RAM free")

    resp = post_job(server, room, example(), world_size=2, memory_required=memory)
    assert "the 2 CPU slots of host" in resp.json()["unschedulable"]
    assert waiting_reason(sdk, room, resp.json()["id"], "share its RAM", "1 available")
    sdk.cancel_job(resp.json()["id"], room["token"])

    # A rank of one job holds `memory` of this host: the other job waits, though a slot is idle.
    holder = sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=slow_train,
                            resources=zwdx.Resources(world_size=1), training=zwdx.Training(epochs=50),
                            run=zwdx.Run(room_token=room["token"], progress=False), memory_required=memory, wait=False)
    wait_until(lambda: sdk.get_job(holder, room["token"])["status"] == "running", 60, what="the first job running")
    second = post_job(server, room, example(), world_size=1, epochs=1, memory_required=memory)
    assert second.json()["unschedulable"] is None  # it fits the room as such: it waits
    reason = waiting_reason(sdk, room, second.json()["id"], "share its RAM")
    assert "room for 0 rank(s)" in reason
    sdk.cancel_job(holder, room["token"])
    result = sdk.wait(second.json()["id"], room["token"], progress=False, timeout=240)
    assert result["status"] == "completed" and result["world_size"] == 1


@pytest.fixture
def extra_package():
    """A package installed in a site-packages folder that only this process has on its path,
    where every user may read it (GPU clients run as root run jobs as users of their own)."""
    base = tempfile.mkdtemp(prefix="zwdx-extra-", dir="/tmp")
    os.chmod(base, 0o755)
    site = pathlib.Path(base) / "site-packages"
    (site / EXTRA).mkdir(parents=True)
    (site / EXTRA / "__init__.py").write_text("def scale(x):\n    return 2 * x\n")
    sys.path.insert(0, str(site))
    try:
        yield importlib.import_module(EXTRA), str(site)
    finally:
        sys.path.remove(str(site))
        sys.modules.pop(EXTRA, None)
        shutil.rmtree(base, ignore_errors=True)


def train_with(extra):
    def train(model, loader, optimizer, rank, epochs=2):  # no loss; zwdx's default epochs: this one's
        for _ in range(epochs):
            for x, y in loader:
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
        return {"accuracy": extra.scale(0.47), "epochs": epochs}
    return train


def test_a_package_missing_on_gpu_clients_is_named_and_the_job_goes_where_it_is(
        server, sdk, room, start_client, extra_package):
    extra, site = extra_package
    start_client("a")
    model = mnist.Net()
    blob = pack(model, mnist.create_loader, train_with(extra), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert required_modules(blob) == [EXTRA]

    refused = post_job(server, room, blob, world_size=1, fail_if_unschedulable=True)
    assert refused.status_code == 409, refused.text
    message = refused.json()["error"]["message"]
    assert f"gpu client client-a on host {socket.gethostname()} lacks package(s) {EXTRA}" in message
    assert jobs(server, room) == [] and os.listdir(os.path.join(server.data_dir, "artifacts")) == []

    resp = post_job(server, room, blob, world_size=1, name="with-extra")  # no epochs: train's default
    assert EXTRA in resp.json()["unschedulable"]
    reason = waiting_reason(sdk, room, resp.json()["id"], "client-a", socket.gethostname(), EXTRA)
    assert reason.startswith("waiting for 1 free slot(s); 0 available")

    start_client("b", env={"PYTHONPATH": os.pathsep.join([site, os.environ.get("PYTHONPATH", "")])})
    result = sdk.wait(resp.json()["id"], room["token"], progress=False, timeout=240)
    assert result["status"] == "completed" and result["placement"][0]["client_id"] == "client-b"
    assert result["results"] == {"accuracy": 0.94, "epochs": 2}

    history = requests.get(f"{server.url}/api/v1/dashboard/history", headers={H: room["token"]}).json()["jobs"]
    assert [(j["name"], j["result"], j["final_loss"]) for j in history] == \
        [("with-extra", {"name": "accuracy", "value": 0.94}, None)]


def test_a_gpu_client_reports_what_it_can_import_and_which_machine_it_is(tmp_path):
    (tmp_path / "flat_mod.py").write_text("")
    (tmp_path / "ns_pkg" / "part").mkdir(parents=True)  # a namespace package: no __init__.py
    (tmp_path / "ns_pkg" / "part" / "__init__.py").write_text("")
    ask = [sys.executable, "-c", "import json; from gpu_client.agent import host; "
                                 "print(json.dumps([host.host_id(), host.importable_modules()]))"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    first, modules = json.loads(subprocess.run(ask, env=env, capture_output=True, text=True, check=True).stdout)
    assert {"flat_mod", "ns_pkg", "numpy", "json", "sys"} <= set(modules) and "zwdx_extra_pkg" not in modules
    second, _ = json.loads(subprocess.run(ask, capture_output=True, text=True, check=True).stdout)
    assert first == second  # another process of this machine: the same host
    mine, _ = json.loads(subprocess.run(ask, env={**env, "ZWDX_HOST_ID": "box-7"}, capture_output=True, text=True,
                                        check=True).stdout)
    assert mine == "box-7"
