"""A plain torchrun script in the shape of PyTorch's own DDP tutorial ("Getting Started with
Distributed Data Parallel", its torchrun example): it knows nothing of zwdx.

    torchrun --nproc-per-node 2 ddp.py --steps 3 --lr 0.05
    zwdx run --nproc 2 ddp.py -- --steps 3 --lr 0.05

It reads torchrun's environment, trains a toy model with DistributedDataParallel (gloo on
CPUs, NCCL on GPUs), prints what it sees and its losses on every rank, and rank 0 saves the
model under $ZWDX_OUTPUT_DIR (./outputs without zwdx).
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(steps: int, lr: float):
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    print(f"Start running basic DDP example on rank {rank} of {world_size} (local rank {local_rank} of "
          f"{os.environ['LOCAL_WORLD_SIZE']}, restart {os.environ['TORCHELASTIC_RESTART_COUNT']}).")
    device = torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = ToyModel().to(device)
    ddp_model = DDP(model, device_ids=[local_rank] if cuda else None)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=lr)
    data = torch.Generator().manual_seed(1 + rank)
    for step in range(steps):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10, generator=data).to(device))
        labels = torch.randn(20, 5, generator=data).to(device)
        loss = loss_fn(outputs, labels)
        loss.backward()
        optimizer.step()
        print(f"rank {rank} step {step} loss {loss.item():.6f}")
    total = torch.tensor([loss.item()], device=device)
    dist.all_reduce(total)
    if rank == 0:
        out = os.environ.get("ZWDX_OUTPUT_DIR", "outputs")
        os.makedirs(out, exist_ok=True)
        torch.save(model.state_dict(), os.path.join(out, "model.pt"))
        with open(os.path.join(out, "summary.txt"), "w") as fh:
            fh.write(f"mean final loss {total.item() / world_size:.6f}\n")
        print(f"mean final loss {total.item() / world_size:.6f}")
    dist.destroy_process_group()
    print(f"Finished running basic DDP example on rank {rank}.")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()
    demo_basic(args.steps, args.lr)
