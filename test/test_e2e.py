"""End to end with real processes: a server, two GPU clients (CPU slots, gloo), the SDK. The
tests that leave the room as they found it share conftest's ``cluster``."""
from __future__ import annotations

import statistics

import pytest
import requests
import torch

import mnist
from digests import weights_digest
from models import local_numel
from procs import wait_until
import zwdx
from zwdx import defaults


def submit_example(sdk, room, parallelism="DDP", train_func=mnist.train, epochs=3, world_size=2, wait=True):
    return sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=train_func,
                          eval_func=mnist.test, optimizer=torch.optim.AdamW(mnist.Net().parameters(), lr=3e-3),
                          parallelism=parallelism, memory_required=0,
                          resources=zwdx.Resources(world_size=world_size), training=zwdx.Training(epochs=epochs),
                          run=zwdx.Run(room_token=room["token"], progress=False), wait=wait)


def train_reporting_what_each_rank_holds(model, loader, optim, eval_func, rank, world_size, epochs=3, reporter=None):
    """The example's train, after reporting how many parameter elements this rank holds."""
    reporter.log_metrics(local_params=local_numel(model))
    return mnist.train(model, loader, optim, eval_func, rank, world_size, epochs, reporter)


@pytest.mark.parametrize("parallelism", ["DDP", "FSDP"])
def test_example_job_trains_on_two_gpu_clients(cluster, parallelism):
    sdk, room = cluster.sdk, cluster.room
    result = submit_example(sdk, room, parallelism, train_func=train_reporting_what_each_rank_holds)

    assert result["status"] == "completed"
    assert result["world_size"] == 2
    # the server found the weights that came back to be what every rank reported (``compare_upload``)
    assert result["warnings"] == [] and result["suspects"] == [], result
    assert sorted(p["client_id"] for p in result["placement"]) == ["client-a", "client-b"]
    assert result["results"]["accuracy"] > 0.8  # what the platform's call of eval_func returned
    logs = [line["text"] for line in sdk.get_job_logs(result["job_id"])]
    # the job's final loss is what train_func returned: the loss rank 0 printed last
    assert f"epoch 2: loss {result['final_loss']:.4f}" in logs, (result["final_loss"], logs)

    series = sdk.get_job_metrics(result["job_id"])
    losses = [p["value"] for p in series["loss"] if p["rank"] == 0]
    assert statistics.mean(losses[-3:]) < 0.6 * statistics.mean(losses[:3]), losses
    assert series["throughput"] and all(p["value"] > 0 for p in series["throughput"])
    total = sum(p.numel() for p in mnist.Net().parameters())
    held = {p["rank"]: p["value"] for p in series["local_params"]}
    if parallelism == "FSDP":  # each rank holds its shard of the parameters while it trains, not a replica
        assert sum(held.values()) == total and max(held.values()) < 0.55 * total, (held, total)
    else:
        assert held == {0: total, 1: total}

    trained = sdk.get_trained_model(result["job_id"], mnist.Net())
    assert mnist.held_out_accuracy(trained) > 0.8

    ranks = sdk.get_job(result["job_id"])["ranks"]
    prints = {r["fingerprint"] for r in ranks.values()}
    assert len(ranks) == 2 and len(prints) == 1, ranks  # both ranks ended with the same weights
    # what each rank said it holds (the job page's plan) is what it held while it trained
    layouts = {int(rank): state["layout"] for rank, state in ranks.items()}
    assert {r: lay["params"] for r, lay in layouts.items()} == held
    assert {lay["role"] for lay in layouts.values()} == {"shard" if parallelism == "FSDP" else "replica"}
    weights = requests.get(f"{cluster.server.url}{defaults.API_PREFIX}/jobs/{result['job_id']}/weights",
                           headers={defaults.TOKEN_HEADER: room["token"]}, timeout=30)
    assert weights_digest(weights.content) == prints.pop()  # and they are what came back


def test_job_too_big_waits_then_runs_when_a_client_joins(sdk, room, start_client):
    start_client("a")
    job_id = submit_example(sdk, room, epochs=1, wait=False)
    job = wait_until(lambda: (j := sdk.get_job(job_id, room["token"])).get("waiting_reason") and j, 20,
                     what="a waiting reason")
    assert job["status"] == "queued"
    assert "2 free slot" in job["waiting_reason"] and job["queue_position"] == 1
    start_client("b")
    result = sdk.wait(job_id, room["token"], progress=False, timeout=240)
    assert result["status"] == "completed" and result["world_size"] == 2


def test_default_world_size_takes_every_idle_slot(cluster):
    result = submit_example(cluster.sdk, cluster.room, epochs=1, world_size=None)
    assert result["world_size"] == 2
