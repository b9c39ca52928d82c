"""Training functions for tests that must act while a job trains."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F


def slow_train(model, loader, optimizer, rank, world_size, epochs, reporter, device):
    """The MNIST loop, slowed down so that a test can act mid-epoch; it follows the resume
    pattern: start at reporter.start_epoch, with model and optimizer already restored."""
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
            time.sleep(0.04)
    return loss.item()
