"""How long a checkpoint holds training up: this checkout against another (the code before a
change), side by side in one run, on the same machine, model and steps.

    python bench/checkpoint_stall.py --gpus 2 --baseline ../zwdx-before               # gpt2 (124 M), DDP
    python bench/checkpoint_stall.py --gpus 2 --parallelism FSDP --baseline ../zwdx-before
    python bench/checkpoint_stall.py --gpus 2 --set layers=24 --set dim=2048 --set heads=16 --batch 2   # ~1.3 B
    python bench/checkpoint_stall.py --gpus 0 --cpu-ranks 2 --checkpoints 2            # CPU smoke run
    python bench/checkpoint_stall.py --gpus 2 --parallelism FSDP --where               # where the stall goes

Each side starts its own server and GPU clients (one per GPU, or CPU ranks) from its checkout
and runs one job of ``bench/workload.py``'s GPT: ``--between`` steps, then ``reporter.checkpoint()``,
``--checkpoints`` times, then ``--between`` steps more. Per checkpoint, rank 0 measures:

- **stall**: the wall time of the ``reporter.checkpoint()`` call (the device synchronised on
  both sides of it): what training waits for;
- **steps after**: how much longer the ``--between`` steps after the checkpoint took than the
  ones before it (a checkpoint written in the background competes for the host meanwhile);
- **to commit**: from the call until the server lists the checkpoint as committed (the job's
  ``latest_checkpoint``, polled by the SDK every 0.1 s).

The model is sent as its settings and rebuilt from its seed on each rank (a ``__reduce__``), so
that a 1 B-parameter model is not a 5 GB bundle; the optimizer is AdamW (its state is twice the
model's).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time


def _root(argv: list[str]) -> str:
    """The checkout whose zwdx this process runs: ``--code DIR`` (a child), else this one's."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.abspath(argv[argv.index("--code") + 1]) if "--code" in argv else here


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # workload.py
sys.path.insert(0, _root(sys.argv))


def shipped_as_settings(cfg: dict):
    """The workload's GPT, pickled as its settings: rebuilt (same seed, same weights) where unpickled."""
    import workload
    model, optimizer = workload.build(cfg)
    gpt, seed, shape = workload.GPT, cfg["seed"], (cfg["vocab"], cfg["seq"], cfg["layers"], cfg["heads"], cfg["dim"])

    def rebuild():
        import torch
        torch.manual_seed(seed)
        return gpt(*shape)
    model.__class__ = type("SettingsGPT", (gpt,), {"__reduce__": lambda self: (rebuild, ())})
    return model, optimizer


def sample_thread(ident: int, every: float = 0.002):
    """Where thread ``ident`` is, every ``every`` s, until ``stop()``: returns (a Counter of its
    innermost frames, a Counter of stalls of the sampler itself (another thread kept the GIL),
    stop). Runs in the rank process, as a thread of the train function's."""
    import collections
    import traceback
    seen, held = collections.Counter(), collections.Counter()
    done = threading.Event()

    def run():
        last = time.perf_counter()
        while not done.wait(every):
            now = time.perf_counter()
            frame = sys._current_frames().get(ident)
            if frame is None:
                continue
            where = " < ".join(f"{f.name} ({os.path.basename(f.filename)}:{f.lineno})"
                               for f in reversed(traceback.extract_stack(frame)[-4:]))
            seen[where] += 1
            if now - last > 10 * every:  # the GIL was another thread's meanwhile
                held[where] += round((now - last) * 1000)
            last = now
    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def stop():
        done.set()
        thread.join()
    return seen, held, stop


