"""DILOCO goes on without a worker it lost: three GPU-client processes train the example; rank 0's
is SIGKILLed after the job's first rounds; the server drops that worker (no restart, no checkpoint
reloaded), the rounds go on with the two others, and one of them brings the weights back."""
from __future__ import annotations

import pytest
import torch

import mnist
from procs import wait_until
from workloads import slow_train


@pytest.mark.server_args("--client-timeout", "5")
def test_a_worker_killed_mid_job_is_dropped_and_the_job_completes_without_a_restart(sdk, room, start_client):
    clients = {c.client_id: c for c in (start_client(f"w{i}") for i in range(3))}
    sdk.room_token = room["token"]
    model = mnist.Net()
    job_id = sdk.submit_job(model=model, data_loader_func=mnist.create_loader, train_func=slow_train,
                            eval_func=mnist.test, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3),
                            parallelism="DILOCO", diloco={"inner_steps": 4}, world_size=3, epochs=4, wait=False)

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
                            diloco={"inner_steps": 10}, world_size=1, epochs=3, wait=False)
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
