"""How pinning a checkpoint's host buffers in the background holds the training thread up: the
CUDA driver's own pinned allocation against PyTorch's registered pinning (the setting
``gpu_client/agent/launcher.py`` gives every rank), and pageable memory, on one GPU.

    python bench/pinning.py                                  # gpt2 (124 M): 1.4 GiB of state
    python bench/pinning.py --set layers=24 --set dim=2048 --set heads=16 --batch 2   # ~1.3 B: 15 GiB
    python bench/pinning.py --out $OUT/pinning.md

Each way runs in a process of its own (the allocator setting is read at start): the workload's
GPT trains on ``cuda:0`` with AdamW; then, as ``gpu_client/rank/staging.py`` does at a first
checkpoint, its weights and AdamW state are cloned on the GPU, and a thread makes host buffers
and copies the clones into them while training runs ``--steps`` more steps. Printed: how much
longer those steps took than the same steps before, and the thread's time to make the buffers
and to copy.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

#: way -> (the allocator setting of its process, whether its buffers are pinned)
WAYS = {
    "driver": ("", True),
    "registered": ("pinned_use_cuda_host_register:True,pinned_num_register_threads:8", True),
    "pageable": ("", False),
}


def child(args) -> dict:
    import torch
    import torch.nn.functional as F

    import workload
    device = torch.device("cuda", 0)
    cfg = workload.config("gpt2", "cuda", batch=args.batch, **{k: int(v) for k, v in (s.split("=", 1) for s in args.set)})
    model, _ = workload.build(cfg)  # its optimizer is made again below, over the parameters on the GPU
    model = model.to(device)
    optimizer = workload.optimizer(model.parameters(), cfg)
    x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), device=device)

    def steps(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(x)
                loss = F.cross_entropy(out.float().view(-1, out.shape[-1]), x.view(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    steps(5)  # warm-up; AdamW's state exists
    before = steps(args.steps)
    state = [p.detach() for p in model.parameters()] + \
        [v for s in optimizer.state.values() for v in s.values() if v.dim()]
    snapshot = [t.clone() for t in state]
    mark = torch.cuda.current_stream().record_event()
    pinned = WAYS[args.way][1]
    took = {}

    def background():
        t = time.perf_counter()
        block = torch.empty(sum(s.numel() for s in snapshot), dtype=torch.float32, pin_memory=pinned)
        took["buffers_s"] = time.perf_counter() - t
        stream = torch.cuda.Stream()
        stream.wait_event(mark)
        at = 0
        with torch.cuda.stream(stream):
            for s in snapshot:
                block[at:at + s.numel()].view(s.shape).copy_(s, non_blocking=True)
                at += s.numel()
        stream.synchronize()
        took["copy_s"] = time.perf_counter() - t - took["buffers_s"]

    thread = threading.Thread(target=background)
    thread.start()
    after = steps(args.steps)
    thread.join()
    return {"way": args.way, "state_gib": sum(t.numel() * t.element_size() for t in state) / 2**30,
            "steps": args.steps, "before_s": before, "after_s": after, "held_s": after - before, **took,
            "device": torch.cuda.get_device_name(0), "torch": torch.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of: {', '.join(WAYS)}")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--set", action="append", default=[], help="a workload setting, e.g. layers=24")
    parser.add_argument("--out", default=None)
    parser.add_argument("--way", help=argparse.SUPPRESS)  # a child: measure this way, print JSON
    args = parser.parse_args()
    if args.way:
        print(json.dumps(child(args)))
        return
    import torch
    if not torch.cuda.is_available():
        sys.exit("bench/pinning.py measures pinned memory against a GPU's training: no CUDA device here")
    rows = []
    for way in args.ways.split(","):
        if way not in WAYS:
            sys.exit(f"--ways: unknown way {way!r}; the ways are {', '.join(WAYS)}")
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": WAYS[way][0]}
        env.pop("PYTORCH_ALLOC_CONF", None)
        argv = [sys.executable, os.path.abspath(__file__), "--way", way, "--steps", str(args.steps),
                "--batch", str(args.batch)] + [f"--set={s}" for s in args.set]
        out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    first = rows[0]
    lines = [f"\n### Pinning in the background: {first['device']}, torch {first['torch']}, "
             f"{first['state_gib']:.2f} GiB of state, {first['steps']} steps\n",
             "| way | steps before s | steps while the thread runs s | training held s | make buffers s | copy s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['way']} | {r['before_s']:.3f} | {r['after_s']:.3f} | {r['held_s']:+.3f} | "
                     f"{r['buffers_s']:.3f} | {r['copy_s']:.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as fh:
            fh.write(text)
        with open(args.out + ".json", "a", encoding="utf-8") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
