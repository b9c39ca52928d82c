"""One model, four ways to split it over the same GPUs: DDP, FSDP, TP and PIPELINE as zwdx jobs.

    python bench/strategies.py --gpus 2 --model gpt2 --repeat 2 --out $OUT/strategies-2gpu.md
    python bench/strategies.py --gpus 0 --cpu-ranks 2 --model gpt2 --repeat 1    # CPU smoke run (gloo)

Every way trains bench/workload.py's model on the same global batch (``--global-batch``
sequences or images a step; the preset's batch x ranks by default) for the same steps, and
reports what the shared train function measures on rank 0: steady-state samples/s (after
warm-up, between device synchronizes), the window spread, and the GPU memory rank 0 peaked at.
How the batch is cut:

- DDP and FSDP (FSDP2 over the model's blocks): each rank gets global / ranks;
- TP (one GPU client holding every GPU, the plan zwdx derives): one replica, the whole batch;
- PIPELINE (one stage a GPU client, split automatically): one replica, the whole batch in
  ``--microbatches`` micro-batches, ``--schedule`` (1f1b by default).

DDP, FSDP and PIPELINE run on one GPU client per GPU; TP on a second fleet whose one client has
every GPU. Both fleets are up for the whole run (an idle fleet's standby processes wait on a pipe)
so that the ways run interleaved, each first in turn, ``--repeat`` times. The figures are zwdx's
alone: bench/overhead.py compares DDP, FSDP and TP against bare torchrun.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import overhead  # noqa: E402
from harness import median, table  # noqa: E402

WAYS = ("DDP", "FSDP", "TP", "PIPELINE")


def way_config(workload, way: str, model: str, device: str, n: int, args) -> dict:
    """The workload's settings for one way: the same global batch, cut as that way cuts it."""
    base = workload.config(model, device, steps=args.steps, warmup=args.warmup)
    global_batch = args.global_batch or base["batch"] * n
    replicas = n if way in ("DDP", "FSDP") else 1
    if global_batch % replicas:
        raise SystemExit(f"bench: --global-batch {global_batch} does not split over {replicas} ranks")
    extra = {}
    if way == "PIPELINE":
        micro = min(args.microbatches, global_batch)
        if global_batch % micro:
            raise SystemExit(f"bench: --global-batch {global_batch} does not split into {micro} micro-batches")
        extra["submit"] = {"pipeline": {"schedule": args.schedule, "microbatches": micro}}
    return workload.config(model, device, steps=args.steps, warmup=args.warmup, batch=global_batch // replicas,
                           seed=0, parallelism=way, tp=n if way == "TP" else 1, **extra)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=0, help="GPUs; 0: CPU ranks on gloo")
    parser.add_argument("--cpu-ranks", type=int, default=2, help="ranks when --gpus 0")
    parser.add_argument("--model", default="gpt2", help="gpt2 (the blocks PIPELINE and TP split) or cnn")
    parser.add_argument("--ways", default=",".join(WAYS), help="which of " + ", ".join(WAYS))
    harness.run_arguments(parser, timeout=300)
    args = parser.parse_args()
    harness.require(harness.SERVER_MODULES + harness.CLIENT_MODULES + (["pynvml"] if args.gpus else []))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on lent machines
    import workload

    ways = [w.strip().upper() for w in args.ways.split(",") if w.strip()]
    if set(ways) - set(WAYS):
        raise SystemExit(f"bench: --ways takes {', '.join(WAYS)}")
    device = "cuda" if args.gpus else "cpu"
    n = args.gpus or args.cpu_ranks
    where = harness.machine()
    work = tempfile.mkdtemp(prefix="zwdx-bench-strategies-")
    print(f"bench strategies: {', '.join(ways)} on {n} {'GPU' if args.gpus else 'CPU rank'}(s), {where}", flush=True)
    started: list = []
    fleets: dict[str, tuple] = {}
    runs: dict[str, list[dict]] = {}
    failures: list[str] = []
    try:
        for layout in dict.fromkeys("one" if w == "TP" else "each" for w in ways):
            fleet_args = argparse.Namespace(**{**vars(args), "parallelism": "TP" if layout == "one" else "DDP"})
            fleets[layout] = overhead.start_fleet(fleet_args, os.path.join(work, layout), started)
        for rep in range(args.repeat):
            order = ways[rep % len(ways):] + ways[:rep % len(ways)]
            for way in order:
                _, clients, sdk, token = fleets["one" if way == "TP" else "each"]
                cfg = way_config(workload, way, args.model, device, n, args)
                try:
                    overhead.wait_warm(clients, args.settle)
                    r = overhead.run_zwdx(sdk, token, cfg, n, args.timeout)
                except Exception as exc:  # report what did run; say what did not
                    failures.append(f"{way} rep {rep}: {exc}")
                    print(f"  {way:8s} rep {rep}: FAILED: {str(exc)[:2000]}", flush=True)
                    continue
                r["cfg"] = cfg
                runs.setdefault(way, []).append(r)
                print(f"  {way:8s} rep {rep}: {r['samples_per_s']:,.1f} samples/s, step "
                      f"{r['raw']['step_ms']:.1f} ms, wall {r['wall']:.1f} s", flush=True)
    finally:
        harness.stop_all(started, work, args.keep)
    return harness.finish(args.out, report(runs, n, args, where), failures,
                          {"bench": "strategies", "machine": where, "ranks": n, "runs": runs})


def report(runs: dict, n: int, args, where: str) -> str:
    rows = []
    ddp = median([r["samples_per_s"] for r in runs["DDP"]]) if runs.get("DDP") else None
    for way, rs in runs.items():
        cfg = rs[0]["cfg"]
        sps = median([r["samples_per_s"] for r in rs])
        peaks = [r["raw"].get("peak_gib") for r in rs if r["raw"].get("peak_gib") is not None]
        micro = cfg.get("submit", {}).get("pipeline", {}).get("microbatches")
        rows.append([way, "1 client x %d" % n if way == "TP" else "%d clients x 1" % n, cfg["batch"],
                     micro or "-", sps, sps / n, f"{100 * sps / ddp:.1f}%" if ddp else "-",
                     f"{median([overhead._spread(r['raw']) for r in rs]):.1f}%",
                     median([r["raw"]["step_ms"] for r in rs]), median(peaks) if peaks else None,
                     ", ".join(f"{r['samples_per_s']:,.0f}" for r in rs)])
    cfg = next(iter(runs.values()))[0]["cfg"] if runs else {}
    head = (f"\n## One model, four ways: {where}; {args.model}, {n} x {'GPU' if args.gpus else 'CPU rank'}, "
            f"{'bf16 autocast' if args.gpus else 'fp32, gloo'}, {cfg.get('steps')} steps "
            f"({cfg.get('warmup')} warm-up), "
            f"median of {args.repeat} run(s) a way\n\n")
    return head + table(["way", "GPU clients", "batch a replica", "micro-batches", "samples/s", "per GPU",
                         "vs DDP", "window spread", "step ms", "rank 0 peak GiB", "each run samples/s"], rows,
                        "Steady-state throughput (rank 0's train function)")


if __name__ == "__main__":
    sys.exit(main())
