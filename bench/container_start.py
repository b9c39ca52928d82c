"""What a locked-down container per rank costs a job's start: submit to first step with
``zwdx gpu-client --isolation docker`` against ``--isolation process``, side by side.

    python bench/container_start.py                          # CPU slots, 2 ranks, 3 repeats
    python bench/container_start.py --ranks 1 --repeat 5 --out $OUT/container-start.md
    python bench/container_start.py --gpus 0,1               # one GPU client per GPU (NVIDIA runtime)

One server; a room per setup, each with ``--ranks`` GPU clients (a CPU slot each, or one GPU
each): ranks as processes, ranks in containers with a standby container per slot (the
default), and in fresh containers (``--no-standby``). Once every client is registered and its
standby is ready (``--settle`` seconds), the same small job (the MNIST example's model and
data, DDP, one epoch) is submitted to each room in turn, ``--repeat`` times, rotating which
goes first. The job's train function notes when its first step starts (the wall clock is the
machine's, inside a container too). Reported per setup, as medians: submit -> first step, and
the part of it from the job's arrival at rank 0's client to its rank process (or container)
holding the spec, and to its train function; submit -> ``submit_job`` returned.

Needs a Docker engine and the GPU-client image (``--image``; the tests' CPU build by default):
test/dockerd.py starts the engine with ../shared/docker-sandbox where none answers (stopping
it again at the end) and builds the image.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import GpuClientProc, ServerProc, median, table, wait_until  # noqa: E402

sys.path.insert(0, os.path.join(harness.ROOT, "test"))
import dockerd  # noqa: E402
import zwdx
import mnist  # noqa: E402

SETUPS = {"process": ["--isolation", "process"], "user": ["--isolation", "user"], "docker": ["--isolation", "docker"],
          "docker (no standby)": ["--isolation", "docker", "--no-standby"]}


def train(model, loader, optim, rank, world_size, epochs=1):
    """The example's training, noting when the first step starts."""
    import time

    import torch.nn.functional as F
    first, loss = None, None
    device = next(model.parameters()).device
    for _ in range(epochs):
        for x, y in loader:
            first = first or time.time()
            optim.zero_grad()
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            loss.backward()
            optim.step()
    return {"first_step_at": first, "final_loss": loss.item()}


def run_job(sdk, token: str, ranks: int) -> dict:
    import torch
    submitted = time.time()
    res = sdk.submit_job(mnist.Net(), mnist.create_loader, train, None, torch.optim.AdamW(mnist.Net().parameters(),
                         lr=3e-3), "DDP", 0, resources=zwdx.Resources(world_size=ranks),
                         training=zwdx.Training(epochs=1), run=zwdx.Run(room_token=token, progress=False, timeout=600))
    returned = time.time()
    if res["status"] != "completed":
        raise RuntimeError(f"job {res['job_id']} {res['status']}: {res.get('reason')}")
    marks = {}
    for entry in sdk.get_job_logs(res["job_id"], token):
        if entry.get("rank") == 0 and entry["text"].startswith("startup, "):
            marks = {k: float(v) for k, v in (p.split("=") for p in entry["text"].split(": ", 1)[1].split())}
    return {"to_first_step": res["results"]["first_step_at"] - submitted, "to_rank": marks.get("rank_process"),
            "to_train_func": marks.get("train_func"), "returned": returned - submitted, "marks": marks,
            "job_id": res["job_id"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="GPU clients per setup (one rank each)")
    parser.add_argument("--gpus", default="", help="GPU indices, one client each (default: CPU slots)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--settle", type=float, default=15.0, help="seconds for standby processes to get ready")
    parser.add_argument("--image", default=dockerd.CLIENT_IMAGE)
    parser.add_argument("--setups", default=",".join(SETUPS), help="which, comma-separated")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gpus = [g for g in args.gpus.split(",") if g]
    ranks = len(gpus) or args.ranks
    setups = [s.strip() for s in args.setups.split(",")]

    try:
        engine = dockerd.Engine.start()
    except dockerd.Missing as missing:
        sys.exit(f"bench: {missing}")
    work = tempfile.mkdtemp(prefix="zwdx-bench-container-")
    server, clients = None, []
    try:
        if args.image == dockerd.CLIENT_IMAGE:
            print(f"building {args.image}: {dockerd.build_client_image():.1f} s", flush=True)
        from zwdx import ZWDX
        server = ServerProc(os.path.join(work, "server"))
        sdk = ZWDX(server.url, remember=False)
        rooms = {}
        for n, setup in enumerate(setups):
            room = sdk.create_room(setup)
            rooms[setup] = room["submitter_token"]
            for i in range(ranks):
                clients.append(GpuClientProc(server.url, room["donor_token"], os.path.join(work, f"s{n}c{i}"),
                                             f"s{n}c{i}", gpu=gpus[i] if gpus else None,
                                             extra=[*SETUPS[setup], *(["--allow-image", args.image] if "docker" in setup else [])]))
        for setup, token in rooms.items():
            wait_until(lambda: sum(c["status"] == "online" for c in sdk.get_room(token)["clients"]) == ranks, 120,
                       what=f"the GPU clients of setup {setup}")
        time.sleep(args.settle)
        runs: dict[str, list[dict]] = {s: [] for s in setups}
        for rep in range(args.repeat):
            order = setups[rep % len(setups):] + setups[:rep % len(setups)]
            for setup in order:
                r = run_job(sdk, rooms[setup], ranks)
                runs[setup].append(r)
                print(f"  rep {rep} {setup:19s}: first step {r['to_first_step']:.2f} s, returned "
                      f"{r['returned']:.2f} s; rank 0: {r['marks']}", flush=True)
                time.sleep(args.settle)  # the slots' next standby gets ready, as between real jobs
        rows = [[s, *(median([r[k] for r in runs[s]]) for k in ("to_first_step", "to_rank", "to_train_func",
                                                                   "returned"))] for s in setups]
        kind = f"{ranks} x GPU" if gpus else f"{ranks} CPU slots"
        text = table(["setup", "submit -> first step (s)", "arrival -> rank holds its spec (s)",
                      "arrival -> train_func (s)", "submit -> returned (s)"], rows, digits=2,
                     title=f"Job start by isolation: {kind}, DDP, median of {args.repeat} ({harness.machine()})")
        print(text)
        harness.write_out(args.out, text, {"ranks": ranks, "gpus": gpus, "runs": runs})
    finally:
        for client in clients:
            client.stop()
        if server is not None:
            server.stop()
        engine.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
