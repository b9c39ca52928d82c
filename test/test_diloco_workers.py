"""DILOCO with workers of several ranks (``diloco={"ranks_per_worker": 2}``): two GPU-client
processes of two CPU slots each train the example as two workers of two ranks. Each worker's
ranks train as DDP among themselves and take the outer steps together; the server averages one
upload per worker a round, not one per rank; every rank ends on the global weights; and the
weights that come back give, here, the eval loss the job reported."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import zwdx
import mnist
from digests import state_digest as fingerprint


def held_out_loss(model, loader, rank, world_size):
    """The loss over the whole held-out set (not a shard: every rank computes the same)."""
    images, labels = mnist.load_dataset(train=False).tensors
    device = next(model.parameters()).device
    model.eval()
    with torch.no_grad():
        return {"eval_loss": F.cross_entropy(model(images.to(device)), labels.to(device)).item()}


def test_two_workers_of_two_ranks_train_with_one_upload_per_worker_a_round(sdk, room, start_client):
    start_client.together("w0", "w1", extra=["--cpu-slots", "2"])
    sdk.room_token = room["token"]
    model = mnist.Net()
    before = held_out_loss(model, None, 0, 1)["eval_loss"]
    result = sdk.submit_job(model=model, data_loader_func=mnist.create_loader, train_func=mnist.train,
                            eval_func=held_out_loss, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3),
                            parallelism="DILOCO",
                            strategy=zwdx.Diloco(inner_steps=5, ranks_per_worker=2, all_reduce=False),
                            resources=zwdx.Resources(world_size=4), training=zwdx.Training(epochs=2),
                            run=zwdx.Run(progress=False, timeout=300))
    assert result["status"] == "completed", result["reason"]
    job = sdk.get_job(result["job_id"])
    placed = {p["rank"]: p["client_id"] for p in job["placement"]}
    assert placed[0] == placed[1] != placed[2] == placed[3]  # a worker: one GPU client's ranks
    logs = [line["text"] for line in sdk.get_job_logs(result["job_id"])]
    assert any("worker 0 of 2 (2 ranks each, DDP among them)" in t for t in logs), logs
    rounds = [t for t in logs if t.startswith("diloco round")]
    # 1,500 samples over 4 ranks in batches of 32: 12 steps an epoch, 24 in all, a round every 5 and the last
    assert len(rounds) == 5, rounds
    assert all("pseudo-gradients of rank(s) 0, 2 through the server" in t for t in rounds), rounds
    prints = {r: s["fingerprint"] for r, s in job["ranks"].items()}
    assert prints["0"] == prints["1"] and prints["2"] == prints["3"], prints  # each worker's ranks alike
    assert len(set(prints.values())) == 1, prints  # and the workers on the same global weights
    texts = {r: s["layout"]["text"] for r, s in job["ranks"].items()}  # the job page's plan
    assert texts["3"].startswith("DiLoCo worker 1 of 2, rank 1 of its 2 (DDP): the whole model"), texts
    trained = sdk.get_trained_model(result["job_id"], mnist.Net())
    assert fingerprint(trained.state_dict()) == prints["0"]
    local = held_out_loss(trained, None, 0, 1)["eval_loss"]
    assert abs(local - result["results"]["eval_loss"]) < 1e-5, (local, result["results"])
    # it learned (24 steps of 4 ranks, 5 rounds: short of the example's accuracy, well above chance's 0.1)
    assert local < before and mnist.held_out_accuracy(trained) > 0.3, (before, local)
