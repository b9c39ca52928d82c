"""Training functions for tests that must act while a job trains."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def a_few_steps(model, loader, optimizer):
    """Three steps: well under a second of training, less than the 2 s sampling interval."""
    for i, (x, y) in enumerate(loader):
        x, y = x.to(next(model.parameters()).device), y.to(next(model.parameters()).device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if i == 2:
            break
    return loss.item()


def slow_train(model, loader, optimizer, rank, world_size, epochs, reporter, device, eval_func=None):
    """The MNIST loop, slowed down so that a test can act mid-epoch (or a page watch it): a loss
    each step, after each epoch ``eval_func``'s metrics and, on rank 0, a line ``epoch N: loss
    L`` with the loss it will return in full. It follows the resume pattern: start at
    reporter.start_epoch, with model and optimizer already restored."""
    loss = torch.tensor(0.0)
    for epoch in range(reporter.start_epoch, epochs):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            reporter.log_metrics(loss=loss.item(), epoch=epoch)
            time.sleep(0.04)  # paces training so that a test can act mid-job
        if eval_func is not None:
            reporter.log_metrics(epoch=epoch, **eval_func(model, loader, rank, world_size))
            model.train()
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item()!r}")
    return loss.item()


class StepCounter:
    """The user's own state, kept in checkpoints through ``reporter.track``."""

    def __init__(self):
        self.steps, self.epochs = 0, 0

    def state_dict(self):
        return {"steps": self.steps, "epochs": self.epochs}

    def load_state_dict(self, state):
        self.steps, self.epochs = state["steps"], state["epochs"]


def tracked_train(model, loader, optimizer, rank, epochs, reporter, device):
    """``slow_train`` with a StepLR scheduler and a StepCounter tracked, and random draws from
    generators seeded per rank; it reports what it sees at each epoch's start and each step."""
    import random
    random.seed(100 + rank)
    torch.manual_seed(100 + rank)
    scheduler = reporter.track(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5))
    counter = reporter.track(StepCounter())
    resumed = float(reporter.resume is not None)
    loss = torch.tensor(0.0)
    for epoch in range(reporter.start_epoch, epochs):
        reporter.log_metrics(epoch_start=epoch, lr=scheduler.get_last_lr()[0], counted_steps=counter.steps,
                             counted_epochs=counter.epochs, resumed=resumed)
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            reporter.log_metrics(loss=loss.item(), epoch=epoch, draw_index=counter.steps, py_draw=random.random(),
                                 torch_draw=torch.rand(1).item(), resumed=resumed)
            counter.steps += 1
            time.sleep(0.04)  # paces training so that a test can act mid-job
        scheduler.step()
        counter.epochs += 1
    return loss.item()


def logged_steps(model, loader, optimizer, reporter):
    """A pass over the loader, each step's loss a metric; the last loss as the result."""
    for step, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        reporter.log_metrics(loss=loss.item(), step=step)
    return {"final_loss": loss.item()}


def start_placed(app, room, job: dict, world_size: int, shadows: dict[int, int] | None = None,
                 tokens: bool = False) -> list:
    """``job`` (submitted to ``room``, a ``conftest.Api`` of the in-process ``app``) started as the
    scheduler starts it: ``world_size`` GPU clients of one CPU slot each, rank r on the r-th, under
    a rank key the test holds. ``shadows`` (shadow's rank -> the worker it runs again): the
    placement's last ranks are the job's shadows (``verify``); ``tokens``: GPU client r registered
    with donor token ``tok-r``. Each rank's Api (its key alone), in rank order."""
    from zwdx.protocol import SlotKind
    from zwdx.protocol.job import PlacementEntry, Shadow
    from zwdx.server.auth import hash_secret
    from zwdx.server.jobs import Job
    store, job_id, room_id = app.extensions["zwdx"].store, job["id"], room.room["id"]
    keys = {r: f"rk_{job_id}_{r}" for r in range(world_size)}
    for r in keys:
        client = f"gpu-{job_id}-{r}"
        store.upsert_client({"id": client, "room_id": room_id, "hostname": f"h{r}", "status": "online",
                             **({"token_id": f"tok-{r}"} if tokens else {})},
                            [{"id": f"{client}:0", "client_id": client, "room_id": room_id, "index": 0, "kind": "cpu"}])
    placement = [PlacementEntry(rank=r, client_id=f"gpu-{job_id}-{r}", gpu_index=0, kind=SlotKind.CPU) for r in keys]
    shadowed = {"shadows": {str(s): Shadow(of=w, client_id=f"gpu-{job_id}-{s}") for s, w in shadows.items()}} \
        if shadows else {}
    assert Job.load(store, job_id).start(placement, [f"gpu-{job_id}-{r}:0" for r in keys],
                                         {r: hash_secret(k) for r, k in keys.items()}, **shadowed)
    return [room.as_(None, rank_key=k) for k in keys.values()]
