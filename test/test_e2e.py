"""End to end with real processes: a server, two GPU clients (CPU slots, gloo), the SDK."""
from __future__ import annotations

import statistics

import pytest
import torch

import mnist
from gpu_client.parallel import fingerprint
from procs import wait_until


def submit_example(sdk, room, parallelism="DDP", **kwargs):
    return sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=mnist.train,
                          eval_func=mnist.test, optimizer=torch.optim.AdamW(mnist.Net().parameters(), lr=3e-3),
                          parallelism=parallelism, memory_required=0, room_token=room["token"],
                          progress=False, **{"epochs": 3, "world_size": 2, **kwargs})


@pytest.mark.parametrize("parallelism", ["DDP", "FSDP"])
def test_example_job_trains_on_two_gpu_clients(sdk, room, start_client, parallelism):
    start_client("a")
    start_client("b")
    result = submit_example(sdk, room, parallelism)

    assert result["status"] == "completed"
    assert result["world_size"] == 2
    assert sorted(p["client_id"] for p in result["placement"]) == ["client-a", "client-b"]
    assert result["results"]["final_loss"] == pytest.approx(result["final_loss"])
    assert result["results"]["accuracy"] > 0.8  # what the platform's call of eval_func returned

    series = sdk.get_job_metrics(result["job_id"])
    losses = [p["value"] for p in series["loss"] if p["rank"] == 0]
    assert statistics.mean(losses[-3:]) < 0.6 * statistics.mean(losses[:3]), losses
    assert series["throughput"] and all(p["value"] > 0 for p in series["throughput"])

    trained = sdk.get_trained_model(result["job_id"], mnist.Net())
    assert mnist.held_out_accuracy(trained) > 0.8

    ranks = sdk.get_job(result["job_id"])["ranks"]
    prints = {r["fingerprint"] for r in ranks.values()}
    assert len(ranks) == 2 and len(prints) == 1, ranks  # both ranks ended with the same weights
    assert fingerprint(trained.state_dict()) == prints.pop()  # and they are what came back

    logs = [line["text"] for line in sdk.get_job_logs(result["job_id"])]
    assert any("epoch 2: loss" in text for text in logs), logs


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


def test_default_world_size_takes_every_idle_slot(sdk, room, start_client):
    start_client("a")
    start_client("b")
    result = submit_example(sdk, room, epochs=1, world_size=None)
    assert result["world_size"] == 2
