"""A dishonest donor in a DILOCO job, with real GPU-client processes: of three workers on the
example task, rank 2's process adds noise to its weights after every optimizer step (a donor
sending garbage for its share of the work). Under the default robust rule the job still learns,
and rank 2, and only it, is named a suspect, dropped, and its GPU client not given the job again.
(Before robust aggregation this job ended "completed" at chance accuracy, nothing flagged.)
In-process, with a forged upload and over both stores: test_robust.py."""
from __future__ import annotations

import pytest
import torch

import zwdx
import mnist
from test_diloco_verify import _train

pytestmark = pytest.mark.slow  # a server and three GPU-client processes


def noisy_train(model, loader, optimizer, rank, epochs, reporter, device):
    """mnist's training, but rank 2 adds noise to its weights after every step (test_diloco_verify's
    loop, unpaced)."""
    torch.set_num_threads(1)
    return _train(model, loader, optimizer, epochs, reporter, device, noise=rank == 2, pace=0)


def test_a_worker_adding_noise_is_named_a_suspect_and_the_job_still_learns(sdk, room, start_client):
    for i in range(3):
        start_client(f"w{i}")
    sdk.room_token = room["token"]
    model = mnist.Net()
    result = sdk.submit_job(model=model, data_loader_func=mnist.create_loader, train_func=noisy_train,
                            optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3), parallelism="DILOCO",
                            strategy=zwdx.Diloco(inner_steps=4, all_reduce=False),
                            resources=zwdx.Resources(world_size=3), training=zwdx.Training(epochs=3),
                            run=zwdx.Run(progress=False, timeout=300))
    assert result["status"] == "completed", result["reason"]
    assert [s["rank"] for s in result["suspects"]] == [2], result["suspects"]
    suspect = result["suspects"][0]
    placed = {p["rank"]: p["client_id"] for p in result["placement"]}
    assert suspect["client_id"] == placed[2] and len(suspect["rounds"]) == 5 and "norm" in suspect["reason"]
    assert result["job"]["ranks"]["2"]["status"] == "dropped"
    clients = {c["id"]: c for c in sdk.get_room()["clients"]}
    assert suspect["token_id"] and suspect["token_id"] == clients[placed[2]]["token_id"]  # what to revoke
    assert clients[placed[2]]["suspected_in"] == [result["job_id"]]
    assert placed[2] in sdk.get_job(result["job_id"]).get("avoid", [placed[2]])
    logs = [line["text"] for line in sdk.get_job_logs(result["job_id"])]
    assert any("rank 2" in t and "is a suspect" in t for t in logs), logs
    # The weights that came back are the server's own global weights, and the workers that finished hold them.
    assert any("the weights that came back are the server's global weights" in t for t in logs), logs
    held = {result["job"]["ranks"][r].get("global_fingerprint") for r in ("0", "1")}
    assert len(held) == 1 and None not in held, held
    accuracy = mnist.held_out_accuracy(sdk.get_trained_model(result["job_id"], mnist.Net()))
    assert accuracy > 0.7, accuracy  # honest runs of this job reach 0.8-0.9; with the plain mean ~0.1
