"""Attacks on what a job runs and what it goes on from (the trust issue's items 3 and 4, and
the commit part of 11), each replayed and shown to fail:

- bundle cache poisoning: one agent's job overwrites the bundle another agent of the same user
  cached for its room; the poisoned file is fetched again, never run (``gpu_client/agent/workspace.py``,
  ``zwdx.bundle.load``);
- a forged checkpoint: a donor commits ``format: dcp`` with a pickled ``.metadata``; the commit is
  refused, and the job resumed on an honest donor unpickles nothing (``zwdx/server/checkpoints.py``,
  ``gpu_client/rank/checkpoint.py``);
- empty and partial commits: a rank's key cannot wipe or replace a good checkpoint.

In-process apps over both stores for the server's rules; real server and GPU-client processes
for the attacks end to end.
"""
from __future__ import annotations

import glob
import hashlib
import os
import pickle
import platform
import signal
import stat
import struct

import pytest
import requests
import torch

from conftest import Api
from procs import GpuClient, wait_until
from store_backends import *  # noqa: F401,F403  (fixtures: backend, mongo_uri, ...)
import zwdx
from zwdx import ZWDX, defaults
from zwdx.bundle import MAGIC, load, pack, required_modules, unpack
from zwdx.protocol import runtime_versions

PY = platform.python_version()


@pytest.fixture
def backend_app(backend, make_app, tmp_path):
    """An in-process app over the backend's store (artifact bytes in files, or GridFS)."""
    if backend.name == "sqlite":
        return make_app(DATA_DIR=backend.where)
    return make_app(DATA_DIR=str(tmp_path / "mongo-app"), MONGO_URI=backend.where)


# -- payloads ------------------------------------------------------------------------------------
class _Writes:
    """Unpickled, it writes ``marker``: the stand-in for any code a pickle can run."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('unpickled')",)


def evil_pickle(marker: str) -> bytes:
    return pickle.dumps(_Writes(marker), protocol=4)


def poisoned_bundle(marker: str) -> bytes:
    """Bytes in a bundle's layout whose pickle writes ``marker`` when it is loaded."""
    pickled = evil_pickle(marker)
    head = MAGIC + struct.pack("<QQ", len(pickled), 1) + pickled + struct.pack("<Q", 0)
    return head + b"\0" * (-len(head) % 64)


def private(path: str) -> bool:
    return stat.S_IMODE(os.stat(path).st_mode) == 0o700


# -- item 3: the bundle a rank loads is the job's ----------------------------------------------------
def tiny_loader(rank):
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 2), torch.zeros(4, 2)),
                                       batch_size=2)


def honest_train(model, loader):
    return 0.5


def overwriting_train(root: str, poison: bytes):
    """Room A's job: it overwrites every cached bundle it finds under the donors' work dir."""
    def train(model, loader):
        hit = 0
        for path in glob.glob(os.path.join(root, "**", "*.zwdx"), recursive=True):
            with open(path, "wb") as fh:
                fh.write(poison)
            hit += 1
        return float(hit)
    return train


def test_a_bundle_file_that_is_not_the_jobs_is_never_unpickled(tmp_path):
    marker = str(tmp_path / "ran")
    with pytest.raises(ValueError):  # what an unchecked load of the poisoned bytes does: it runs them
        unpack(poisoned_bundle(marker))
    assert os.path.exists(marker)
    os.unlink(marker)

    blob = pack(torch.nn.Linear(2, 2), tiny_loader, honest_train)
    sha = hashlib.sha256(blob).hexdigest()
    path = tmp_path / "cached.zwdx"
    for bad in (poisoned_bundle(marker), blob[:-100], blob + b"more", b""):
        path.write_bytes(bad)
        with pytest.raises(ValueError, match="not the job's bundle|empty"):
            load(str(path), sha)
        assert not os.path.exists(marker)
    path.write_bytes(blob)
    assert load(str(path), sha)["train_func"](None, None) == 0.5