def functions(cfg: dict, between: int, checkpoints: int, pause: float, where: bool = False):
    def data_loader(rank, world_size, device):
        return [None]  # train_func makes its batches on the device

    def train(model, optimizer, rank, device, reporter):
        import torch
        import torch.nn.functional as F
        device = torch.device(device)
        cuda = device.type == "cuda"
        gen = torch.Generator(device=device).manual_seed(rank)
        tokens = torch.randint(0, cfg["vocab"], (4, cfg["batch"], cfg["seq"] + 1), generator=gen, device=device)
        loader = [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in tokens]

        def sync():
            if cuda:
                torch.cuda.synchronize(device)

        def steps(n: int) -> float:
            sync()
            t = time.perf_counter()
            for i in range(n):
                x, y = loader[i % len(loader)]
                with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=cuda):
                    out = model(x)
                    loss = F.cross_entropy(out.float().view(-1, out.shape[-1]), y.view(-1))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            sync()
            return time.perf_counter() - t

        steps(3)  # warm-up (and AdamW's state exists)
        before = steps(between)
        found = []
        for k in range(checkpoints):
            sync()
            if where:
                seen, held, stop = sample_thread(threading.get_ident())
            t = time.perf_counter()
            reporter.checkpoint()
            sync()
            stall = time.perf_counter() - t
            if where:
                stop()
                found.append({"checkpoint": k, "stall_s": stall,  # lists, not tuples: results are JSON
                              "samples": [[f, n] for f, n in seen.most_common(6)],
                              "gil_elsewhere_ms": [[f, ms] for f, ms in held.most_common(3)]})
            after = steps(between)
            reporter.log_metrics(step=k, stall_s=stall, steps_before_s=before, steps_after_s=after,
                                 called_at=time.time() - stall - after)
            before = after
            time.sleep(pause)  # the previous checkpoint's upload done before the next (a real interval)
        return {"ok": 1.0, "where": found}

    return data_loader, train


def child(args) -> dict:
    import torch

    import zwdx
    from zwdx import ZWDX
    from zwdx.testing import GpuClientProc, ServerProc, wait_until
    import workload
    device = "cuda" if args.gpus else "cpu"
    cfg = workload.config("gpt2", device, batch=args.batch, seed=0,
                          **{k: int(v) for k, v in (item.split("=", 1) for item in args.set)})
    work = tempfile.mkdtemp(prefix="zwdx-bench-ckpt-")
    # a ~1 B model's DDP state.pt (weights and AdamW's state) is past the default 8 GiB artifact limit
    server = ServerProc(os.path.join(work, "server"), env={"ZWDX_MAX_ARTIFACT_BYTES": str(64 * 1024**3)})
    clients = []
    try:
        sdk = ZWDX(server.url)
        room = sdk.create_room("bench-checkpoint")
        token = room["submitter_token"]
        n = args.gpus or args.cpu_ranks
        clients = [GpuClientProc(server.url, room["donor_token"], os.path.join(work, f"c{i}"), f"bench-{i}",
                                 gpu=i if args.gpus else None) for i in range(n)]
        wait_until(lambda: sum(c["status"] == "online" for c in sdk.get_room(token)["clients"]) == n, 120,
                   what=f"{n} gpu clients online")
        model, optimizer = shipped_as_settings(cfg)
        params = sum(p.numel() for p in model.parameters())
        data_loader, train = functions(cfg, args.between, args.checkpoints, args.pause, where=args.where)
        committed: dict[int, float] = {}
        job_id = sdk.submit_job(model=model, data_loader_func=data_loader, train_func=train, optimizer=optimizer,
                                parallelism=args.parallelism, resources=zwdx.Resources(world_size=n),
                                training=zwdx.Training(epochs=1),
                                run=zwdx.Run(room_token=token, name="bench-checkpoint", progress=False), wait=False)
        del model, optimizer
        done = threading.Event()

        def watch():  # when each checkpoint shows as committed
            while not done.is_set():
                latest = (sdk.get_job(job_id, token).get("latest_checkpoint") or {})
                if "n" in latest and latest["n"] not in committed:
                    committed[latest["n"]] = time.time()
                time.sleep(0.1)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        res = sdk.wait(job_id, token, progress=False, timeout=args.timeout, raise_on_failure=False)
        done.set()
        watcher.join()
        if res["status"] != "completed":
            raise RuntimeError(f"job {job_id} {res['status']}: {res.get('reason')}")
        metrics = sdk.get_job_metrics(job_id, token)
        rows = []
        for k in range(args.checkpoints):
            pick = {name: next(p["value"] for p in metrics[name] if p["rank"] == 0 and p["step"] == k)
                    for name in ("stall_s", "steps_before_s", "steps_after_s", "called_at")}
            at = committed.get(k)
            rows.append({"stall_s": pick["stall_s"], "steps_extra_s": pick["steps_after_s"] - pick["steps_before_s"],
                         "to_commit_s": (at - pick["called_at"]) if at else None})
        return {"params": params, "checkpoints": rows, "device": torch.cuda.get_device_name(0) if args.gpus else "cpu",
                "where": (res.get("results") or {}).get("where") or []}
    finally:
        GpuClientProc.stop_all(clients)  # together: each takes seconds to stop its ranks
        server.stop()


