"""DDP step checks (``verify``, ``gpu_client/rank/strategies/step_check.py``) against plain DDP on
the CPU (gloo): training steps per second of rank 0, each rank a process on 127.0.0.1, wrapped as
a zwdx rank wraps it (``parallel.wrap``: zwdx's all-reduce hook, or the step check's hook).

    .venv/bin/python bench/step_check.py [--steps 40] [--repeats 3] [--workers 2]

Rows: plain DDP of W ranks; W workers + W shadows (verify=1, a shadow per worker); plain DDP of
2W ranks (as many processes as the checked run, to tell the hook's cost from the host's cores
shared by twice the processes). Models: ``test`` (test_step_check's, 420 parameters: the
exchange's latency) and ``mlp`` (3 x 1024x1024, 3.1 M: its bytes). Median of ``--repeats`` runs,
with the lowest and highest.
"""
from __future__ import annotations

import argparse
import datetime
import multiprocessing
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

MODELS = {"test": (lambda: nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4)), 8, 8),
          "mlp": (lambda: nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                        nn.Linear(1024, 1024)), 1024, 32)}
WARMUP, TIMEOUT = 3, 120.0


def _party(port: int, tag: str, rank: int, workers: int, shadows: int, model_name: str, steps: int, out) -> None:
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
    hook = None
    if shadows:
        group = check_group(dist.PrefixStore(tag, store), 0, rank, workers + shadows, TIMEOUT)
        hook = StepChecker(group, workers, rank, None if worker else rank - workers).attach
    model = wrap(make(), "DDP", torch.device("cpu"), init_sync=False, hook=hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(100 + (rank if worker else rank - workers))
    x, y = torch.randn(batch, features), torch.randn(batch, model.module[-1].out_features)
    for step in range(WARMUP + steps):
        if step == WARMUP:
            started = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    seconds = time.perf_counter() - started
    dist.destroy_process_group()
    out.put((rank, steps / seconds))


def run(tag: str, workers: int, shadows: int, model_name: str, steps: int) -> float:
    """Rank 0's steps per second in one run."""
    return rank0_rate(_party, workers + shadows, "gpu_client.rank.strategies.step_check",
                      lambda port, rank, out: (port, tag, rank, workers, shadows, model_name, steps, out))


def rank0_rate(party, parties: int, preload: str, args) -> float:
    """What rank 0 of ``parties`` processes put (its steps per second), each ``party(*args(port, rank,
    out))`` (torch and ``preload`` loaded once, in the forkserver), ``port`` a store all may meet at."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", preload])
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)  # binds its own port
    out = context.Queue()
    procs = [context.Process(target=party, args=args(store.port, rank, out)) for rank in range(parties)]
    for proc in procs:
        proc.start()
    try:
        rates = dict(out.get(timeout=2 * TIMEOUT) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return rates[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--models", default="test,mlp")
    args = parser.parse_args()
    w = args.workers
    rows = [(f"plain DDP, {w} ranks", w, 0), (f"step checks, {w} workers + {w} shadows", w, w),
            (f"plain DDP, {2 * w} ranks (same processes)", 2 * w, 0)]
    print("| model | run | steps/s (median) | lowest-highest | ms/step |")
    print("|---|---|---|---|---|")
    for model_name in args.models.split(","):
        for label, workers, shadows in rows:
            rates = [run(f"{model_name}-{workers}-{shadows}-{i}", workers, shadows, model_name, args.steps)
                     for i in range(args.repeats)]
            median = statistics.median(rates)
            print(f"| {model_name} | {label} | {median:.1f} | {min(rates):.1f}-{max(rates):.1f} | "
                  f"{1000 / median:.2f} |", flush=True)


if __name__ == "__main__":
    main()
