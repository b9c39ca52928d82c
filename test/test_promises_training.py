"""docs/sdk.md and docs/functions.md: what a job's code is given and what the submitter
sees of it, each on a tiny model and a few steps.

- ``reporter.log(text)`` lines are in ``get_job_logs``, by rank;
- ``keep_checkpoints``: only the last N checkpoints, and their files, remain;
- a ``(train_loader, eval_loader)`` pair: ``eval_func`` gets the eval loader;
- the optimizer is rebuilt with every param group's settings (DDP and FSDP);
- the progress bar of ``submit_job`` shows the job id, its status, the latest metrics and the
  ranks' log lines;
- ``collective_timeout``: a job whose rank hangs in a collective fails within about that timeout.

(``throughput`` and ``gpu_utilization`` in ``get_job_metrics`` are test_runner.py's.)
The module's jobs share one server and two GPU clients (CPU slots).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import requests
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from gpu_pool import GpuPool
from procs import ROOT
import zwdx
from zwdx import defaults

pytestmark = pytest.mark.slow  # a server and GPU-client processes


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    pool = GpuPool(str(tmp_path_factory.mktemp("training")))
    yield pool
    pool.stop()


# -- what the jobs run -------------------------------------------------------------------------------
def tiny_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def tiny_loader(rank, world_size):
    """16 samples in batches of 4, split over the ranks."""
    data = tiny_data(16, seed=0)
    return DataLoader(data, batch_size=4, sampler=DistributedSampler(data, world_size, rank, seed=0))


def train_and_eval_loaders(rank, world_size):
    """(train, eval) of different sizes: 48 training samples in batches of 8, 20 held out in
    batches of 5 (one rank)."""
    return DataLoader(tiny_data(48, seed=1), batch_size=8), DataLoader(tiny_data(20, seed=2), batch_size=5)


def steps(model, loader, optimizer, epochs=1):
    """Plain training over ``epochs`` full passes (each one ends with a checkpoint)."""
    loss = torch.tensor(0.0)
    for _epoch in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
    return loss.item()


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(4, 2)


# -- reporter.log ------------------------------------------------------------------------------------
def say_three_lines(model, loader, rank, reporter):
    for i in range(3):
        reporter.log(f"line {i} of rank {rank}")
    return {"loss": 0.0}


def test_reporter_log_lines_are_in_the_jobs_logs_by_rank(pool):
    result = pool.sdk.submit_job(tiny_model(), tiny_loader, say_three_lines, resources=zwdx.Resources(world_size=2),
                                 run=zwdx.Run(progress=False, timeout=300))
    assert result["status"] == "completed", result.get("reason")
    said = [(line["rank"], line["text"]) for line in pool.sdk.get_job_logs(result["job_id"])
            if line["text"].startswith("line ")]
    for rank in (0, 1):
        assert [text for r, text in said if r == rank] == [f"line {i} of rank {rank}" for i in range(3)], said
    assert len(said) == 6


def rest(pool, path: str) -> requests.Response:
    return requests.get(f"{pool.server.url}{defaults.API_PREFIX}{path}", headers={defaults.TOKEN_HEADER: pool.token},
                        timeout=30)


# -- keep_checkpoints --------------------------------------------------------------------------------
def test_only_the_last_keep_checkpoints_and_their_files_remain(pool):
    artifacts = os.path.join(pool.server.data_dir, "artifacts")
    before = set(os.listdir(artifacts))
    model = tiny_model()
    result = pool.sdk.submit_job(model, tiny_loader, steps, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                 resources=zwdx.Resources(world_size=1), training=zwdx.Training(epochs=5),
                                 run=zwdx.Run(progress=False, timeout=300, recovery=zwdx.Recovery(keep_checkpoints=2)))
    assert result["status"] == "completed", result.get("reason")
    job_id = result["job_id"]
    kept = rest(pool, f"/jobs/{job_id}/checkpoints").json()["checkpoints"]
    assert [(c["n"], c["epoch"]) for c in kept] == [(3, 3), (4, 4)]  # one per full pass; the last two kept
    for n in (0, 1, 2):
        resp = rest(pool, f"/jobs/{job_id}/checkpoints/{n}/state.pt")
        assert resp.status_code == 404, (n, resp.text)
    # what the job left in the artifact store: its bundle, its weights and the files of the two kept
    job = pool.sdk.get_job(job_id)
    left = set(os.listdir(artifacts)) - before
    assert left == {job["spec"]["code"]["bundle_artifact"], job["weights_artifact"],
                    *(artifact for c in kept for artifact in c["files"].values())}, left
    assert sorted(kept[-1]["files"]) == ["rng-0.pt", "state.pt"]


# -- (train_loader, eval_loader) -------------------------------------------------------------------------
def count_training_samples(model, loader, optimizer):
    seen = 0
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        seen += len(x)
    return {"loss": 0.0, "train_samples": seen}


def count_eval_samples(model, loader):
    sizes = [len(x) for x, _ in loader]
    return {"eval_samples": sum(sizes), "eval_batches": len(sizes)}


def test_eval_func_gets_the_eval_loader_of_a_pair(pool):
    model = tiny_model()
    result = pool.sdk.submit_job(model, train_and_eval_loaders, count_training_samples, eval_func=count_eval_samples,
                                 optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                 resources=zwdx.Resources(world_size=1), run=zwdx.Run(progress=False, timeout=300))
    assert result["status"] == "completed", result.get("reason")
    results = result["results"]
    assert (results["train_samples"], results["eval_samples"], results["eval_batches"]) == (48, 20, 4), results


# -- param groups ------------------------------------------------------------------------------------
class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(F.relu(self.body(x)))


def report_param_groups(model, loader, optimizer, rank, reporter):
    """What each rank's optimizer holds: per group its settings, the shapes of its parameters
    and whether they are the wrapped model's own."""
    own = {id(p) for p in model.parameters()}
    steps(model, loader, optimizer)  # it steps, too
    groups = []
    for i, g in enumerate(optimizer.param_groups):
        reporter.log_metrics(**{f"group{i}_lr": g["lr"], f"group{i}_weight_decay": g["weight_decay"],
                                f"group{i}_beta1": g["betas"][0], f"group{i}_eps": g["eps"],
                                f"group{i}_own": float(all(id(p) in own for p in g["params"]))})
        groups.append([list(p.shape) for p in g["params"]])
    return {"loss": 0.0, "optimizer": type(optimizer).__name__, "shapes": groups,
            "by_group": {i: {"lr": g["lr"], "betas": g["betas"]} for i, g in enumerate(optimizer.param_groups)}}