def side(code: str, args) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), "--child", "--code", code, "--gpus", str(args.gpus),
            "--cpu-ranks", str(args.cpu_ranks), "--parallelism", args.parallelism, "--between", str(args.between),
            "--checkpoints", str(args.checkpoints), "--pause", str(args.pause), "--timeout", str(args.timeout)]
    argv += ["--where"] if args.where else []
    argv += (["--batch", str(args.batch)] if args.batch else []) + [x for s in args.set for x in ("--set", s)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout + 120)
    line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith("{")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{code}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=0)
    parser.add_argument("--cpu-ranks", type=int, default=2)
    parser.add_argument("--parallelism", choices=["DDP", "FSDP"], default="DDP")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=INT", help="a gpt2 setting, e.g. layers=24")
    parser.add_argument("--between", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--checkpoints", type=int, default=3)
    parser.add_argument("--pause", type=float, default=0.0,
                        help="seconds of no training after the steps that follow each checkpoint (a longer "
                             "interval between checkpoints than --between steps, without the steps)")
    parser.add_argument("--baseline", default=None, help="another checkout, measured the same way first")
    parser.add_argument("--where", action="store_true",
                        help="sample rank 0's training thread every 2 ms during each stall and print where it "
                             "was (and where another thread kept the GIL); the samples cost a little time")
    parser.add_argument("--timeout", type=float, default=400)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--code", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sides = ([("baseline", args.baseline)] if args.baseline else []) + [("this checkout", here)]
    results = {name: side(code, args) for name, code in sides}
    first = next(iter(results.values()))
    title = (f"\n### Checkpoint stall: {first['device']} x {args.gpus or args.cpu_ranks}, {args.parallelism}, "
             f"gpt2 of {first['params'] / 1e6:,.0f} M parameters + AdamW, {args.checkpoints} checkpoints, "
             f"{args.between} steps and {args.pause:g} s apart\n\n")
    lines = ["| code | first checkpoint's stall s | later ones' stall s (median, max) | extra s in the next steps "
             "(median) | to commit s (median) |", "|---|---|---|---|---|"]
    for name, r in results.items():
        stalls = [c["stall_s"] for c in r["checkpoints"]]
        later = stalls[1:] or stalls
        extra = [c["steps_extra_s"] for c in r["checkpoints"]]
        commit = [c["to_commit_s"] for c in r["checkpoints"] if c["to_commit_s"] is not None]
        lines.append(f"| {name} | {stalls[0]:.3f} | {statistics.median(later):.3f}, {max(later):.3f} | "
                     f"{statistics.median(extra):+.3f} | {statistics.median(commit) if commit else float('nan'):.2f} |")
    text = title + "\n".join(lines) + "\n"
    if args.out:  # the raw figures first: a table that fails to print loses nothing
        with open(args.out + ".json", "a") as fh:
            fh.write(json.dumps({"args": vars(args), "results": results}) + "\n")
    for name, r in results.items():
        for found in r.get("where") or []:
            if isinstance(found, str):  # code before 22ff444 sent a result's nested dicts as their repr
                found = ast.literal_eval(found)
            text += (f"\n{name}, checkpoint {found['checkpoint']} (stall {found['stall_s']:.3f} s): where rank 0's "
                     f"training thread was, 2 ms samples\n\n| samples | innermost frames first |\n|---|---|\n")
            text += "".join(f"| {n} | {frames} |\n" for frames, n in found["samples"])
            text += "".join(f"| GIL elsewhere {ms} ms | {frames} |\n" for frames, ms in found["gil_elsewhere_ms"])
    print(text, flush=True)
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
