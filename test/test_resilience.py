"""Jobs that survive failures, with real processes and real signals: a SIGKILLed GPU client,
a SIGKILLed server, a cancel. Timings are printed (run with -s to see them); time limits are
the configured timeouts plus procs.SLACK."""
from __future__ import annotations

import inspect
import random
import signal
import time

import psutil
import pytest
import torch

import mnist
from gpu_client.agent.launcher import Launcher
from procs import SLACK, Server, wait_until
from workloads import slow_train, tracked_train
import zwdx
from zwdx import defaults
from zwdx.server.scheduler import REAP_INTERVAL

#: A GPU client whose connection dropped is lost after the disconnect grace, at the next reaping.
LOST_WITHIN = defaults.DISCONNECT_GRACE + REAP_INTERVAL + SLACK
#: A cancelled job's ranks get SIGTERM, then SIGKILL after the GPU client's grace.
KILL_GRACE = inspect.signature(Launcher.kill).parameters["grace"].default


def submit(sdk, room, world_size: int, epochs: int, wait: bool = True, **recovery):
    return sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=slow_train,
                          optimizer=torch.optim.AdamW(mnist.Net().parameters(), lr=3e-3),
                          resources=zwdx.Resources(world_size=world_size), training=zwdx.Training(epochs=epochs),
                          run=zwdx.Run(room_token=room["token"], progress=False,
                                       recovery=zwdx.Recovery(**recovery) if recovery else None), wait=wait)


def rank_pids(client) -> list[int]:
    return [p.pid for p in psutil.Process(client.pid).children(recursive=True)
            if "gpu_client.sandbox.rank_process" in " ".join(p.cmdline())]


def at(job, status, after=0.0):
    return next(t["at"] for t in job["timeline"] if t["status"] == status and t["at"] > after)


def test_sigkill_one_of_three_gpu_clients_resumes_from_the_last_checkpoint(sdk, room, start_client):
    """DDP on three GPU clients, one SIGKILLed after a checkpoint: the job goes on at world size 2
    from that checkpoint, to the accuracy of an undisturbed run, with its LR scheduler, tracked
    objects and random generators where they were (``check_the_resumed_state``; the FSDP case:
    the test after next)."""
    clients = start_client.together("a", "b", "c")
    lr = 1e-2  # StepLR halves it each epoch: about the accuracy of 3e-3 held (0.86 on the held-out digits)
    undisturbed = submit_tracked(sdk, room, "DDP", lr, optimizer=torch.optim.AdamW, wait=True)
    assert undisturbed["status"] == "completed", undisturbed["reason"]
    base_acc = mnist.held_out_accuracy(sdk.get_trained_model(undisturbed["job_id"], mnist.Net()))

    job_id = submit_tracked(sdk, room, "DDP", lr, optimizer=torch.optim.AdamW, min_world_size=2)
    job = wait_until(lambda: (j := sdk.get_job(job_id)).get("latest_checkpoint") and
                     j["latest_checkpoint"]["epoch"] >= 1 and j, 120, what="checkpoint of epoch 1")
    victim = next(c for c in clients if c.client_id == job["placement"][2]["client_id"])
    victim.kill(signal.SIGKILL)
    killed_at = time.time()

    result = sdk.wait(job_id, progress=False, timeout=300)
    assert result["status"] == "completed", result["reason"]
    job = sdk.get_job(job_id)
    assert job["restarts"] == 1 and job["world_size"] == 2
    assert victim.client_id not in {p["client_id"] for p in job["placement"]}
    resumed = job["restart_history"][0]
    assert "lost" in resumed["reason"] and resumed["from_checkpoint"]["epoch"] >= 1
    detected, running_again = at(job, "resuming"), at(job, "running", after=at(job, "resuming"))
    print(f"\nclient SIGKILL -> detected {detected - killed_at:.2f} s, -> training again {running_again - killed_at:.2f} s")
    assert detected - killed_at < LOST_WITHIN

    acc = mnist.held_out_accuracy(sdk.get_trained_model(job_id, mnist.Net()))
    print(f"held-out accuracy {acc:.3f}, undisturbed {base_acc:.3f}")
    assert acc > 0.8 and abs(acc - base_acc) < 0.08, (acc, base_acc)
    epochs_after = {p["value"] for p in sdk.get_job_metrics(job_id)["epoch"]
                    if p["ts"] > running_again}
    assert min(epochs_after) == resumed["from_checkpoint"]["epoch"] + 1  # went on, did not start over
    check_the_resumed_state(sdk, job_id, lr)


