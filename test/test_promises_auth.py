"""docs/security.md: what a room's submitter and donor tokens and a rank key open, and nothing more.

- a dashboard (/ui) of one room never hears another room's jobs, job events or GPU clients,
  and a wrong token, or the room's donor token, is refused;
- a job that has data (metrics, logs, a checkpoint, weights) shows none of it to another
  room's token, the room's donor token, a wrong token or none, whichever route or artifact id
  is asked;
- a rank key opens its own job's rank routes only: not another job's of the same room, not
  another room's; a room token in its place opens none of them.

test/security/test_authorization.py proves, in-process, every route and event against every
kind of credential. Here the jobs are placed and have what a run leaves: one real server process
for the module, and the GPU clients and dashboards played by the test (``donor.py``), so each
test gets its rooms and rank keys in well under a second, without a rank process.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

import pytest
import requests
import socketio
import torch
from safetensors.torch import save as safetensors_save

from digests import state_digest
from donor import Dashboard, Donor, Rank
from procs import Server, wait_until
from zwdx import defaults
from zwdx.protocol import EV_CLIENTS_UPDATE, EV_JOB_EVENTS, EV_JOB_UPDATE, runtime_versions

pytestmark = pytest.mark.slow  # a server process


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Placed jobs whose ranks never report stay placed for minutes (not failed after 25 s); the
    # module's hundred-odd wrong tokens and keys, all from 127.0.0.1, are not rate-limited.
    srv = Server(str(tmp_path_factory.mktemp("auth") / "server"),
                 env={"ZWDX_RESERVE_TIMEOUT": "120", "ZWDX_RATE_LIMIT_AUTH_FAILURES": "10000 per minute"})
    yield srv
    srv.stop()


@pytest.fixture
def donors():
    """start(url, token, client_id, slots=1) -> a Donor, stopped after the test."""
    started: list = []

    def start(*args, **kwargs):
        started.append(Donor(*args, **kwargs))
        return started[-1]
    yield start
    for sock in started:
        sock.stop()


@dataclass
class Room:
    """A room of the module's server, as the holder of its submitter token calls the REST API
    (``donor_token``: what its GPU clients connect with)."""
    url: str
    token: str
    id: str
    donor_token: str

    @classmethod
    def create(cls, url: str, name: str) -> "Room":
        resp = requests.post(f"{url}{defaults.API_PREFIX}/rooms", json={"name": name}, timeout=30)
        assert resp.status_code == 201, resp.text
        return cls(url, resp.json()["token"], resp.json()["id"], resp.json()["donor_token"])

    def call(self, method: str, path: str, token: str | None = "mine", **kwargs) -> requests.Response:
        """``method path`` with this room's token ("mine"), another token, or none (None)."""
        token = self.token if token == "mine" else token
        return requests.request(method, f"{self.url}{defaults.API_PREFIX}{path}", timeout=30,
                                headers={defaults.TOKEN_HEADER: token} if token else {}, **kwargs)

    def submit(self) -> tuple[str, str]:
        """A job of one rank (its bundle is bytes the server never opens): (job id, bundle id)."""
        bundle = self.call("POST", "/artifacts", data=b"a bundle of room " + self.id.encode()).json()["id"]
        resp = self.call("POST", "/jobs", json={"bundle_artifact": bundle, "world_size": 1,
                                                "versions": runtime_versions()})
        assert resp.status_code == 201, resp.text
        return resp.json()["id"], bundle

    def job(self, job_id: str) -> dict:
        return self.call("GET", f"/jobs/{job_id}").json()


def a_wrong_token() -> str:
    return f"zr_{secrets.token_urlsafe(32)}"  # the shape of a real one


