"""FSDP step checks (``verify``, ``gpu_client/rank/strategies/fsdp_check.py``) against plain FSDP on
the CPU (gloo): training steps per second of rank 0, each party a process on 127.0.0.1, wrapped as
a zwdx rank wraps it (``parallel.wrap``, then ``fsdp_check.attach`` for the checked run).

    .venv/bin/python bench/fsdp_check.py [--steps 40] [--repeats 3] [--workers 2]

Runs as ``step_check.py``'s for DDP (its models), side by side: plain FSDP of W ranks; W workers
+ W shadows (verify=1; a shadow runs FSDP in a world of one) with the gradients checked alone, then
with the weights check too (``fsdp_check.Weights``: every rank's weight shard before each forward);
plain FSDP of 2W ranks (as many processes as the checked runs). One FSDP unit per model (its root).
Median of ``--repeats`` runs, lowest and highest.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from step_check import MODELS, TIMEOUT, WARMUP, rank0_rate


def _party(port: int, tag: str, rank: int, workers: int, shadows: int, weights: bool, model_name: str, steps: int,
           out) -> None:
    from gpu_client.rank.strategies.fsdp_check import Steps, attach
    from gpu_client.rank.strategies.parallel import wrap
    from gpu_client.rank.strategies.step_check import StepChecker, check_group
    torch.set_num_threads(1)
    wait = datetime.timedelta(seconds=TIMEOUT)
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=wait)
    worker = rank < workers
    if worker:
        dist.init_process_group("gloo", store=dist.PrefixStore(f"{tag}/default", store), rank=rank,
                                world_size=workers, timeout=wait)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    make, features, batch = MODELS[model_name]
    torch.manual_seed(0)
    model = wrap(make(), "FSDP", torch.device("cpu"))
    if shadows:
        group = check_group(dist.PrefixStore(tag, store), 0, rank, workers + shadows, TIMEOUT)
        attach(model, Steps(StepChecker(group, workers, rank, None if worker else rank - workers)), workers,
               weights=weights)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(100 + (rank if worker else rank - workers))
    x, y = torch.randn(batch, features), torch.randn(batch, model[-1].out_features)
    for step in range(WARMUP + steps):
        if step == WARMUP:
            started = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    seconds = time.perf_counter() - started
    dist.destroy_process_group()
    out.put((rank, steps / seconds))


def run(tag: str, workers: int, shadows: int, weights: bool, model_name: str, steps: int) -> float:
    """Rank 0's steps per second in one run."""
    return rank0_rate(_party, workers + shadows, "gpu_client.rank.strategies.fsdp_check",
                      lambda port, rank, out: (port, tag, rank, workers, shadows, weights, model_name, steps, out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--models", default="test,mlp")
    args = parser.parse_args()
    w = args.workers
    runs = [(f"plain FSDP, {w} ranks", w, 0, False), (f"{w} workers + {w} shadows, gradients", w, w, False),
            (f"{w} workers + {w} shadows, gradients + weights", w, w, True),
            (f"plain FSDP, {2 * w} ranks (same processes)", 2 * w, 0, False)]
    print(f"steps/s of rank 0, median (lowest-highest) of {args.repeats} runs of {args.steps} steps")
    print("| model | " + " | ".join(label for label, *_ in runs) + " |")
    print("|---" * (len(runs) + 1) + "|")
    for model_name in args.models.split(","):
        cells = []
        for _, workers, shadows, weights in runs:
            rates = [run(f"{model_name}-{workers}-{shadows}-{weights}-{i}", workers, shadows, weights, model_name,
                         args.steps) for i in range(args.repeats)]
            cells.append(f"{statistics.median(rates):.1f} ({min(rates):.1f}-{max(rates):.1f})")
        print(f"| {model_name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