def test_a_cached_bundle_is_checked_on_every_use_and_each_agent_keeps_its_own(tmp_path):
    from gpu_client.agent.workspace import Workspace
    root = str(tmp_path / "home")
    a, b = Workspace(root, "agent-a"), Workspace(root, "agent-b")
    again = Workspace(root, "agent-a")  # a second agent with the same id while the first runs
    assert len({a.dir, b.dir, again.dir}) == 3 and all(private(w.dir) for w in (a, b, again))
    assert private(a.job_dir("job1")) and private(a.bundles)

    blob = pack(torch.nn.Linear(2, 2), tiny_loader, honest_train)
    sha = hashlib.sha256(blob).hexdigest()
    assert not b.cached(sha)
    path = b.keep_bundle(sha, [blob[:10], blob[10:]], "bundle")
    assert b.cached(sha) and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    for bad in (poisoned_bundle(str(tmp_path / "ran")), blob[:-1]):
        with open(path, "wb") as fh:  # another agent's job, as the same OS user
            fh.write(bad)
        assert not b.cached(sha) and not os.path.exists(path)  # fetched again, not run
        b.keep_bundle(sha, [blob], "bundle")
    with pytest.raises(IOError, match="corrupted"):
        b.keep_bundle(sha, [b"not it"], "bundle")
    assert b.cached(sha) and not glob.glob(os.path.join(b.bundles, "*.part"))
    for w in (a, b, again):
        w.close()


def submit_bundle(url: str, token: str, blob: bytes) -> str:
    headers = {defaults.TOKEN_HEADER: token}
    artifact = requests.post(f"{url}{defaults.API_PREFIX}/artifacts", data=blob, headers=headers, timeout=30)
    assert artifact.status_code == 201, artifact.text
    job = requests.post(f"{url}{defaults.API_PREFIX}/jobs", headers=headers, timeout=30, json={
        "bundle_artifact": artifact.json()["id"], "versions": runtime_versions(), "world_size": 1,
        "required_modules": required_modules(blob)})
    assert job.status_code == 201, job.text
    return job.json()["id"]


def test_one_rooms_job_cannot_poison_the_bundle_another_rooms_agent_cached(server, tmp_path):
    sdk = ZWDX(server.url, remember=False)
    room_a, room_b = sdk.create_room("a"), sdk.create_room("b")
    root, marker = str(tmp_path / "donor-home"), str(tmp_path / "ran")  # two agents of one OS user
    # Job code as that user (--isolation process): what a per-job user could not even reach
    # (test_donors.py), the sha256 check must stop on its own.
    agents = [GpuClient(server.url, room[key], str(tmp_path / name), client_id=name,
                        extra=["--work-dir", root, "--isolation", "process"])
              for name, room, key in (("agent-a", room_a, "donor_token"), ("agent-b", room_b, "donor_token"))]
    try:
        def done(room, job_id):
            job = wait_until(lambda: (j := ZWDX(server.url, room_token=room["token"], remember=False).get_job(job_id))
                             ["status"] in ("completed", "failed", "cancelled") and j, 180, what=f"job {job_id}")
            assert not os.path.exists(marker), "the poisoned bundle ran"
            assert job["status"] == "completed", (job.get("reason"), job.get("failures"))
            return job

        honest = pack(torch.nn.Linear(2, 2), tiny_loader, honest_train)
        sha = hashlib.sha256(honest).hexdigest()
        done(room_b, submit_bundle(server.url, room_b["token"], honest))
        cached = os.path.join(root, "agents", "agent-b", "bundles", f"{sha}.zwdx")
        assert os.path.exists(cached)

        attack = pack(torch.nn.Linear(2, 2), tiny_loader, overwriting_train(root, poisoned_bundle(marker)))
        overwritten = done(room_a, submit_bundle(server.url, room_a["token"], attack))
        assert overwritten["final_loss"] >= 1  # it did reach room B's cached bundle
        with open(cached, "rb") as fh:
            assert hashlib.sha256(fh.read()).hexdigest() != sha

        again = done(room_b, submit_bundle(server.url, room_b["token"], honest))
        assert again["final_loss"] == 0.5 and not os.path.exists(marker)
        with open(cached, "rb") as fh:  # fetched again
            assert hashlib.sha256(fh.read()).hexdigest() == sha
        for name, job_id in (("agent-b", again["id"]), ("agent-a", overwritten["id"])):
            own = os.path.join(root, "agents", name)
            assert private(own) and private(os.path.join(own, "jobs", job_id))
    finally:
        for agent in agents:
            agent.stop()