def test_sigkill_server_mid_job_and_restart_loses_no_metric(tmp_path, start_client, room, server, sdk):
    start_client.together("a", "b")
    job_id = submit(sdk, room, world_size=2, epochs=4, wait=False)
    wait_until(lambda: len(sdk.get_job_metrics(job_id).get("loss", [])) > 10, 120, what="training under way")
    server.kill(signal.SIGKILL)
    killed_at = time.time()
    server.popen.wait()
    time.sleep(2)  # the server stays away 2 s (what is tested): ranks keep training and buffer their metrics
    again = Server(server.data_dir, port=server.port)
    try:
        result = sdk.wait(job_id, progress=False, timeout=300)
        assert result["status"] == "completed", result["reason"]
        job = sdk.get_job(job_id)
        assert job.get("restarts", 0) == 0  # the ranks rode through; nothing restarted
        series = sdk.get_job_metrics(job_id)["loss"]
        for rank in (0, 1):
            steps = [p["step"] for p in series if p["rank"] == rank]
            assert steps == list(range(len(steps))), f"rank {rank}: gaps or duplicates in {steps}"
        assert len([p for p in series if p["rank"] == 0]) == 4 * 24  # 4 epochs x 24 steps of 750 samples
        clients_back = max(c["connected_at"] for c in sdk.get_room(room["token"])["clients"])
        print(f"\nserver SIGKILL -> restarted and GPU clients back {clients_back - killed_at:.2f} s")
    finally:
        again.stop()


def test_cancel_mid_job_stops_every_rank_within_the_kill_grace(cluster):
    sdk, room, (a, b) = cluster.sdk, cluster.room, cluster.clients
    job_id = submit(sdk, room, world_size=2, epochs=50, wait=False)
    wait_until(lambda: sdk.get_job(job_id)["status"] == "running" and rank_pids(a) and rank_pids(b), 60,
               what="ranks running")
    pids = rank_pids(a) + rank_pids(b)
    t0 = time.time()
    assert sdk.cancel_job(job_id)["status"] == "cancelled"  # the answer says so at once
    wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                               for p in pids), KILL_GRACE + SLACK, what="every rank process gone")
    print(f"\ncancel -> every rank gone in {time.time() - t0:.2f} s")
    wait_until(lambda: all(s["job_id"] is None for c in sdk.get_room(room["token"])["clients"] for s in c["slots"]),
               KILL_GRACE + SLACK, what="slots freed")
    assert sdk.get_job(job_id)["status"] == "cancelled"


def test_lost_client_without_min_world_size_waits_for_a_replacement(sdk, room, start_client):
    _, b = start_client.together("a", "b")
    job_id = submit(sdk, room, world_size=2, epochs=4, wait=False)
    wait_until(lambda: sdk.get_job(job_id).get("latest_checkpoint"), 120, what="a checkpoint")
    b.kill(signal.SIGKILL)
    # first it says the client was lost, then (the scheduler's next pass) what it waits for
    job = wait_until(lambda: (j := sdk.get_job(job_id))["status"] == "resuming" and "2 free slot" in (
        j.get("waiting_reason") or "") and j, 30, what="the job waiting to resume on 2 free slots")
    assert any(e.get("reason") and "lost" in e["reason"] for e in job["timeline"] if e["status"] == "resuming")
    start_client("c")
    result = sdk.wait(job_id, progress=False, timeout=300)
    assert result["status"] == "completed" and result["world_size"] == 2
    assert sorted(p["client_id"] for p in result["placement"]) == ["client-a", "client-c"]


def test_a_job_out_of_restarts_fails_with_the_reasons(sdk, room, start_client):
    _, b = start_client.together("a", "b")
    job_id = submit(sdk, room, world_size=2, epochs=4, max_restarts=0, wait=False)
    wait_until(lambda: sdk.get_job(job_id)["status"] == "running", 60, what="running")
    b.kill(signal.SIGKILL)
    result = sdk.wait(job_id, progress=False, timeout=60, raise_on_failure=False)
    assert result["status"] == "failed"
    assert "client-b" in result["reason"] and "gave up after 0 restart" in result["reason"]