# -- dashboards ------------------------------------------------------------------------------------
def test_a_dashboard_hears_only_its_own_rooms_jobs_events_and_gpu_clients(server, donors):
    a, b = Room.create(server.url, "a"), Room.create(server.url, "b")
    for token in (a_wrong_token(), "", a.id, a.donor_token):
        with pytest.raises(socketio.exceptions.ConnectionError):
            Dashboard(server.url, token)
    watch_a, watch_b = Dashboard(server.url, a.token), Dashboard(server.url, b.token)
    try:
        donor = donors(server.url, a.donor_token, "donor-of-a")
        job, _ = a.submit()
        rank = Rank(server.url, donor.rank_key(job), job)
        assert rank.status("running").status_code == 200
        assert rank.events(("metric", {"loss": 0.5}), ("log", {"text": "a line of room a"})).status_code == 200

        wait_until(lambda: watch_a.saw(EV_JOB_EVENTS, lambda p: p["job_id"] == job)
                   and watch_a.saw(EV_JOB_UPDATE, lambda p: p["id"] == job and p["status"] == "running")
                   and watch_a.saw(EV_CLIENTS_UPDATE, lambda p: [c["id"] for c in p["clients"]] == ["donor-of-a"]),
                   30, what=f"room a's dashboard hearing its job and GPU client: {watch_a.received}")
        # then something of room b: its dashboard hears that, and none of room a before or after it
        other, _ = b.submit()
        wait_until(lambda: watch_b.saw(EV_JOB_UPDATE, lambda p: p["id"] == other), 30,
                   what=f"room b's dashboard hearing its own job: {watch_b.received}")
        heard_by_b = json.dumps(watch_b.received)
        for secret_of_a in (job, a.id, "donor-of-a", "a line of room a"):
            assert secret_of_a not in heard_by_b, (secret_of_a, watch_b.received)
        assert {name for name, _ in watch_b.received} <= {EV_JOB_UPDATE, EV_CLIENTS_UPDATE}
        assert not watch_a.saw(EV_JOB_UPDATE, lambda p: p["id"] == other)
    finally:
        watch_a.disconnect()
        watch_b.disconnect()


# -- a job's data ----------------------------------------------------------------------------------
def a_job_with_data(server, room: Room, donors) -> dict:
    """A completed job of ``room`` with a metric, a log line, a checkpoint and weights."""
    donor = donors(server.url, room.donor_token, f"donor-{room.id}")
    job, bundle = room.submit()
    rank = Rank(server.url, donor.rank_key(job), job)
    # real weights, whose fingerprint is the rank's (the server checks the one against the other)
    trained = {"w": torch.full((2,), float(int(job[:6], 16) % 97))}
    weights, state = safetensors_save(trained), b"checkpoint of " + job.encode()
    assert rank.status("running").status_code == 200
    assert rank.events(("metric", {"loss": 0.25}), ("log", {"text": "a private line"})).status_code == 200
    checkpoint_file = rank.put("/checkpoints/0/state.pt", state).json()["id"]
    assert rank.put("/checkpoints/0/rng-0.pt", b"generators").status_code == 201
    assert rank.commit(0, ["state.pt", "rng-0.pt"]).status_code == 201
    weights_id = rank.put("/weights", weights).json()["id"]
    assert rank.status("completed", final_loss=0.25, results={"final_loss": 0.25},
                       fingerprint=state_digest(trained), weights_artifact=weights_id).status_code == 200
    donor.exited(job)
    record = room.job(job)
    assert record["status"] == "completed" and record["warnings"] == [] and record["suspects"] == {}, record
    return {"id": job, "bundle": bundle, "weights": weights_id, "checkpoint_file": checkpoint_file,
            "bytes": {weights_id: weights, checkpoint_file: state}}


def reads_of(job: dict) -> list[str]:
    """Every GET that shows something of the job."""
    j = job["id"]
    return [f"/jobs/{j}", f"/jobs/{j}?events_after=0", f"/jobs/{j}/events", f"/jobs/{j}/events?kind=log",
            f"/jobs/{j}/metrics", f"/jobs/{j}/weights", f"/jobs/{j}/checkpoints", f"/jobs/{j}/checkpoints/0/state.pt",
            f"/artifacts/{job['weights']}", f"/artifacts/{job['checkpoint_file']}", f"/artifacts/{job['bundle']}"]