# -- item 4: the server decides what a checkpoint is ------------------------------------------------
def placed(app, name: str, world: int = 2, parallelism: str = "DDP") -> tuple[Api, dict[int, Api], dict]:
    """A room of ``app`` with a job of ``world`` ranks placed as the scheduler places it, each
    rank on a GPU client of its own under a key the test holds: the room's Api, each rank's Api
    (its key alone), the job."""
    room = Api(app.test_client()).create_room(name)
    bundle = room.upload(f"bundle of {name}".encode())
    job = room.post("/jobs", json={"bundle_artifact": bundle["id"], "versions": {"python": PY}, "world_size": world,
                                   "parallelism": parallelism}).json
    ctx = app.extensions["zwdx"]
    for rank in range(world):
        ctx.store.upsert_client({"id": f"{name}-{rank}", "room_id": room.room["id"], "hostname": name,
                                 "status": "online"},
                                [{"id": f"{name}-{rank}:0", "client_id": f"{name}-{rank}", "room_id": room.room["id"],
                                  "index": 0, "kind": "cpu"}])
    place(app, job["id"], name, world, attempt_key="a")
    return room, {r: room.as_(None, rank_key=f"rk_{name}_a_{r}") for r in range(world)}, job


def place(app, job_id: str, name: str, world: int, attempt_key: str) -> None:
    from zwdx.protocol import SlotKind
    from zwdx.protocol.job import PlacementEntry
    from zwdx.server.auth import hash_secret
    from zwdx.server.jobs import Job
    placement = [PlacementEntry(rank=r, client_id=f"{name}-{r}", gpu_index=0, kind=SlotKind.CPU) for r in range(world)]
    keys = {r: hash_secret(f"rk_{name}_{attempt_key}_{r}") for r in range(world)}
    assert Job.load(app.extensions["zwdx"].store, job_id).start(placement, [f"{name}-{r}:0" for r in range(world)], keys)


def stored(app, job_id: str, files: bool = True) -> dict:
    """What the store holds of the job's checkpoints: its record's, and (``files``) every
    checkpoint file's id, or else the bytes of the committed ones."""
    ctx = app.extensions["zwdx"]
    job = ctx.store.get_job(job_id)
    held = {"checkpoints": [c.model_dump() for c in job.checkpoints],
            "latest": job.latest_checkpoint.model_dump() if job.latest_checkpoint else None}
    if files:
        return {**held, "files": sorted(a["id"] for a in ctx.store.list_artifacts(job_id, "checkpoint"))}
    return {**held, "bytes": {i: b"".join(ctx.artifacts.open(i)) for c in job.checkpoints for i in c.files.values()}}


def refused(resp, status: int, field: str | None = None) -> None:
    assert resp.status_code == status, resp.get_data(as_text=True)
    if field is not None:
        assert resp.json["error"]["field"] == field, resp.json


def test_a_checkpoint_is_of_the_format_the_jobs_parallelism_writes(backend_app):
    for parallelism, foreign in (("DDP", ["shard-0.json", "shard-0.safetensors", ".metadata", "__0_0.distcp"]),
                                 ("FSDP", ["state.pt", "rng-0.pt", "extra.pt", ".metadata", "__0_0.distcp"])):
        room, ranks, job = placed(backend_app, parallelism.lower(), parallelism=parallelism)
        before = stored(backend_app, job["id"])
        for name in foreign:
            refused(ranks[0].put(f"/jobs/{job['id']}/checkpoints/0/{name}", data=b"x"), 400, "name")
        mine = {"DDP": "rng-1.pt", "FSDP": "shard-1.json"}[parallelism]  # rank 1's, sent by rank 0
        refused(ranks[0].put(f"/jobs/{job['id']}/checkpoints/0/{mine}", data=b"x"), 403)
        if parallelism == "DDP":
            refused(ranks[1].put(f"/jobs/{job['id']}/checkpoints/0/state.pt", data=b"x"), 403)
        for fmt in ("dcp", "shards" if parallelism == "DDP" else "torch"):
            refused(ranks[0].post(f"/jobs/{job['id']}/checkpoints/0/commit", json={"files": ["x.pt"], "format": fmt}),
                    400, "format")
        assert stored(backend_app, job["id"]) == before == {"checkpoints": [], "latest": None, "files": []}


