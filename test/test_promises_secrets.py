"""docs/security.md and docs/sdk.md: room tokens and job keys are secrets.

- after whole jobs (one completed with checkpoints, one failed with tracebacks), no room token
  and no job key is in any log: the server's, the GPU clients', the ranks', nor in what the
  submitter's terminal showed (progress bar and the SDK's logger);
- a room token is stored only as its sha256 on MongoDB too (test_api.py reads the SQLite file).
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import subprocess
import sys

import pytest

from conftest import Api
from procs import ROOT
from store_backends import mongo_server, mongo_uri  # noqa: F401 (fixtures)

#: What any secret the server hands out looks like (``zwdx.server.auth.new_secret``), whoever it belongs
#: to, every kind written out here rather than taken from the product: a submitter token (zs_), a donor
#: token (zd_), an earlier room token (zr_), a rank key (rk_), a GPU client's secret (zc_), an earlier job
#: key (jk_).
SECRET = re.compile(r"\b(zs|zd|zr|rk|zc|jk)_[A-Za-z0-9_-]{20,}")

SUBMITTER = """
import sys, torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from zwdx import ZWDX

def loader(rank, world_size):
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, (x[:, 0] > 0).long())
    return DataLoader(data, batch_size=4, sampler=DistributedSampler(data, world_size, rank, seed=0))

def train(model, loader, optimizer, rank, epochs, reporter):
    for epoch in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            reporter.log_metrics(loss=loss.item())
        reporter.log(f"epoch {epoch} done")
        print(f"rank {rank} printed after epoch {epoch}")
    return loss.item()

def evaluate(model, loader):
    return {"accuracy": 0.5}

def fail(model, loader, rank):
    raise ValueError(f"rank {rank} gives up")

url, token = sys.argv[1], sys.argv[2]
sdk = ZWDX(url)  # remembers the room's token in its credential store, as a submitter's does
sdk.get_logger()  # the SDK's INFO lines printed too
model = torch.nn.Linear(4, 2)
done = sdk.submit_job(model, loader, train, eval_func=evaluate, room_token=token, world_size=2, epochs=2,
                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1), timeout=300)
failed = sdk.submit_job(model, loader, fail, world_size=2, room_token=token, raise_on_failure=False, timeout=300)
sdk.get_trained_model(done["job_id"], torch.nn.Linear(4, 2))  # the job id is enough
print("jobs", done["job_id"], done["status"], failed["job_id"], failed["status"])
"""


@pytest.mark.slow
def test_no_room_token_or_job_key_is_in_any_log_after_whole_jobs(server, room, start_client, tmp_path):
    start_client.together("a", "b")
    run = subprocess.run([sys.executable, "-c", SUBMITTER, server.url, room["token"]], cwd=ROOT, timeout=600,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    terminal = run.stdout + run.stderr
    assert run.returncode == 0, terminal
    done, done_status, failed, failed_status = re.search(r"^jobs (\w+) (\w+) (\w+) (\w+)$", run.stdout, re.M).groups()
    assert (done_status, failed_status) == ("completed", "failed"), terminal

    logs = {os.path.relpath(path, tmp_path): open(path, errors="replace").read()
            for path in glob.glob(str(tmp_path / "**" / "*.log"), recursive=True)}
    # what was read: the server's log, each GPU client's, and each rank's of both jobs
    server_log = logs[os.path.relpath(server.log_path, tmp_path)]
    assert f"job {done}: queued" in server_log and f"job {failed}: failed" in server_log
    for client in ("a", "b"):
        assert f"job {done} rank" in logs[f"{client}/gpu-client.log"]
    ranks = {name: text for name, text in logs.items() if "/jobs/" in name}
    assert sorted(re.sub(r"^([ab])/agents/client-\1/jobs/", "", name) for name in ranks) == sorted(
        f"{job}/rank{r}.log" for job in (done, failed) for r in (0, 1)), sorted(ranks)
    assert any("printed after epoch 1" in text for text in ranks.values())
    assert any("ValueError: rank 1 gives up" in text for text in ranks.values())
    assert "[rank 0] epoch 1 done" in terminal and f"job {done} completed" in terminal  # the bar and the log lines

    # and the secrets themselves, literally: the room's two tokens and each GPU client's own secret
    known = {"submitter token": room["token"], "donor token": room["donor_token"]}
    for path in glob.glob(str(tmp_path / "**" / "secrets" / "*.secret"), recursive=True):
        known[f"client secret {os.path.basename(path)}"] = open(path).read().strip()
    assert sum(name.startswith("client secret") for name in known) == 2, known.keys()
    for where, text in {**logs, "the submitter's terminal": terminal}.items():
        for what, secret in known.items():
            assert secret not in text, f"{where}: the {what}"
        found = SECRET.search(text)
        assert found is None, f"{where}: {text[max(0, found.start() - 200):found.end() + 50]}"


def test_a_room_token_is_stored_only_as_its_sha256_on_mongodb(make_app, mongo_uri):  # noqa: F811
    from pymongo import MongoClient
    app = make_app(MONGO_URI=mongo_uri)
    api = Api(app.test_client()).create_room("hashed")
    token = api.token
    assert api.get("/room").status_code == 200 and api.submit().status_code == 201  # the token in use

    client = MongoClient(mongo_uri, serverSelectionTimeoutMS=5000)
    try:
        db = client.get_default_database()
        # nx-27017 lists GridFS's artifacts.files and .chunks as artifacts_files and _chunks
        names = {name.replace("artifacts_", "artifacts.") for name in db.list_collection_names()}
        stored = {name: list(db[name].find()) for name in names}
    finally:
        client.close()
    assert {"rooms", "credentials", "jobs", "artifacts", "artifacts.files"} <= set(stored), stored.keys()
    raw = json.dumps(stored, default=repr)  # every document of every collection, bytes included
    held = {c["role"]: c["hash"] for c in stored["credentials"]}  # a room's tokens: one record each
    for role, secret in (("submitter", token), ("donor", api.donor)):
        assert secret not in raw and secret.split("_", 1)[1] not in raw, role
        assert held[role] == hashlib.sha256(secret.encode()).hexdigest(), role
