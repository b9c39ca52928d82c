"""docs/checkpoints.md: what rides through a failure, with real processes and real
signals.

- a ``submit_job`` that is already waiting when the server is SIGKILLed keeps waiting while the
  server is away and returns the job's result once it is back (test_resilience.py starts its
  wait after the restart);
- ``reporter.checkpoint()`` saves mid-epoch, and a job resumed after a lost GPU client goes on
  from that step, with the weights it had there;
- a checkpoint is written and uploaded in the background: a GPU client lost while one uploads
  leaves the one before it the latest, and the job goes on from that.

Each test has its own server and GPU clients: it kills one of them.
"""
from __future__ import annotations

import signal
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import mnist
from procs import Server, wait_until
from workloads import slow_train
import zwdx
from zwdx import ZWDX

pytestmark = pytest.mark.slow  # server and GPU-client processes


# -- a waiting submit_job and a server SIGKILL ------------------------------------------------------
def test_a_submit_job_already_waiting_rides_through_a_server_sigkill(server, room, start_client):
    start_client("a")
    token = room["token"]
    outcome: dict = {}

    def submit():  # the submitter: one blocking call, started before anything goes wrong
        try:
            outcome["result"] = ZWDX(server.url, remember=False).submit_job(
                mnist.Net(), mnist.create_loader, slow_train, resources=zwdx.Resources(world_size=1),
                                                                            training=zwdx.Training(epochs=3),
                                                                            run=zwdx.Run(room_token=token, progress=False, timeout=300),
                optimizer=torch.optim.AdamW(mnist.Net().parameters(), lr=3e-3))
        except BaseException as exc:  # noqa: BLE001 (the test reports it)
            outcome["error"] = exc
    submitter = threading.Thread(target=submit, name="submitter", daemon=True)
    submitter.start()

    watcher = ZWDX(server.url, remember=False)
    job_id = wait_until(lambda: next((j["id"] for j in watcher.list_jobs(token)), None), 60, what="the job submitted")
    wait_until(lambda: len(watcher.get_job_metrics(job_id, token).get("loss", [])) >= 5, 120, what="training under way")
    assert submitter.is_alive() and not outcome, outcome  # waiting in submit_job

    server.kill(signal.SIGKILL)
    server.popen.wait()
    time.sleep(3)  # away for longer than the SDK's poll interval: it hears nothing meanwhile
    assert submitter.is_alive() and not outcome, outcome
    again = Server(server.data_dir, port=server.port)
    try:
        submitter.join(300)
        assert not submitter.is_alive(), "submit_job still waiting 300 s after the restart"
        assert "error" not in outcome, repr(outcome.get("error"))
        result = outcome["result"]
        assert result["job_id"] == job_id and result["status"] == "completed", result.get("reason")
        job = watcher.get_job(job_id, token)
        assert result["results"]["final_loss"] == job["final_loss"] and job.get("restarts", 0) == 0
        steps = [p["step"] for p in watcher.get_job_metrics(job_id, token)["loss"]]
        assert steps == list(range(3 * 47)), steps  # 3 epochs of 1500 samples in batches of 32, none lost
    finally:
        again.stop()


# -- reporter.checkpoint(): a mid-epoch checkpoint ----------------------------------------------------
def ten_batches(rank, world_size):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 4, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4)


def weight_norm(model) -> float:
    """The squared norm of the weights (their plain sum stays put: a 2-class softmax's gradient
    rows cancel)."""
    return sum((p.detach().double() ** 2).sum().item() for p in model.parameters())


CHECKPOINT_AFTER = 5  # batches


def checkpoint_mid_epoch(model, loader, optimizer, reporter):
    """One pass of ten batches; after the fifth, a checkpoint, then (first attempt) it waits for
    the test to take its GPU client away. Resumed, it skips the batches the checkpoint holds."""
    done = reporter.resume["step"] if reporter.resume else 0
    if reporter.resume:
        reporter.log_metrics(resumed_step=done, resumed_epoch_complete=float(reporter.resume["epoch_complete"]),
                             restored_weight_norm=weight_norm(model), step=done)
    loss = torch.tensor(0.0)
    for i, (x, y) in enumerate(loader):
        if i < done:
            continue
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        reporter.log_metrics(loss=loss.item(), step=i)
        if i == CHECKPOINT_AFTER - 1 and not reporter.resume:
            reporter.log_metrics(weight_norm_at_checkpoint=weight_norm(model), step=i)
            reporter.checkpoint()
            time.sleep(3600)
    return loss.item()