def test_a_forged_dcp_checkpoint_is_refused_and_nothing_of_it_stored(backend_app, tmp_path):
    marker = str(tmp_path / "ran")
    room, ranks, job = placed(backend_app, "forged", parallelism="FSDP")
    usage = room.get("/room").json["usage"]
    metadata = ranks[0].put(f"/jobs/{job['id']}/checkpoints/1/.metadata", data=evil_pickle(marker))
    refused(metadata, 400, "name")
    assert "shards" in metadata.json["error"]["message"]
    commit = ranks[0].post(f"/jobs/{job['id']}/checkpoints/1/commit", json={"files": [".metadata"], "format": "dcp"})
    refused(commit, 400, "format")
    refused(ranks[0].post(f"/jobs/{job['id']}/checkpoints/1/commit", json={"files": [".metadata"]}), 400, "files")
    assert stored(backend_app, job["id"]) == {"checkpoints": [], "latest": None, "files": []}
    assert room.get("/room").json["usage"] == usage and not os.path.exists(marker)


def test_a_resumed_rank_reads_no_checkpoint_of_another_format(tmp_path):
    """A record of an earlier version (``dcp``), or any other format than the job's, is refused
    before any of its files is fetched (the scheduler hands none such: ``resumable``)."""
    from gpu_client.rank.checkpoint import Checkpointer
    from zwdx.protocol import Parallelism
    from zwdx.protocol.checkpoint import resumable
    from zwdx.protocol.job import CheckpointEntry
    for parallelism, entry in (("FSDP", {"format": "dcp", "files": {".metadata": "a1", "__0_0.distcp": "a2"}}),
                               ("FSDP", {"format": "torch", "files": {"state.pt": "a1", "rng-0.pt": "a2"}}),
                               ("DDP", {"format": "shards", "files": {"shard-0.json": "a1",
                                                                      "shard-0.safetensors": "a2"}})):
        latest = CheckpointEntry.model_validate({"n": 3, "world_size": 1, **entry})
        assert not resumable(latest, parallelism)
        checkpointer = Checkpointer(None, None, None, Parallelism(parallelism), 0, 1, torch.device("cpu"), latest)
        with pytest.raises(ValueError, match=f"a {parallelism} job reads only"):
            checkpointer.restore()  # no reporter: it would fail on the first download


def test_a_ddp_checkpoint_file_is_read_with_torchs_own_allowlist_only(tmp_path):
    """Even with the job's code widening ``weights_only`` (``add_safe_globals``), a rank's file
    holding anything but data is refused, and nothing of it runs."""
    from gpu_client.rank.checkpoint import plain_load
    marker, path = str(tmp_path / "ran"), str(tmp_path / "state.pt")
    torch.save({"model": {"w": torch.ones(2)}, "optimizer": _Writes(marker)}, path)
    with pytest.raises(pickle.UnpicklingError):
        plain_load(path)
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals([exec])  # what a library of the job's might do
    try:
        with pytest.raises(pickle.UnpicklingError):
            plain_load(path)
        assert exec in torch.serialization.get_safe_globals()  # given back as it was
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
    assert not os.path.exists(marker)
    torch.save({"model": {"w": torch.ones(2)}, "optimizer": None}, path)
    assert torch.equal(plain_load(path)["model"]["w"], torch.ones(2))


# -- item 11: a rank's key cannot wipe a good checkpoint ---------------------------------------------
DDP_FILES = {"state.pt": 0, "rng-0.pt": 0, "rng-1.pt": 1}