def reported_together(metrics: dict, names: list[str]) -> list[dict]:
    """The values of ``names`` that one ``log_metrics`` call reported, one dict per call, in order."""
    calls: dict = {}
    for name in names:
        for p in metrics.get(name, []):
            calls.setdefault((p["rank"], p["ts"], p["step"]), {"rank": p["rank"], "ts": p["ts"]})[name] = p["value"]
    return sorted(calls.values(), key=lambda call: call["ts"])


def submit_tracked(sdk, room, parallelism: str, lr: float, optimizer=torch.optim.SGD, wait: bool = False, **recovery):
    """``tracked_train`` on three ranks for 5 epochs (``wait``: the result, else the job's id)."""
    model = mnist.Net()
    return sdk.submit_job(model=model, data_loader_func=mnist.create_loader, train_func=tracked_train,
                          optimizer=optimizer(model.parameters(), lr=lr),
                          resources=zwdx.Resources(world_size=3), training=zwdx.Training(epochs=5),
                          run=zwdx.Run(room_token=room["token"], progress=False,
                                       recovery=zwdx.Recovery(**recovery) if recovery else None),
                          parallelism=parallelism, wait=wait)


def test_a_resumed_job_gets_back_its_lr_scheduler_tracked_objects_and_random_generators(sdk, room, start_client):
    """FSDP (DDP's case is the SIGKILL test's job, above)."""
    clients = start_client.together("a", "b", "c")
    lr = 0.02
    job_id = submit_tracked(sdk, room, "FSDP", lr, min_world_size=2)
    job = wait_until(lambda: (j := sdk.get_job(job_id)).get("latest_checkpoint") and
                     j["latest_checkpoint"]["epoch"] >= 1 and j, 120, what="checkpoint of epoch 1")
    next(c for c in clients if c.client_id == job["placement"][2]["client_id"]).kill(signal.SIGKILL)
    result = sdk.wait(job_id, progress=False, timeout=300)
    assert result["status"] == "completed", result["reason"]
    job = sdk.get_job(job_id)
    assert job["restarts"] == 1 and job["world_size"] == 2
    check_the_resumed_state(sdk, job_id, lr)


def check_the_resumed_state(sdk, job_id: str, lr: float) -> None:
    """A job of ``tracked_train`` resumed once (its rank 2 lost) got back its LR scheduler, its
    tracked objects and each rank's random generators."""
    job = sdk.get_job(job_id)
    start = job["restart_history"][0]["from_checkpoint"]["epoch"] + 1
    metrics = sdk.get_job_metrics(job_id)

    # the first epoch after the resume sees scheduler and counter where the epochs before left them
    epochs = reported_together(metrics, ["epoch_start", "lr", "counted_steps", "counted_epochs", "resumed"])
    first = next(e for e in epochs if e["resumed"] == 1.0 and e["rank"] == 0)
    assert first["epoch_start"] == start
    assert first["lr"] == pytest.approx(lr * 0.5 ** start)  # StepLR halved it once per epoch done
    assert first["counted_epochs"] == start
    assert first["counted_steps"] == start * 16  # 500 samples a rank at world size 3, batches of 32

    # each rank's generators go on from where they were: Python's draws follow the seeded stream
    draws = reported_together(metrics, ["draw_index", "py_draw", "torch_draw", "resumed"])
    for rank in (0, 1):
        stream = random.Random(100 + rank)
        expected = [stream.random() for _ in range(1000)]
        mine = [d for d in draws if d["rank"] == rank and "py_draw" in d]
        assert any(d["resumed"] == 1.0 for d in mine)
        assert all(d["py_draw"] == expected[int(d["draw_index"])] for d in mine), rank
        # and torch's do not start over from the seed
        before = [d["torch_draw"] for d in mine if d["resumed"] == 0.0][:3]
        after = [d["torch_draw"] for d in mine if d["resumed"] == 1.0][:3]
        assert before != after, rank
