"""The job of the mixed-devices tests (``test_mixed_devices.py``) and of ``gpu_e2e.py``'s section M:
a small MLP (no layer that depends on the batch), synthetic data, plain SGD, and what one
process makes of the same global batches (``reference``), to compare the job's weights with."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

N, D, H, G, EPOCHS, LR, SEED = 2048, 32, 256, 128, 2, 0.05, 3


class Net(nn.Module):
    """No layer that depends on the batch (no BatchNorm): each rank's gradient is its batch's mean."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, H), nn.Tanh(), nn.Linear(H, 4))

    def forward(self, x):
        return self.body(x)


def data(n: int = N, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g)
    return x, torch.sin(x[:, :4] * 2) + 0.1 * x[:, 4:8]


def mixed_loaders(rank, world_size, batch_size=64, sampler=None):
    from torch.utils.data import DataLoader, TensorDataset
    train = TensorDataset(*data())
    evaluated = TensorDataset(*data(512, seed=1))
    return (DataLoader(train, batch_size=batch_size, sampler=sampler(train, shuffle=True, seed=SEED)),
            DataLoader(evaluated, batch_size=512))


def mixed_train(model, loader, optimizer, epochs, reporter, device):
    loss = None
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.mse_loss(model(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            reporter.log_metrics(loss=loss.item())
    return loss.item()


def mixed_eval(model, loader, device):
    model.eval()
    with torch.no_grad():
        x, y = next(iter(loader))
        return {"eval_loss": F.mse_loss(model(x.to(device)), y.to(device)).item()}


def reference(model: nn.Module, split: tuple[int, ...] | None = None) -> nn.Module:
    """One process over the same global batches (the sampler's order: ``randperm`` seeded with
    seed + epoch, cut into global batches); ``split``: DDP's plain mean of the ranks' means instead."""
    x, y = data()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for epoch in range(EPOCHS):
        order = torch.randperm(N, generator=torch.Generator().manual_seed(SEED + epoch))
        for step in range(N // G):
            at = order[step * G:(step + 1) * G]
            optimizer.zero_grad()
            parts = [at] if split is None else list(at.split(list(split)))
            (sum(F.mse_loss(model(x[p]), y[p]) for p in parts) / len(parts)).backward()
            optimizer.step()
    return model


def farthest(a: nn.Module, b: nn.Module) -> float:
    """The largest difference between two models' tensors, relative to each tensor's largest value."""
    sa, sb = a.state_dict(), b.state_dict()
    return max(float((sa[k] - sb[k]).abs().max() / sb[k].abs().max()) for k in sb)


def local_eval_loss(model: nn.Module) -> float:
    x, y = data(512, seed=1)
    with torch.no_grad():
        return F.mse_loss(model.eval()(x), y).item()