def test_another_rooms_token_a_donor_token_a_wrong_one_or_none_read_nothing_of_a_jobs_data(server, donors):
    a, b = Room.create(server.url, "owner"), Room.create(server.url, "neighbour")
    job = a_job_with_data(server, a, donors)
    before = {path: a.call("GET", path).content for path in reads_of(job)}

    for path in reads_of(job):
        resp = b.call("GET", path)
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found", (path, resp.text)
        assert not any(data in resp.content for data in job["bytes"].values())
        for token, status, says in [(a_wrong_token(), 401, "not recognised"), (None, 401, "needs a room token"),
                                    (a.donor_token, 403, "donor token"), (b.donor_token, 403, "donor token")]:
            resp = a.call("GET", path, token=token)
            assert resp.status_code == status and says in resp.json()["error"]["message"], (path, token, resp.text)
            assert not any(data in resp.content for data in job["bytes"].values())
    for path in ("/jobs", "/dashboard/history", "/room"):  # lists: the neighbour's own, without the job
        resp = b.call("GET", path)
        assert resp.status_code == 200 and job["id"] not in resp.text and a.id not in resp.text, (path, resp.text)
    resp = b.call("POST", f"/jobs/{job['id']}/cancel")
    assert resp.status_code == 404, resp.text

    # the owner reads it all, as it was
    assert {path: a.call("GET", path).content for path in reads_of(job)} == before
    for artifact_id, data in job["bytes"].items():
        assert a.call("GET", f"/artifacts/{artifact_id}").content == data
    assert a.call("GET", f"/jobs/{job['id']}/weights").content == job["bytes"][job["weights"]]
    assert [e["data"] for e in a.call("GET", f"/jobs/{job['id']}/events?kind=log").json()["events"]] == \
        [{"text": "a private line"}]


# -- rank keys ---------------------------------------------------------------------------------------
def rank_calls(rank: Rank) -> dict:
    """Every call a rank makes with its key: name -> response."""
    return {"status": rank.status("running"), "events": rank.events(("log", {"text": "written by the wrong rank"})),
            "checkpoint file": rank.put("/checkpoints/0/state.pt", b"forged state"),
            "checkpoint rng": rank.put("/checkpoints/0/rng-0.pt", b"forged generators"),
            "checkpoint commit": rank.commit(0, ["state.pt", "rng-0.pt"]), "weights": rank.put("/weights", b"forged weights"),
            "bundle": rank.bundle()}


def test_a_rank_key_opens_its_own_jobs_rank_routes_only(server, donors):
    a, b = Room.create(server.url, "keys-a"), Room.create(server.url, "keys-b")
    donor_a = donors(server.url, a.donor_token, "keys-a-donor", slots=2)
    donor_b = donors(server.url, b.donor_token, "keys-b-donor")
    first, _ = a.submit()
    second, second_bundle = a.submit()
    elsewhere, _ = b.submit()
    key = donor_a.rank_key(first)
    second_key, elsewhere_key = donor_a.rank_key(second), donor_b.rank_key(elsewhere)
    assert len({key, second_key, elsewhere_key}) == 3

    refused = {  # case -> (the calls, status, error code)
        "job A's key on job B of its room": (Rank(server.url, key, second), 403, "forbidden"),
        "job A's key on a job of another room": (Rank(server.url, key, elsewhere), 403, "forbidden"),
        "another room's job's key on job B": (Rank(server.url, elsewhere_key, second), 403, "forbidden"),
        "the room's submitter token instead of a key": (Rank(server.url, None, second, token=a.token), 401,
                                                        "unauthorized"),
    }
    for case, (rank, status, code) in refused.items():
        for call, resp in rank_calls(rank).items():
            assert resp.status_code == status, (case, call, resp.text)
            assert resp.json()["error"]["code"] == code, (case, call)

    # nothing of it was stored: both jobs are as their placement left them
    for room, job_id in ((a, second), (b, elsewhere)):
        job = room.job(job_id)
        assert job["status"] == "starting" and not job.get("latest_checkpoint") and not job.get("weights_artifact")
        assert room.call("GET", f"/jobs/{job_id}/events").json()["events"] == []
        assert room.call("GET", f"/jobs/{job_id}/checkpoints").json()["checkpoints"] == []
        assert room.call("GET", f"/jobs/{job_id}/weights").status_code == 404

    # and the refused calls were well formed: with job B's own key, the same calls go through
    done = rank_calls(Rank(server.url, second_key, second))
    assert {call: resp.status_code for call, resp in done.items()} == {
        "status": 200, "events": 200, "checkpoint file": 201, "checkpoint rng": 201, "checkpoint commit": 201, "weights": 201, "bundle": 200}
    assert done["bundle"].content == a.call("GET", f"/artifacts/{second_bundle}").content
    assert a.job(second)["status"] == "running"
