"""A torchrun script of the kind users bring to ``zwdx run``: it knows nothing of zwdx.

    torchrun --nproc-per-node 2 train_ddp.py --epochs 3
    zwdx run --nproc 2 train_ddp.py -- --epochs 3
    python train_ddp.py --epochs 3          # one process: world 1, the whole global batch

DDP over gloo (NCCL on GPUs, the model on cuda:LOCAL_RANK) of a seeded nn.Sequential of mixed layers with LayerNorm and
dropout, on a DistributedSampler(shuffle=True) with set_epoch, AdamW; each rank seeds its
generator with 1000 + rank (nanoGPT's seed_offset) for its dropout masks. Rank 0 writes the
model's weights to $ZWDX_OUTPUT_DIR/model.pt (./outputs without zwdx).
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

GLOBAL_BATCH = 16


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(128, 8, generator=g) * torch.linspace(0.5, 2.0, 8) + 0.5
    return TensorDataset(x, x[:, :4].argmax(1))


def build(dropout: float) -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Dropout(dropout), nn.Linear(32, 16),
                         nn.Tanh(), nn.Linear(16, 4))


def main(epochs: int, dropout: float) -> None:
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = build(dropout).to(device)
    torch.manual_seed(1000 + rank)
    net = DDP(model, device_ids=[device.index] if cuda else None) if distributed else model
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    train = data()
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=GLOBAL_BATCH // world, sampler=sampler, drop_last=True)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            optimizer.step()
        print(f"rank {rank} epoch {epoch} loss {loss.item():.6f}")
    if rank == 0:
        out = os.environ.get("ZWDX_OUTPUT_DIR", "outputs")
        os.makedirs(out, exist_ok=True)
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, os.path.join(out, "model.pt"))
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--dropout", type=float, default=0.2)
    args = parser.parse_args()
    main(args.epochs, args.dropout)
