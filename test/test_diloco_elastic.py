"""DILOCO goes on without a worker it lost: three GPU-client processes train the example; rank 0's
is SIGKILLed after the job's first rounds; the server drops that worker (no restart, no checkpoint
reloaded), the rounds go on with the two others, and one of them brings the weights back."""
from __future__ import annotations

import pytest
import torch

import zwdx
import mnist
from procs import wait_until
from workloads import slow_train


@pytest.mark.server_args("--client-timeout", "5")
def test_a_worker_killed_mid_job_is_dropped_and_the_job_completes_without_a_restart(sdk, room, start_client):
    clients = {c.client_id: c for c in start_client.together("w0", "w1", "w2")}
    sdk.room_token = room["token"]
    model = mnist.Net()
    job_id = sdk.submit_job(model=model, data_loader_func=mnist.create_loader, train_func=slow_train,
                            eval_func=mnist.test, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3),
                            parallelism="DILOCO", strategy=zwdx.Diloco(inner_steps=4, all_reduce=False),
                            resources=zwdx.Resources(world_size=3), training=zwdx.Training(epochs=4), wait=False)

    def rounds() -> list[str]:
        return [line["text"] for line in sdk.get_job_logs(job_id) if line["text"].startswith("diloco round")]
    wait_until(lambda: len(rounds()) >= 2, 120, what="two rounds averaged")
    job = sdk.get_job(job_id)
    victim = next(p["client_id"] for p in job["placement"] if p["rank"] == 0)
    clients[victim].popen.kill()  # SIGKILL: the GPU client and, with it, its rank process

    result = sdk.wait(job_id, progress=False, timeout=300)
    assert result["status"] == "completed", result["reason"]
    job = sdk.get_job(job_id)
    assert job["restarts"] == 0 and not job["restart_history"]
    assert job["ranks"]["0"]["status"] == "dropped"
    assert {job["ranks"][r]["status"] for r in ("1", "2")} == {"completed"}
    dropped = [e for e in job["timeline"] if "dropped" in (e.get("reason") or "")]
    assert len(dropped) == 1 and victim in dropped[0]["reason"] and dropped[0]["status"] == "running"
    later = rounds()
    assert any("rank(s) 1, 2 through the server" in line for line in later), later  # it went on with two
    trained = sdk.get_trained_model(job_id, mnist.Net())  # from rank 1, the first worker still in
    assert mnist.held_out_accuracy(trained) > 0.7


@pytest.mark.server_args("--client-timeout", "5")
def test_a_diloco_job_with_no_worker_left_resumes_from_its_checkpoint_with_the_global_weights(sdk, room, start_client):
    first = start_client("only")
    sdk.room_token = room["token"]
    model = mnist.Net()
    job_id = sdk.submit_job(model=model, data_loader_func=mnist.create_loader, train_func=slow_train,
                            optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3), parallelism="DILOCO",
                            strategy=zwdx.Diloco(inner_steps=10), resources=zwdx.Resources(world_size=1),
                            training=zwdx.Training(epochs=3), wait=False)
    checkpoint = wait_until(lambda: sdk.get_job(job_id).get("latest_checkpoint"), 120, what="a checkpoint")
    first.popen.kill()
    wait_until(lambda: sdk.get_job(job_id)["restarts"] == 1, 60, what="the job interrupted")
    start_client("next")
    result = sdk.wait(job_id, progress=False, timeout=300)
    assert result["status"] == "completed", result["reason"]
    logs = [line["text"] for line in sdk.get_job_logs(job_id)]
    assert any(f"resumed from checkpoint {checkpoint['n']}" in line for line in logs)
    # the checkpoint held the global weights, the outer optimizer and the round it was taken in: the
    # resumed worker's first round is the one after the checkpoint's (1,500 samples in batches of 32:
    # 47 steps an epoch, a round every 10), not round 0 again
    resumed_at = next(i for i, line in enumerate(logs) if "resumed from checkpoint" in line)
    after = [int(line.split()[2].rstrip(":")) for line in logs[resumed_at:] if line.startswith("diloco round")]
    print(f"\ncheckpoint {checkpoint['n']} after epoch {checkpoint['epoch']}; rounds after the restart: {after}")
    assert after[0] == (checkpoint["epoch"] + 1) * 47 // 10 and after == list(range(after[0], after[0] + len(after)))