def upload(ranks: dict[int, Api], job_id: str, n: int, files: dict[str, int], tag: str = "") -> None:
    for name, rank in files.items():
        resp = ranks[rank].put(f"/jobs/{job_id}/checkpoints/{n}/{name}", data=f"{name} of {n}{tag}".encode())
        assert resp.status_code == 201, resp.get_data(as_text=True)


def test_an_empty_or_partial_commit_wipes_no_checkpoint(backend_app):
    room, ranks, job = placed(backend_app, "wipe")
    jid = job["id"]
    upload(ranks, jid, 0, DDP_FILES)
    good = ranks[0].post(f"/jobs/{jid}/checkpoints/0/commit", json={"files": sorted(DDP_FILES), "epoch": 0})
    assert good.status_code == 201 and good.json["format"] == "torch", good.get_data(as_text=True)
    before = stored(backend_app, jid, files=False)

    commit = lambda n, files, rank=0: ranks[rank].post(f"/jobs/{jid}/checkpoints/{n}/commit",  # noqa: E731
                                                       json={"files": files})
    refused(commit(1, []), 400, "files")                                         # empty
    refused(commit(1, ["state.pt"]), 400, "files")                               # no rank's generators
    refused(commit(1, ["state.pt", "rng-0.pt"]), 400, "files")                   # rank 1's missing
    upload(ranks, jid, 1, {"state.pt": 0, "rng-0.pt": 0})
    missing = commit(1, sorted(DDP_FILES))                                       # named, never uploaded
    refused(missing, 400, "files")
    assert missing.json["error"]["missing"] == ["rng-1.pt"]
    refused(commit(1, [*sorted(DDP_FILES), "extra.pt"]), 400, "files")           # extra.pt never uploaded
    refused(commit(1, [*sorted(DDP_FILES), "other.pt"]), 400, "files")           # no file of the format
    upload(ranks, jid, 1, {"rng-1.pt": 1})
    refused(commit(1, sorted(DDP_FILES), rank=1), 403)                           # only rank 0 commits
    refused(commit(0, sorted(DDP_FILES)), 409)                                   # committed: never changes
    refused(ranks[0].put(f"/jobs/{jid}/checkpoints/0/state.pt", data=b"wiped"), 409)
    assert stored(backend_app, jid, files=False) == before
    assert room.get(f"/jobs/{jid}/checkpoints/0/state.pt").data == b"state.pt of 0"

    # A new attempt: the files of the one before do not count, and the good checkpoint stays
    from zwdx.server.jobs import Job
    store = backend_app.extensions["zwdx"].store
    assert Job.load(store, jid).interrupt("a gpu client was lost")
    store.release_slots(jid)
    place(backend_app, jid, "wipe", 2, attempt_key="b")
    fresh = {r: room.as_(None, rank_key=f"rk_wipe_b_{r}") for r in range(2)}
    refused(ranks[0].post(f"/jobs/{jid}/checkpoints/1/commit", json={"files": sorted(DDP_FILES)}), 403)
    upload(fresh, jid, 1, {"state.pt": 0, "rng-0.pt": 0}, tag=" (b)")
    stale = fresh[0].post(f"/jobs/{jid}/checkpoints/1/commit", json={"files": sorted(DDP_FILES)})
    refused(stale, 400, "files")
    assert stale.json["error"]["missing"] == ["rng-1.pt"]  # attempt 1's rank 1 sent one; it does not count
    assert room.get(f"/jobs/{jid}/checkpoints").json["checkpoints"] == before["checkpoints"]
    upload(fresh, jid, 1, {"rng-1.pt": 1}, tag=" (b)")
    assert fresh[0].post(f"/jobs/{jid}/checkpoints/1/commit", json={"files": sorted(DDP_FILES)}).status_code == 201
    assert [c["n"] for c in room.get(f"/jobs/{jid}/checkpoints").json["checkpoints"]] == [0, 1]
    assert room.get(f"/jobs/{jid}/checkpoints/1/rng-1.pt").data == b"rng-1.pt of 1 (b)"
    assert stored(backend_app, jid, files=False)["bytes"] == {**before["bytes"], **{
        i: f"{name} of 1 (b)".encode() for name, i in room.get(f"/jobs/{jid}/checkpoints").json["checkpoints"][1]
        ["files"].items()}}
    assert len(stored(backend_app, jid)["files"]) == 6  # attempt 1's files of checkpoint 1 are gone