@pytest.mark.parametrize("parallelism", ["DDP", "FSDP"])
def test_the_optimizer_is_rebuilt_with_every_param_groups_settings(pool, parallelism):
    model = TwoLayers()
    optimizer = torch.optim.AdamW([{"params": model.body.parameters(), "lr": 0.01, "weight_decay": 0.1},
                                   {"params": model.head.parameters(), "lr": 0.002, "weight_decay": 0.0,
                                    "betas": (0.8, 0.95)}], eps=1e-6)
    result = pool.sdk.submit_job(model, tiny_loader, report_param_groups, optimizer=optimizer,
                                 resources=zwdx.Resources(world_size=2), run=zwdx.Run(progress=False, timeout=300),
                                 parallelism=parallelism)
    assert result["status"] == "completed", result.get("reason")
    assert result["results"]["optimizer"] == "AdamW"
    assert result["results"]["shapes"] == [[[8, 4], [8]], [[2, 8], [2]]]
    # a nested mapping comes back as one (its keys as strings, as in JSON), not as its repr
    assert result["results"]["by_group"] == {"0": {"lr": 0.01, "betas": [0.9, 0.999]},
                                             "1": {"lr": 0.002, "betas": [0.8, 0.95]}}
    series = pool.sdk.get_job_metrics(result["job_id"])
    expected = {"group0_lr": 0.01, "group0_weight_decay": 0.1, "group0_beta1": 0.9, "group0_eps": 1e-6,
                "group1_lr": 0.002, "group1_weight_decay": 0.0, "group1_beta1": 0.8, "group1_eps": 1e-6,
                "group0_own": 1.0, "group1_own": 1.0}
    for name, value in expected.items():
        assert {p["rank"]: p["value"] for p in series[name]} == {0: pytest.approx(value), 1: pytest.approx(value)}, name
    assert "group2_lr" not in series