def test_a_resumed_job_goes_on_from_a_mid_epoch_checkpoint(sdk, room, start_client):
    clients = start_client.together("a", "b")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    job_id = sdk.submit_job(model, ten_batches, checkpoint_mid_epoch, resources=zwdx.Resources(world_size=1),
                            training=zwdx.Training(epochs=1),
                            run=zwdx.Run(room_token=room["token"], progress=False), optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                            wait=False)
    job = wait_until(lambda: (j := sdk.get_job(job_id)).get("latest_checkpoint") and j, 120, what="the checkpoint")
    saved = job["latest_checkpoint"]
    assert (saved["epoch"], saved["step"], saved["epoch_complete"]) == (0, CHECKPOINT_AFTER, False), saved
    victim = next(c for c in clients if c.client_id == job["placement"][0]["client_id"])
    victim.kill(signal.SIGKILL)

    result = sdk.wait(job_id, progress=False, timeout=240)
    assert result["status"] == "completed", result.get("reason")
    job = sdk.get_job(job_id)
    assert job["restarts"] == 1 and job["placement"][0]["client_id"] != victim.client_id
    assert job["restart_history"][0]["from_checkpoint"]["n"] == saved["n"]
    series = sdk.get_job_metrics(job_id)
    assert [p["value"] for p in series["resumed_step"]] == [CHECKPOINT_AFTER]
    assert [p["value"] for p in series["resumed_epoch_complete"]] == [0.0]
    # the resumed rank started from the weights the checkpoint took, not the submitted ones
    [at_checkpoint], [restored] = series["weight_norm_at_checkpoint"], series["restored_weight_norm"]
    assert restored["value"] == pytest.approx(at_checkpoint["value"], abs=1e-9)
    assert restored["value"] != pytest.approx(weight_norm(model), abs=1e-6)
    # every batch trained once: five before the checkpoint, five after it
    assert sorted(p["step"] for p in series["loss"]) == list(range(10)), series["loss"]


# -- checkpoints written in the background ------------------------------------------------------------
def wide_batches(rank, world_size):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 1024, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4)


def checkpoint_then_die_uploading(model, loader, optimizer, reporter):
    """Checkpoint 0 after the second batch; checkpoint 1 after the fourth, and then (first attempt)
    the GPU client and this rank are SIGKILLed at once, while checkpoint 1's upload is half sent:
    its first MiB is on the wire and the rest is held back until the kill (save returned after
    the copy, and the upload goes on in the background; holding it makes the kill land mid-body
    on any machine, never after a fast upload's commit)."""
    import hashlib
    import os
    import signal as signals
    import threading
    half_sent = threading.Event()
    upload = reporter.upload

    class HeldBack:
        """The file, read as requests streams it: the first MiB, then nothing until the kill."""
        def __init__(self, path):
            self.fh, self.size, self.sent = open(path, "rb"), os.path.getsize(path), 0

        def __len__(self):
            return self.size

        def read(self, n=-1):
            if self.sent >= 1 << 20:
                half_sent.set()
                threading.Event().wait()
            block = self.fh.read(min(n if n > 0 else 1 << 16, (1 << 20) - self.sent))
            self.sent += len(block)
            return block

    def upload_held_back(path, file_path):
        if not path.startswith("checkpoints/1/"):
            return upload(path, file_path)
        digest = hashlib.sha256(open(file_path, "rb").read()).hexdigest()
        reporter.session.put(f"{reporter.base}/{path}", data=HeldBack(file_path),
                             headers={"X-Zwdx-Sha256": digest}, timeout=600)

    if not reporter.resume:  # the second attempt's own checkpoints go up whole
        reporter.upload = upload_held_back
    done = reporter.resume["step"] if reporter.resume else 0
    if reporter.resume:
        reporter.log_metrics(resumed_step=done, step=done)
    loss = torch.tensor(0.0)
    for i, (x, y) in enumerate(loader):
        if i < done:
            continue
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        reporter.log_metrics(loss=loss.item(), step=i)
        if not reporter.resume and i in (1, 3):
            n = reporter.checkpoint()
            if i == 3:
                reporter.log_metrics(killed_after_checkpoint=n, step=i)
                reporter.close()  # the metrics above are delivered
                assert half_sent.wait(120), "checkpoint 1's upload never started"
                os.kill(os.getppid(), signals.SIGKILL)  # the GPU client (ranks run as its user here)
                os.kill(os.getpid(), signals.SIGKILL)
    return loss.item()


def test_a_client_lost_while_a_checkpoint_uploads_resumes_from_the_one_before(sdk, room, start_client):
    # ranks as the GPU client's own user, so the rank can take its GPU client down with it
    clients = start_client.together("a", "b", extra=["--isolation", "process"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(12)), torch.nn.Linear(1024, 2))
    job_id = sdk.submit_job(model, wide_batches, checkpoint_then_die_uploading, resources=zwdx.Resources(world_size=1),
                            training=zwdx.Training(epochs=1),
                            run=zwdx.Run(room_token=room["token"], progress=False), optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                            wait=False)
    result = sdk.wait(job_id, progress=False, timeout=300)
    assert result["status"] == "completed", result.get("reason")
    job = sdk.get_job(job_id)
    assert job["restarts"] == 1, job["timeline"]
    assert [c.alive() for c in clients].count(False) == 1  # the first placement's GPU client died
    # checkpoint 1 never committed: the rank died while uploading it; the job went on from 0
    assert job["restart_history"][0]["from_checkpoint"]["n"] == 0, job["restart_history"]
    series = sdk.get_job_metrics(job_id)
    assert [p["value"] for p in series["killed_after_checkpoint"]] == [1]
    assert [p["value"] for p in series["resumed_step"]] == [2]
    assert sorted({p["step"] for p in series["loss"]}) == list(range(6))
