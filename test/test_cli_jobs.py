"""``zwdx jobs ...`` and ``zwdx room show|clients`` as a user runs them: a real server and GPU
clients, the command as its own process, the token from the environment or a file (never the
command line), tables for people, ``--json`` that parses, and no token in anything printed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import torch
from safetensors.torch import load_file

from zwdx import Resources, Run, Training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def loader(rank, world_size):
    from torch.utils.data import DataLoader, TensorDataset
    g = torch.Generator().manual_seed(rank)
    return DataLoader(TensorDataset(torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g)),
                      batch_size=8)


def train(model, loader, optimizer, epochs, reporter):
    for epoch in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            reporter.log_metrics(loss=loss.item())
        reporter.log(f"epoch {epoch} done")
    return {"loss": loss.item()}


def slow_train(model, loader, optimizer, reporter):
    import time
    for i in range(6):
        reporter.log(f"tick {i}")
        time.sleep(0.5)  # a job that runs a few seconds, to be followed and cancelled
    return {}


def zwdx(cluster, *args, env=None, timeout=120):
    """``zwdx ARGS`` against the cluster's server, the token in $ZWDX_ROOM_TOKEN."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("ZWDX_")}
    base.update({"PYTHONPATH": ROOT, "ZWDX_ROOM_TOKEN": cluster.room["token"], "ZWDX_REMEMBER": "0",
                 **(env or {})})
    proc = subprocess.run([sys.executable, "-m", "zwdx.cli", *args, "--server", cluster.server.url], env=base,
                          capture_output=True, text=True, timeout=timeout)
    for token in (cluster.room["token"], cluster.room["donor_token"]):
        assert token not in proc.stdout + proc.stderr
    return proc


def submit(cluster, train_func, epochs: int | None = None, name: str = "", wait: bool = True) -> dict:
    model = torch.nn.Linear(4, 2)
    return cluster.sdk.submit_job(model, loader, train_func, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                  resources=Resources(world_size=2), training=Training(epochs=epochs),
                                  run=Run(name=name, progress=False), wait=wait)


def test_list_show_logs_metrics_download_of_a_finished_job(cluster, tmp_path):
    result = submit(cluster, train, epochs=2, name="cli-job")
    job_id = result["job_id"]

    listed = zwdx(cluster, "jobs", "list")
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if job_id in line)
    assert "cli-job" in row and "completed" in row and "DDP" in row
    as_json = json.loads(zwdx(cluster, "jobs", "list", "--json").stdout)
    assert job_id in [j["id"] for j in as_json]

    shown = zwdx(cluster, "jobs", "show", job_id)
    assert "completed" in shown.stdout and "client-a" in shown.stdout and "client-b" in shown.stdout
    plan = shown.stdout.split("\nplan:\n", 1)[1]  # what each rank holds, as the job page draws it
    for rank in (0, 1):
        assert f"rank {rank} on " in plan and "replica: the whole model" in plan.split(f"rank {rank} on ", 1)[1]
    assert json.loads(zwdx(cluster, "jobs", "show", job_id, "--json").stdout)["status"] == "completed"

    logs = zwdx(cluster, "jobs", "logs", job_id, "--rank", "0").stdout.splitlines()
    assert "[rank 0] epoch 0 done" in logs and "[rank 0] epoch 1 done" in logs
    assert not any(line.startswith("[rank 1]") for line in logs)

    metrics = zwdx(cluster, "jobs", "metrics", job_id)
    loss_row = next(line for line in metrics.stdout.splitlines() if line.startswith("loss"))
    series = json.loads(zwdx(cluster, "jobs", "metrics", job_id, "--json").stdout)
    assert str(len(series["loss"])) in loss_row.split()

    out = tmp_path / "w.safetensors"
    got = zwdx(cluster, "jobs", "download", job_id, "-o", str(out))
    assert got.returncode == 0 and "sha256" in got.stdout
    model = cluster.sdk.get_trained_model(job_id, torch.nn.Linear(4, 2))
    assert torch.equal(load_file(str(out))["weight"], model.weight.detach())

    board = zwdx(cluster, "jobs", "tensorboard", job_id, "--logdir", str(tmp_path / "tb"))
    assert board.returncode == 0 and any(p.name.startswith("events.out") for p in (tmp_path / "tb").iterdir())


def test_logs_follow_until_the_job_ends_and_cancel(cluster, tmp_path):
    job_id = submit(cluster, slow_train, wait=False)
    followed = {}
    thread = threading.Thread(target=lambda: followed.update(p=zwdx(cluster, "jobs", "logs", job_id, "-f")))
    thread.start()
    thread.join(120)
    proc = followed["p"]
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [f"[rank 0] tick {i}" for i in range(6)] == [x for x in lines if x.startswith("[rank 0] tick")], \
        (proc.stderr[-2000:], cluster.sdk.get_job(job_id)["status"])

    again = submit(cluster, slow_train, wait=False)
    token_file = tmp_path / "token"
    token_file.write_text(cluster.room["token"])
    cancelled = zwdx(cluster, "jobs", "cancel", again, "--room-token-file", str(token_file),
                     env={"ZWDX_ROOM_TOKEN": ""})
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout
    assert cluster.sdk.get_job(again)["status"] == "cancelled"


def test_room_show_and_clients(cluster):
    shown = zwdx(cluster, "room", "show")
    assert "2 online of 2" in shown.stdout and cluster.room["id"] in shown.stdout
    clients = zwdx(cluster, "room", "clients").stdout
    assert "client-a" in clients and "client-b" in clients and "free" in clients and "LINK" in clients
    listed = json.loads(zwdx(cluster, "room", "clients", "--json").stdout)
    assert {c["id"] for c in listed} == {"client-a", "client-b"}
    for c in listed:  # the link each measured to the server as it registered, and where its peers probe it
        assert c["link"]["rtt"] > 0 and c["link"]["up"] > 0 and c["link"]["down"] > 0, c
        assert c["reach_port"] and c["unreachable"] == [], c
        assert "ms" in clients.split(c["id"], 1)[1].splitlines()[0]  # its row shows the link


def test_without_a_token_it_says_how_to_give_one(cluster):
    proc = zwdx(cluster, "jobs", "list", env={"ZWDX_ROOM_TOKEN": ""})
    assert proc.returncode != 0 and "a room token is needed" in proc.stderr
