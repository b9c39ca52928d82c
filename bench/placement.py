"""What a placement pass and the submit-time hint cost on a large room: ``plan`` (the scheduler,
every pass, for each waiting job) and ``unschedulable`` (each submit), this checkout against
another revision's placement side by side, in one process, no server.

    python bench/placement.py --clients 1000,5000 --slots 4 --busy 0.8 --against 7b07c8c

Prints a Markdown table of medians (ms) over ``--runs`` calls each."""
from __future__ import annotations

import argparse
import importlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GiB = 1 << 30


def load_at(rev: str):
    """Another revision's placement (its module placement.py, or its package placement/), imported
    under another name: its relative imports point at this checkout's zwdx."""
    out = Path(tempfile.mkdtemp(prefix="zwdx-placement-"))
    name = f"placement_{re.sub(r'[^0-9a-zA-Z]', '_', rev)}"
    files = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, "zwdx/server/placement.py",
                            "zwdx/server/placement/"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for path in files:
        text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout
        single = path.endswith("placement.py")
        up = r"from \.\.(?=[\s\w])" if single else r"from \.\.\.(?=[\s\w])"
        text = re.sub(up, "from zwdx.", text).replace("from zwdx. import", "from zwdx import")
        target = out / name / ("__init__.py" if single else Path(path).name)
        target.parent.mkdir(exist_ok=True)
        target.write_text(text)
    sys.path.insert(0, str(out))
    return importlib.import_module(name)


def room(clients: int, slots: int, busy: float) -> list[dict]:
    out = []
    for i in range(clients):
        out.append({"id": f"c{i}", "status": "online", "versions": {"python": "3.11.4"}, "hostname": f"h{i}",
                    "modules": " ".join(f"pkg{k}" for k in range(300)),
                    "slots": [{"id": f"c{i}:{j}", "client_id": f"c{i}", "index": j, "kind": "cuda",
                               "memory_total": 80 * GiB, "memory_free": 80 * GiB,
                               "job_id": "other" if i < clients * busy else None} for j in range(slots)]})
    return out


def timed(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1000,5000")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--busy", type=float, default=0.8, help="the share of GPU clients whose slots hold a job")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--against", help="a git revision whose placement to time beside this checkout's")
    args = ap.parse_args()
    from zwdx.server import placement
    sides = [("this checkout", placement)] + ([(args.against, load_at(args.against))] if args.against else [])
    spec = {"code": {"versions": {"python": "3.11.0"}, "required_modules": ["pkg7"]}, "strategy": {"type": "ddp"},
            "resources": {"world_size": 8, "memory_required": 8 * GiB}, "recovery": {}, "parallelism": "DDP",
            "kind": "function"}
    print("| clients | slots each | placement | plan (ms) | unschedulable (ms) |\n|---|---|---|---|---|")
    for n in (int(x) for x in args.clients.split(",")):
        clients = room(n, args.slots, args.busy)
        slots = [s for c in clients for s in c["slots"]]
        by_id = {c["id"]: c for c in clients}
        for label, module in sides * 2:  # interleaved, twice: the host's load moves
            chosen, _ = module.plan({"spec": spec}, slots, by_id)
            assert chosen and len(chosen) == 8
            p = timed(lambda m=module: m.plan({"spec": spec}, slots, by_id), args.runs)
            u = timed(lambda m=module: m.unschedulable(spec, clients), args.runs)
            print(f"| {n:,} | {args.slots} | {label} | {p:.0f} | {u:.0f} |")


if __name__ == "__main__":
    main()