# -- the progress bar --------------------------------------------------------------------------------
SUBMIT_WITH_A_BAR = """
import sys, torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from zwdx import ZWDX

def loader(rank, world_size):
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4)

def train(model, loader, optimizer, reporter):
    reporter.log("a line from the train function")
    for x, y in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        reporter.log_metrics(loss=loss.item(), accuracy=0.75)
    return loss.item()

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
result = ZWDX(sys.argv[1], remember=False).submit_job(model, loader, train, room_token=sys.argv[2],
                                                      optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                      world_size=1, timeout=300)
print("submitted", result["job_id"], result["status"])
"""


def test_the_progress_bar_shows_the_job_its_status_metrics_and_log_lines(pool):
    done = subprocess.run([sys.executable, "-c", SUBMIT_WITH_A_BAR, pool.server.url, pool.token], cwd=ROOT,
                          capture_output=True, text=True, timeout=360, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stdout + done.stderr
    job_id, status = re.search(r"^submitted (\w+) (\w+)$", done.stdout, re.M).groups()
    assert status == "completed"
    # the bar (stderr, each update after a carriage return or a newline): its last state
    last = done.stderr.replace("\r", "\n").strip().splitlines()[-1]
    assert re.match(rf"job {job_id} completed: .*8step \[.*accuracy=0\.75, loss=[0-9.]+", last), done.stderr
    # the ranks' log lines, written above the bar
    assert "[rank 0] a line from the train function" in done.stdout, done.stdout
    assert pool.token not in done.stdout + done.stderr


# -- collective_timeout ------------------------------------------------------------------------------
COLLECTIVE_TIMEOUT = 6.0


def hang_in_a_collective(model, loader, rank):
    import torch.distributed as dist
    if rank == 1:
        time.sleep(3600)  # never reaches the all-reduce rank 0 waits in
    dist.all_reduce(torch.ones(1))
    return {"loss": 0.0}


def at(job: dict, status: str) -> float:
    return next(t["at"] for t in job["timeline"] if t["status"] == status)


def test_a_rank_hanging_in_a_collective_fails_the_job_within_about_the_collective_timeout(pool):
    # the job fails once the collective timed out and no GPU client turned out lost (CLIENT_TIMEOUT)
    limit = COLLECTIVE_TIMEOUT + defaults.CLIENT_TIMEOUT
    started = time.time()
    result = pool.sdk.submit_job(tiny_model(), tiny_loader, hang_in_a_collective,
                                 resources=zwdx.Resources(world_size=2),
                                 training=zwdx.Training(collective_timeout=COLLECTIVE_TIMEOUT),
                                 run=zwdx.Run(progress=False, raise_on_failure=False, timeout=limit + 120))  # far below the default of 300 s
    assert result["status"] == "failed"
    job = pool.sdk.get_job(result["job_id"])
    hung = at(job, "failed") - at(job, "running")
    print(f"\ncollective_timeout {COLLECTIVE_TIMEOUT:g} s: failed {hung:.1f} s after running "
          f"({time.time() - started:.1f} s after submit)")
    assert COLLECTIVE_TIMEOUT <= hung < limit + 30, hung
    assert [str(rank) for rank in job["failure_order"]] == ["0"], job["failures"]  # rank 1 never raised
    # gloo says which timeout it waited for: the job's, not the default
    assert f"{COLLECTIVE_TIMEOUT * 1000:.0f}ms" in job["failures"]["0"], job["failures"]["0"]