# -- item 4 end to end: a forged checkpoint on resume ----------------------------------------------------
def forging_train(evil: bytes, pause: float):
    """MNIST's loop, slowed; on its first attempt, rank 0 (the donor that forges) uploads a
    pickled ``.metadata`` and commits it as a ``dcp`` checkpoint, and commits a checkpoint of
    its own files only, saying in the job's log what the server answered."""
    def train(model, loader, optimizer, rank, epochs, reporter, device):
        import time as clock
        import torch.nn.functional as F
        loss = torch.tensor(0.0)
        for epoch in range(reporter.start_epoch, epochs):
            loader.sampler.set_epoch(epoch)
            if epoch == 1 and rank == 0 and reporter.resume is None:
                url = f"{reporter.base}/checkpoints/50"
                put = reporter.session.put(f"{url}/.metadata", data=evil)
                dcp = reporter.session.post(f"{url}/commit", json={"files": [".metadata"], "format": "dcp"})
                mine = reporter.session.put(f"{url}/shard-0.json", data=evil)
                alone = reporter.session.post(f"{url}/commit", json={"files": ["shard-0.json"]})
                reporter.log(f"forged: upload {put.status_code} commit {dcp.status_code} own shard "
                             f"{mine.status_code} partial commit {alone.status_code}")
            for x, y in loader:
                x, y = x.to(device), y.to(device)
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                clock.sleep(pause)
        return loss.item()
    return train


def test_a_donors_forged_dcp_checkpoint_runs_nothing_when_the_job_resumes(sdk, room, start_client, tmp_path):
    import mnist
    marker = str(tmp_path / "ran")
    clients = start_client.together("a", "b")
    model = mnist.Net()
    job_id = sdk.submit_job(model=model, data_loader_func=mnist.create_loader,
                            train_func=forging_train(evil_pickle(marker), 0.05),
                            optimizer=torch.optim.SGD(model.parameters(), lr=0.02),
                            resources=zwdx.Resources(world_size=2), training=zwdx.Training(epochs=5),
                            run=zwdx.Run(room_token=room["token"], progress=False, recovery=zwdx.Recovery(min_world_size=1)),
                            parallelism="FSDP", wait=False)

    def forged():
        lines = [line["text"] for line in sdk.get_job_logs(job_id) if "forged:" in line["text"]]
        return lines[0] if lines else None
    line = wait_until(forged, 120, what="the forged commit")
    assert "upload 400 commit 400 own shard 201 partial commit 400" in line, line
    job = wait_until(lambda: (j := sdk.get_job(job_id)).get("latest_checkpoint") and
                     j["latest_checkpoint"]["epoch"] >= 1 and j, 120, what="a checkpoint of epoch 1")
    rank0 = next(p["client_id"] for p in job["placement"] if p["rank"] == 0)
    forger = next(c for c in clients if c.client_id == rank0)
    forger.kill(signal.SIGKILL)  # the honest donor goes on alone, from the last checkpoint
    result = sdk.wait(job_id, progress=False, timeout=300)
    assert result["status"] == "completed", result["reason"]
    job = sdk.get_job(job_id)
    assert job["restarts"] == 1 and job["world_size"] == 1
    resumed_from = job["restart_history"][0]["from_checkpoint"]
    assert resumed_from["format"] == "shards" and resumed_from["world_size"] == 2 and resumed_from["n"] < 50
    assert all(c["format"] == "shards" and c["n"] < 50 for c in job["checkpoints"])
    assert any("resumed from checkpoint" in line["text"] for line in sdk.get_job_logs(job_id))
    assert not os.path.exists(marker)
