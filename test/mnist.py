"""The MNIST example: a small CNN trained with DDP or FSDP across the GPU clients of a room.

    python test/mnist.py --server http://localhost:4461 --room-token TOKEN [--parallelism FSDP]

Data: with ZWDX_EXAMPLE_DATA=mnist the real MNIST is loaded through torchvision (it downloads,
so it needs the internet and torchvision). The default is scikit-learn's handwritten digits,
which ship inside the package and work offline; the same model fits both (8x8 or 28x28).

The functions keep the signatures of the earlier project's example (``train(model, loader,
optim, eval_func, rank, world_size, epochs=3, reporter=None)`` and ``test(model, loader, rank,
world_size)``), so code written for it runs unchanged.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = self.pool(x).flatten(1)
        return self.fc2(F.relu(self.fc1(x)))


def load_dataset(train: bool = True) -> TensorDataset:
    """Images as float tensors (N, 1, H, W) in [0, 1] and integer labels."""
    if os.environ.get("ZWDX_EXAMPLE_DATA", "digits") == "mnist":
        from torchvision import datasets, transforms
        ds = datasets.MNIST(os.path.expanduser("~/.cache/zwdx-mnist"), train=train, download=True,
                            transform=transforms.ToTensor())
        images = torch.stack([img for img, _ in ds])
        labels = torch.tensor([label for _, label in ds])
        return TensorDataset(images, labels)
    from sklearn.datasets import load_digits
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    split = 1500  # the first 1500 train, the remaining 297 are held out
    return TensorDataset(images[:split], labels[:split]) if train else TensorDataset(images[split:], labels[split:])


def create_loader(rank, world_size):
    dataset = load_dataset(train=True)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    return DataLoader(dataset, batch_size=32, sampler=sampler)


def train(model, loader, optim, eval_func, rank, world_size, epochs=3, reporter=None):
    device = next(model.parameters()).device
    model.train()
    loss = torch.tensor(0.0)
    # After a lost GPU client the platform restores model and optimizer from the last
    # checkpoint and says where to go on from; a fresh job starts at epoch 0.
    start_epoch = reporter.start_epoch if reporter is not None else 0
    for epoch in range(start_epoch, epochs):
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            optim.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optim.step()
            if reporter is not None and i % 5 == 0:
                reporter.log_metrics(loss=loss.item(), epoch=epoch)
        if eval_func is not None:
            metrics = eval_func(model, loader, rank, world_size)
            model.train()
            if reporter is not None:
                reporter.log_metrics(epoch=epoch, **metrics)
        if rank == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f}")
    return loss.item()


def test(model, loader, rank, world_size):
    device = next(model.parameters()).device
    model.eval()
    correct = torch.zeros(2, device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            correct[0] += (model(x).argmax(1) == y).sum()
            correct[1] += y.numel()
    if world_size > 1 and dist.is_initialized():
        dist.all_reduce(correct)
    return {"accuracy": (correct[0] / correct[1]).item()}


def held_out_accuracy(model) -> float:
    data = load_dataset(train=False)
    model.eval()
    with torch.no_grad():
        x, y = data.tensors
        return (model(x).argmax(1) == y).float().mean().item()


def main() -> None:
    import zwdx
    from zwdx import ZWDX
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default=os.environ.get("ZWDX_SERVER_URL", "http://localhost:4461"))
    parser.add_argument("--room-token", default=os.environ.get("ZWDX_ROOM_TOKEN"), required=False)
    parser.add_argument("--parallelism", default="DDP", choices=["DDP", "FSDP"])
    parser.add_argument("--world-size", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    if not args.room_token:
        parser.error("--room-token (or ZWDX_ROOM_TOKEN) is required")

    client = ZWDX(server_url=args.server)
    model = Net()
    result = client.submit_job(model=model, data_loader_func=create_loader, train_func=train, eval_func=test,
                               optimizer=torch.optim.AdamW(Net().parameters(), lr=3e-3),
                               parallelism=args.parallelism,
                               resources=zwdx.Resources(world_size=args.world_size, memory_required=0),
                               training=zwdx.Training(epochs=args.epochs), run=zwdx.Run(room_token=args.room_token))
    print(f"job {result['job_id']}: {result['status']} on {result['world_size']} rank(s), "
          f"final loss {result['results'].get('final_loss'):.4f}, results {result['results']}")
    trained = client.get_trained_model(result["job_id"], Net())
    print(f"held-out accuracy of the trained model: {held_out_accuracy(trained):.3f}")
    series = client.get_job_metrics(result["job_id"])
    print("metric series:", ", ".join(f"{k} ({len(v)} points)" for k, v in series.items()))


if __name__ == "__main__":
    main()
