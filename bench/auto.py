"""parallelism="AUTO" against each hand choice, on the same GPUs: does AUTO run as fast as the best?

    python bench/auto.py --gpus 2 --model gpt2 --repeat 2 --out $OUT/auto-2gpu.md     # GPT-2 small
    python bench/auto.py --gpus 2 --big --out $OUT/auto-big.md                        # ~10 B: not DDP
    python bench/auto.py --dry                                  # what AUTO picks, no job (any machine)
    python bench/auto.py --gpus 0 --cpu-ranks 2 --ways AUTO,DDP # CPU smoke run (gloo)

Every way trains bench/workload.py's model on the same global batch a step (as bench/strategies.py
cuts it: DDP, FSDP and AUTO global / ranks a rank; PIPELINE one replica in micro-batches) on one
GPU client per GPU, interleaved, each first in turn, ``--repeat`` times; the table says which mode
AUTO chose and why, its samples/s, and each hand choice's. ``--big`` trains a ~10 B shape
(``--big-layers`` x ``--big-dim``, random weights, a few steps) that DDP cannot hold on one GPU
(16 bytes a parameter with AdamW): AUTO should choose a mode that fits, and train. ``--dry`` runs
``zwdx.server.auto.decide`` on the model's counts and slots of ``--slot-gib`` free (no server).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import overhead  # noqa: E402
import strategies  # noqa: E402
from harness import median, table  # noqa: E402

WAYS = ("AUTO", "DDP", "FSDP", "PIPELINE")


def shape(args, device: str) -> dict:
    """The workload's overrides: GPT-2 small's (the preset), or the ~10 B shape with ``--big``."""
    if not args.big:
        return {}
    return {"layers": args.big_layers, "dim": args.big_dim, "heads": args.big_dim // 128, "batch": 1,
            "steps": args.steps or 6, "warmup": 2, "chunks": 2}


def dry(args) -> int:
    """What AUTO would choose for the model on ``--gpus`` (or 2) slots of ``--slot-gib`` free."""
    import torch

    import workload
    from zwdx.sdk.auto import counted
    from zwdx.server.auto import Need, Place, decide
    cfg = workload.config(args.model, "cuda", **shape(args, "cuda"))
    with torch.device("meta"):  # counted without the memory: a ~10 B shape on any machine
        model, optimizer = workload.build(cfg)
    sizes = counted({"parameter_bytes": 0, "state_bytes": 0}, model, optimizer)
    n, free = args.gpus or 2, int(args.slot_gib * 2**30)
    places = [Place(f"gpu-{i}", (free,), "one-host", None) for i in range(n)]
    choice = decide(Need(sizes["state_bytes"], sizes["parameter_bytes"]), places, set(), n)
    print(f"{cfg['model']} ({sizes['parameter_bytes'] / 2**30:.2f} GiB of parameters) on {n} x {args.slot_gib:g} GiB "
          f"free: {choice.parallelism.value if choice.parallelism else 'nothing'} ({choice.reason})")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=0, help="GPUs; 0: CPU ranks on gloo")
    parser.add_argument("--cpu-ranks", type=int, default=2, help="ranks when --gpus 0")
    parser.add_argument("--model", default="gpt2", help="gpt2 or cnn")
    parser.add_argument("--ways", default=None, help=f"which of {', '.join(WAYS)} (--big: AUTO alone)")
    parser.add_argument("--big", action="store_true", help="the ~10 B shape DDP cannot hold")
    parser.add_argument("--big-layers", type=int, default=32)
    parser.add_argument("--big-dim", type=int, default=5120)
    parser.add_argument("--dry", action="store_true", help="print AUTO's choice for the model; run nothing")
    parser.add_argument("--slot-gib", type=float, default=139.0, help="--dry: free memory of each slot")
    harness.run_arguments(parser, timeout=1800)
    args = parser.parse_args()
    if args.dry:
        return dry(args)
    harness.require(harness.SERVER_MODULES + harness.CLIENT_MODULES + (["pynvml"] if args.gpus else []))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on lent machines
    import workload

    ways = [w.strip().upper() for w in (args.ways or ("AUTO" if args.big else ",".join(WAYS))).split(",") if w.strip()]
    if set(ways) - set(WAYS):
        raise SystemExit(f"bench: --ways takes {', '.join(WAYS)}")
    device = "cuda" if args.gpus else "cpu"
    n = args.gpus or args.cpu_ranks
    where, work = harness.machine(), tempfile.mkdtemp(prefix="zwdx-bench-auto-")
    print(f"bench auto: {', '.join(ways)} on {n} {'GPU' if args.gpus else 'CPU rank'}(s), {where}", flush=True)
    started: list = []
    runs: dict[str, list[dict]] = {}
    failures: list[str] = []
    try:
        _, clients, sdk, token = overhead.start_fleet(argparse.Namespace(**{**vars(args), "parallelism": "DDP"}),
                                                      os.path.join(work, "fleet"), started)
        for rep in range(args.repeat):
            for way in ways[rep % len(ways):] + ways[:rep % len(ways)]:
                cut = "DDP" if way == "AUTO" else way  # AUTO's batch as DDP's: the same global batch if it picks DDP
                cfg = {**strategies.way_config(workload, cut, args.model, device, n, args), **shape(args, device),
                       "parallelism": way}
                try:
                    overhead.wait_warm(clients, args.settle)
                    r = overhead.run_zwdx(sdk, token, cfg, n, args.timeout)
                except Exception as exc:  # report what did run; say what did not
                    failures.append(f"{way} rep {rep}: {exc}")
                    print(f"  {way:8s} rep {rep}: FAILED: {str(exc)[:2000]}", flush=True)
                    continue
                r["cfg"], r["auto"] = cfg, sdk.get_job(r["job_id"], token).get("auto")
                runs.setdefault(way, []).append(r)
                chose = f" (chose {r['auto']['parallelism']})" if r["auto"] else ""
                print(f"  {way:8s} rep {rep}: {r['samples_per_s']:,.1f} samples/s{chose}, wall {r['wall']:.1f} s",
                      flush=True)
    finally:
        harness.stop_all(started, work, args.keep)
    return harness.finish(args.out, report(runs, n, args, where), failures,
                          {"bench": "auto", "machine": where, "ranks": n, "runs": runs})


def report(runs: dict, n: int, args, where: str) -> str:
    best = max((median([r["samples_per_s"] for r in rs]) for w, rs in runs.items() if w != "AUTO"), default=None)
    rows = []
    for way, rs in runs.items():
        sps = median([r["samples_per_s"] for r in rs])
        chosen = rs[0].get("auto") or {}
        rows.append([way, chosen.get("parallelism", "-"), sps, f"{100 * sps / best:.1f}%" if best else "-",
                     f"{median([overhead._spread(r['raw']) for r in rs]):.1f}%", median([r["wall"] for r in rs]),
                     chosen.get("reason", "")[:160]])
    model = f"~10 B shape ({args.big_layers} x {args.big_dim})" if args.big else args.model
    head = (f"\n## AUTO against each hand choice: {where}; {model}, {n} x {'GPU' if args.gpus else 'CPU rank'}, "
            f"median of {args.repeat} run(s) a way\n\n")
    return head + table(["way", "AUTO chose", "samples/s", "vs best hand choice", "window spread", "wall s", "why"],
                        rows, "Steady-state throughput (rank 0's train function)")


if __name__ == "__main__":
    sys.exit(main())