@pytest.mark.server_args("--client-timeout", "5")
def test_a_gpu_client_started_mid_job_joins_in_a_killed_workers_place(sdk, room, start_client):
    clients = {c.client_id: c for c in start_client.together("w0", "w1")}
    sdk.room_token = room["token"]
    model = mnist.Net()
    job_id = sdk.submit_job(model=model, data_loader_func=mnist.create_loader, train_func=slow_train,
                            optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3), parallelism="DILOCO",
                            strategy=zwdx.Diloco(inner_steps=4, all_reduce=False),
                            resources=zwdx.Resources(world_size=2), training=zwdx.Training(epochs=12), wait=False)

    def logs() -> list[str]:
        return [line["text"] for line in sdk.get_job_logs(job_id)]
    wait_until(lambda: sum(t.startswith("diloco round") for t in logs()) >= 2, 120, what="two rounds averaged")
    victim = next(p["client_id"] for p in sdk.get_job(job_id)["placement"] if p["rank"] == 1)
    clients[victim].popen.kill()
    wait_until(lambda: sdk.get_job(job_id)["ranks"].get("1", {}).get("status") == "dropped", 60, what="rank 1 dropped")
    late = start_client("late")  # a GPU client that becomes free later: it joins as rank 1

    try:
        result = sdk.wait(job_id, progress=False, timeout=300)
    except Exception:
        print("\n".join(logs()[-60:]), sdk.get_job(job_id)["joins"], sdk.get_job(job_id)["timeline"])
        raise
    assert result["status"] == "completed", result["reason"]
    job = sdk.get_job(job_id)
    assert job["restarts"] == 0 and not job["restart_history"]
    assert {r: s["status"] for r, s in job["ranks"].items()} == {"0": "completed", "1": "completed"}
    reasons = [e.get("reason") or "" for e in job["timeline"]]
    dropped = next(i for i, r in enumerate(reasons) if "dropped" in r and victim in r)
    joined = next(i for i, r in enumerate(reasons) if f"gpu client {late.client_id} joined as rank 1" in r)
    assert dropped < joined and job["timeline"][joined]["status"] == "running"
    assert job["joins"]["1"]["client_id"] == late.client_id and job["joins"]["1"].get("state_from") is None
    first = job["joins"]["1"]["round"]
    lines = logs()  # the joiner starts from the server's global weights (the SDK sent the start's), not rank 0's word
    assert any(f"rank(s) 1 joined: from the server's own global weights after round {first - 1}" in t
               for t in lines), lines
    rounds = {int(t.split()[2].rstrip(":")): t for t in lines if t.startswith("diloco round")}
    assert "rank(s) 0 through the server" in rounds[first - 1]     # the survivor alone, before
    assert "rank(s) 0, 1 through the server" in rounds[first]       # both from the round it joined at
    trained = sdk.get_trained_model(job_id, mnist.Net())
    assert mnist.held_out_accuracy(trained) > 0.7


def test_workers_on_one_host_average_by_all_reduce_among_themselves(sdk, room, start_client):
    start_client.together("w0", "w1")
    sdk.room_token = room["token"]
    model = mnist.Net()
    result = sdk.submit_job(model=model, data_loader_func=mnist.create_loader, train_func=mnist.train,
                            optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3), parallelism="DILOCO",
                            strategy=zwdx.Diloco(inner_steps=12), resources=zwdx.Resources(world_size=2),
                            training=zwdx.Training(epochs=2), run=zwdx.Run(progress=False, timeout=300))
    assert result["status"] == "completed", result["reason"]
    logs = [line["text"] for line in sdk.get_job_logs(result["job_id"])]
    assert "DILOCO: the workers reach each other: rounds average by all-reduce among them (gloo)" in logs, logs
    rounds = [t for t in logs if t.startswith("diloco round")]
    assert rounds and all("(robust) by all-gather among the workers" in t and "2 worker(s)" in t
                          for t in rounds[:-1]), rounds
    assert not any("through the server" in t for t in logs), logs
    used = sdk.get_job_metrics(result["job_id"])["all_reduce"]
    assert {p["rank"] for p in used} == {0, 1} and {p["value"] for p in used} == {1.0}
    assert mnist.held_out_accuracy(sdk.get_trained_model(result["job_id"], mnist.Net())) > 0.7
