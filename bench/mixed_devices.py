"""Mixed devices: DDP step time over gloo with one rank on a GPU and one on the CPU, the global
batch shared out evenly (unweighted) and by measured speed (weighted), as a devices="mixed"
job shares it.

    python bench/mixed_devices.py                      # CPU smoke run: both ranks on the CPU, rank 1 on 1 thread
    python bench/mixed_devices.py --hidden 2048 --global-batch 1024 --steps 50 --out $OUT/mixed.md   # GPU + CPU

Two processes on 127.0.0.1 meet over gloo (what a mixed job runs): rank 0 on ``cuda:0`` when
there is one (else the CPU), rank 1 on the CPU with ``--cpu-threads`` threads. Both time the
model with ``gpu_client.rank.strategies.mixed.measure`` and all-gather the figures; then, for each way of
sharing the global batch, each rank wraps a copy of the same model in DDP with the gradient
weighted by its share (``failures.watch_gradients``, as ``mixed.Mixed.wrap`` does), runs
``--warmup`` steps and times ``--steps`` SGD steps on synthetic batches made on its device.
Rank 0 prints the seconds per step and the job's samples/s, a Markdown table (``--out FILE``
appends it, and the figures as one JSON object to ``FILE.json``).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpu_client.rank.failures import watch_gradients  # noqa: E402
from gpu_client.rank.strategies.mixed import gather_floats, measure, shares  # noqa: E402
from zwdx.testing import free_port  # noqa: E402


def model(width: int, hidden: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(width, hidden), nn.GELU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(hidden, hidden), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(hidden, 10))


def timed(net: nn.Module, device, batch: int, weight: float, args) -> float:
    """Seconds per DDP step of ``net`` on ``device`` with a batch of ``batch``, its gradient weighted."""
    from torch.nn.parallel import DistributedDataParallel
    ddp = DistributedDataParallel(copy.deepcopy(net).to(device),
                                  device_ids=[device.index] if device.type == "cuda" else None)
    watch_gradients(ddp, weight=weight)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(batch, args.width, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def step():
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    began = time.perf_counter()
    for _ in range(args.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - began) / args.steps


def rank_main(rank: int, port: int, args, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))
    gpu = rank == 0 and torch.cuda.is_available()
    device = torch.device("cuda:0") if gpu else torch.device("cpu")
    torch.set_num_threads(args.gpu_threads if rank == 0 else args.cpu_threads)
    net = model(args.width, args.hidden, args.depth)
    even = shares(args.global_batch, [1.0, 1.0])
    speed = measure(net, device, torch.randn(even[rank], args.width, device=device))
    speeds = gather_floats(speed, device)
    rows = []
    for label, batches in (("unweighted", even), ("weighted", shares(args.global_batch, speeds))):
        seconds = timed(net, device, batches[rank], batches[rank] / args.global_batch, args)
        every = gather_floats(seconds, device)
        rows.append({"sharing": label, "batches": batches, "seconds_per_step": max(every),
                     "samples_per_s": args.global_batch / max(every)})
    if rank == 0:
        queue.put({"devices": [str(device), "cpu"], "measured_samples_per_s": speeds, "rows": rows,
                   "config": vars(args)})
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--gpu-threads", type=int, default=2, help="torch threads of rank 0")
    parser.add_argument("--cpu-threads", type=int, default=1, help="torch threads of rank 1 (the CPU rank)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=rank_main, args=(rank, port, args, queue)) for rank in (0, 1)]
    for proc in procs:
        proc.start()
    result = queue.get(timeout=1800)
    for proc in procs:
        proc.join(60)
    speeds = result["measured_samples_per_s"]
    lines = [f"mixed devices: rank 0 on {result['devices'][0]} ({speeds[0]:.0f} samples/s measured), rank 1 on the "
             f"CPU ({speeds[1]:.0f} samples/s), global batch {args.global_batch}, gloo", "",
             "| sharing | batches | s/step | samples/s |", "|---|---|---|---|"]
    lines += [f"| {r['sharing']} | {' + '.join(map(str, r['batches']))} | {r['seconds_per_step']:.4f} | "
              f"{r['samples_per_s']:.0f} |" for r in result["rows"]]
    gain = result["rows"][0]["seconds_per_step"] / result["rows"][1]["seconds_per_step"]
    lines += ["", f"weighted / unweighted speed: {gain:.2f}x"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(text + "\n\n")
        with open(args.out + ".json", "a") as fh:
            fh.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
