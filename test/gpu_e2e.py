"""The end-to-end checks on NVIDIA GPUs (NCCL), on a GPU machine with two or more:

    python test/gpu_e2e.py --out results.md
    python -m pytest -m gpu -s       # these (once each) and gpu_staging.py, through pytest

A: the MNIST example with DDP and FSDP on 2 GPU clients (one GPU each): world size, backend,
   time per epoch, final loss, held-out accuracy, equal weights on every rank.
B: (3+ GPUs) SIGKILL one of three GPU clients mid-epoch, several times: time to detection and
   to training again, from the last checkpoint, on the other two.
C: SIGKILL the server mid-job and restart it, several times: time until the GPU clients are
   back, and the metric series checked for gaps and duplicates.
D: language models as users write them (test/models.py: a Hugging Face GPT-2 built from a
   config, a model in nanoGPT's shape with tied embeddings and two param groups), DDP and FSDP
   on 2 GPU clients: the eval loss the job reported against the one recomputed here on the
   weights that came back, equal weights on every rank, tied weights still tied.
   ``--lm-only`` runs D alone. Without transformers the GPT-2 rows say they were skipped.
E: a short DDP job (three steps) on 2 GPUs: every rank has gpu_utilization samples (after its
   first step and at the end), rank 0 throughput samples. The script exits 1 if not.
F: a torchrun script run unchanged as a script job (test/scripts/ddp.py, PyTorch's DDP tutorial
   shape) on 2 GPU clients over NCCL, against the same script under torchrun on this machine:
   both ranks' final losses equal, the job's outputs downloaded.
G: the MNIST example as DILOCO (inner steps 20, int8) against DDP on 2 GPU clients, the same
   samples: the final losses, the bytes each worker sent, the rounds.
M: mixed devices (``devices="mixed"``): a GPU client lending GPU 0 and one lending a CPU slot, in
   a room of their own, one DDP job over both (test/mixed_job.py): placement, backend (gloo),
   the timeline's words, each rank's measured samples/s and batch, the weights against one
   process over the same global batches, the eval loss recomputed here.
P: PIPELINE over NCCL on the 2 GPU clients: a 2-stage 1F1B job's losses against one process
   over the same micro-batches, the weights that came back against the eval loss the job
   reported; then a model whose training state does not fit one capped GPU (each rank process
   capped with ``torch.cuda.set_per_process_memory_fraction``, a smaller card's stand-in): DDP
   on one GPU runs out of memory, PIPELINE over two trains it.
``--only F,G`` runs the sections named (of A, C, D, E, F, G, M, P; B runs with 3 GPUs).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mixed_job  # noqa: E402
import needs  # noqa: E402
import mnist  # noqa: E402
import models  # noqa: E402
from procs import Proc, Server, wait_until  # noqa: E402
from workloads import a_few_steps, slow_train  # noqa: E402

from gpu_client.rank.strategies.parallel import fingerprint  # noqa: E402
import zwdx
from zwdx import ZWDX  # noqa: E402


def gpu_client(url, token, gpu, work):
    os.makedirs(work, exist_ok=True)
    return Proc([sys.executable, "-m", "zwdx.cli", "gpu-client", "--server", url, "--gpus",
                 str(gpu), "--client-id", f"gpu{gpu}", "--work-dir", work], os.path.join(work, "client.log"),
                env={"ZWDX_ROOM_TOKEN": token})


def online(sdk, n):
    wait_until(lambda: sum(c["status"] == "online" for c in sdk.get_room()["clients"]) >= n, 60,
               what=f"{n} gpu clients online")


def language_models(sdk, out, epochs: int = 3) -> None:
    out("## D. Language models as users write them, 2 GPU clients")
    out("| parallelism | model | params (held per rank) | time per step (ms) | eval loss (job) | eval loss (here) "
        "| equal weights | tied |")
    out("|---|---|---|---|---|---|---|---|")
    for kind, make, loss_fn in (("gpt2", models.gpt2, models.hf_loss), ("nanogpt", models.nanogpt, models.nano_loss)):
        for par in ("DDP", "FSDP"):
            if kind == "gpt2" and importlib.util.find_spec("transformers") is None:
                out(f"| {par} | {kind} | skipped: transformers missing | | | | | |")
                continue
            model = make(0)
            optimizer = (model.configure_optimizers() if isinstance(model, models.GPT)
                         else torch.optim.AdamW(model.parameters(), lr=3e-3))
            r = sdk.submit_job(model=model, data_loader_func=models.lm_loaders, train_func=models.lm_train(loss_fn),
                               eval_func=models.lm_eval(loss_fn), optimizer=optimizer, parallelism=par,
                               resources=zwdx.Resources(world_size=2), training=zwdx.Training(epochs=epochs),
                               run=zwdx.Run(progress=False))
            series = sdk.get_job_metrics(r["job_id"])
            steps = sorted(p["ts"] for p in series["loss"] if p["rank"] == 0)
            per_step = (steps[-1] - steps[0]) / max(len(steps) - 1, 1)
            held = sorted(int(p["value"]) for p in series["local_params"])
            trained = sdk.get_trained_model(r["job_id"], make(1))
            here = models.local_eval_loss(trained, loss_fn)
            ranks = sdk.get_job(r["job_id"])["ranks"]
            same = {v["fingerprint"] for v in ranks.values()} == {fingerprint(trained.state_dict())}
            total = sum(p.numel() for p in model.parameters())
            out(f"| {par} | {kind} | {total} ({', '.join(map(str, held))}) | {per_step * 1000:.1f} | "
                f"{r['results']['eval_loss']:.5f} | {here:.5f} | {same} | {models.tied(trained)} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu_e2e.md")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", default="/tmp/zwdx-gpu-e2e")
    parser.add_argument("--lm-only", action="store_true", help="run section D only")
    parser.add_argument("--only", default="A,B,C,D,E,F,G,M,P", help="the sections to run, comma-separated")
    args = parser.parse_args()
    ngpu = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0) if ngpu else "none"
    lines = [f"# zwdx on GPUs: {ngpu} x {name}, torch {torch.__version__}", ""]

    def out(line=""):
        print(line, flush=True)
        lines.append(line)
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")

    problems = []
    server = Server(os.path.join(args.work, "server"))
    sdk = ZWDX(server.url)
    room = sdk.create_room("gpu")
    sdk.room_token, token = room["token"], room["donor_token"]
    clients = {g: gpu_client(server.url, token, g, os.path.join(args.work, f"c{g}")) for g in range(min(ngpu, 3))}
    try:
        online(sdk, len(clients))
        if args.lm_only:
            language_models(sdk, out)
            return
        only = set(args.only.upper().split(","))
        if "F" in only:
            script_job(sdk, out, problems)
        if "G" in only:
            diloco_on_gpus(sdk, out, problems)
        if "A" in only:
            mnist_both(sdk, out)
        if "D" in only:
            out("")
            language_models(sdk, out)
        if "E" in only:
            metrics_of_a_short_job(sdk, out, problems)
        if "M" in only:
            mixed_devices(server.url, args.work, out, problems)
        if "P" in only:
            pipelines(sdk, out, problems)
        if len(clients) >= 3 and "B" in only:
            server = lost_client(args, sdk, server, clients, token, out)
        if "C" in only:
            server = server_restarts(args, sdk, server, out)
    finally:
        for c in clients.values():
            c.stop()
        server.stop()
    if problems:
        out("")
        out("FAILED: " + "; ".join(problems))
        sys.exit(1)


def script_job(sdk, out, problems) -> None:
    """F: test/scripts/ddp.py as a script job on 2 GPU clients and under torchrun here."""
    here = os.path.dirname(os.path.abspath(__file__))
    out("## F. A torchrun script as a script job (2 GPU clients, NCCL) and under torchrun")
    out("| side | ranks | backend seen | final losses (rank 0, rank 1) | wall s |")
    out("|---|---|---|---|---|")
    steps = ["--steps", "50", "--lr", "0.05"]
    t0 = time.time()
    r = sdk.submit_script("ddp.py", steps, nproc=2, working_dir=os.path.join(here, "scripts"), progress=False,
                          timeout=300, raise_on_failure=False)
    zwdx_wall = time.time() - t0
    logs = "\n".join(line["text"] for line in sdk.get_job_logs(r["job_id"]))
    with tempfile.TemporaryDirectory() as dest:
        got = sdk.download_outputs(r["job_id"], dest)
        outputs = sorted(os.listdir(got)) if got and os.path.isdir(got) else []
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           os.path.join(here, "scripts", "ddp.py"), *steps], capture_output=True, text=True,
                          timeout=300, cwd=tempfile.mkdtemp())
    torchrun_wall = time.time() - t0

    def finals(text: str) -> list[str]:
        return [re.findall(rf"rank {k} step 49 loss ([0-9.]+)", text)[-1:] for k in (0, 1)]
    zw, tr = finals(logs), finals(proc.stdout)
    out(f"| zwdx script job | 2 | {r['status']} | {zw} | {zwdx_wall:.1f} |")
    out(f"| torchrun | 2 | exit {proc.returncode} | {tr} | {torchrun_wall:.1f} |")
    out(f"outputs: {outputs}")
    if r["status"] != "completed" or zw != tr or "model.pt" not in outputs:
        problems.append(f"F: script job {r['status']}, losses zwdx {zw} torchrun {tr}, outputs {outputs}")
    out("")


def mixed_devices(url, work, out, problems) -> None:
    """M: one devices="mixed" DDP job on GPU 0 and a CPU slot (GPU clients of a room of their own)."""
    import copy
    out("## M. Mixed devices: GPU 0 and a CPU slot in one DDP job (gloo, batches by measured speed)")
    sdk = ZWDX(url)
    room = sdk.create_room("mixed")
    sdk.room_token = room["token"]
    clients = [Proc([sys.executable, "-m", "zwdx.cli", "gpu-client", "--server", url, *slot, "--client-id", name,
                     "--work-dir", os.path.join(work, name)], os.path.join(work, f"{name}.log"),
                    env={"ZWDX_ROOM_TOKEN": room["donor_token"]})
               for name, slot in (("mixed-gpu0", ["--gpus", "0"]), ("mixed-cpu", ["--cpu"]))]
    try:
        online(sdk, 2)
        model = mixed_job.Net()
        t0 = time.time()
        r = sdk.submit_job(model, mixed_job.mixed_loaders, mixed_job.mixed_train, mixed_job.mixed_eval,
                           torch.optim.SGD(model.parameters(), lr=mixed_job.LR), "DDP",
                           strategy=zwdx.Mixed(global_batch=mixed_job.G), resources=zwdx.Resources(world_size=2),
                           training=zwdx.Training(epochs=mixed_job.EPOCHS),
                           run=zwdx.Run(progress=False, raise_on_failure=False, timeout=600))
        wall = time.time() - t0
    finally:
        for c in clients:
            c.stop()
    job = sdk.get_job(r["job_id"])
    if r["status"] != "completed":
        problems.append(f"M: mixed job {r['status']}: {r.get('reason')}")
        out(f"mixed job {r['status']}: {r.get('reason')}")
        return
    metrics = sdk.get_job_metrics(r["job_id"])
    speed = {p["rank"]: p["value"] for p in metrics["measured_speed"]}
    batch = {p["rank"]: int(p["value"]) for p in metrics["batch_size"]}
    kinds = {p["rank"]: p["kind"] for p in job["placement"]}
    started = [e.get("reason") for e in job["timeline"] if e["status"] == "starting"][-1]
    trained = sdk.get_trained_model(r["job_id"], mixed_job.Net(seed=1))
    off = mixed_job.farthest(trained, mixed_job.reference(copy.deepcopy(model)))
    here, reported = mixed_job.local_eval_loss(trained), r["results"]["eval_loss"]
    out("| rank | slot | measured samples/s | batch |")
    out("|---|---|---|---|")
    for rank in sorted(kinds):
        out(f"| {rank} | {kinds[rank]} | {speed[rank]:.0f} | {batch[rank]} |")
    out(f"backend {job['backend']}; timeline: {started}; weights vs one process: {off:.2e} (relative); eval loss "
        f"reported {reported:.6f}, here {here:.6f}; wall {wall:.1f} s")
    if set(kinds.values()) != {"cuda", "cpu"} or job["backend"] != "gloo" or off > 1e-4 \
            or abs(here - reported) > 1e-4 * abs(reported) or sum(batch.values()) != mixed_job.G:
        problems.append(f"M: kinds {kinds}, backend {job['backend']}, weights off by {off:.2e}, eval {here} vs "
                        f"{reported}, batches {batch}")
    out("")


#: P: the capped GPU, a smaller card's stand-in, and the model whose state is over it.
CAP_GIB = 2.5
BIG = {"n_layer": 16, "n_head": 16, "n_embd": 1024}


def capped_loaders(rank, world_size, device):
    """``models.pipe_loaders``, this rank process's GPU capped at ``CAP_GIB`` first."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(CAP_GIB * 2**30 / total, device)
    return models.pipe_loaders(rank, world_size)


def one_gpu_train(model, loader, optimizer, epochs, reporter, device):
    """The plain loop on one GPU (DDP of one rank)."""
    model.train()
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = models.next_token_loss(model(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            reporter.log_metrics(loss=loss.item())
    return loss.item()


def pipelines(sdk, out, problems) -> None:
    """P: PIPELINE on 2 GPU clients over NCCL, and a model over one capped GPU."""
    out("## P. PIPELINE over NCCL on 2 GPU clients")
    out("| run | status | wall s | eval loss reported | here | losses vs one process (max rel) |")
    out("|---|---|---|---|---|---|")
    epochs, micro = 2, 4
    model = models.stage_lm()
    t0 = time.time()
    r = sdk.submit_job(model, models.pipe_loaders, models.pipe_train, models.pipe_eval,
                       torch.optim.AdamW(model.parameters(), lr=3e-3), "PIPELINE",
                       strategy=zwdx.Pipeline(schedule="1f1b", microbatches=micro),
                       resources=zwdx.Resources(world_size=2), training=zwdx.Training(epochs=epochs),
                       run=zwdx.Run(progress=False, raise_on_failure=False, timeout=600))
    wall = time.time() - t0
    if r["status"] != "completed":
        problems.append(f"P: pipeline job {r['status']}: {r.get('reason')}")
        out(f"| 2 stages, 1F1B, {micro} micro-batches | {r['status']} | {wall:.1f} | {r.get('reason')} | | |")
    else:
        _, alone = models.pipe_alone(epochs, micro)
        got = [p["value"] for p in sdk.get_job_metrics(r["job_id"])["loss"] if p["rank"] == 0]
        off = max(abs(a - b) / abs(b) for a, b in zip(got, alone)) if len(got) == len(alone) else float("inf")
        here = models.pipe_local_eval_loss(sdk.get_trained_model(r["job_id"], models.stage_lm(seed=1)))
        reported = r["results"]["eval_loss"]
        out(f"| 2 stages, 1F1B, {micro} micro-batches | completed | {wall:.1f} | {reported:.5f} | {here:.5f} | "
            f"{off:.1e} ({len(got)} steps) |")
        if off > 1e-3 or abs(here - reported) > 1e-4 * abs(reported):
            problems.append(f"P: pipeline losses off by {off:.1e}, eval {here} vs {reported}")

    # a model whose state (weights, gradients, AdamW's two moments: 16 bytes a parameter) is over one capped GPU
    big = models.StageLM(models.GPTConfig(**BIG))
    params = sum(p.numel() for p in big.parameters())
    state = 16 * params / 2**30
    out("")
    out(f"Each rank process capped at {CAP_GIB} GiB (torch.cuda.set_per_process_memory_fraction); the model: "
        f"{params / 1e6:.0f} M parameters, {state:.1f} GiB of weights, gradients and AdamW state")
    out("")
    out("| run | status | wall s | peak note |")
    out("|---|---|---|---|")
    for name, kwargs in (("DDP, 1 GPU", {"parallelism": "DDP", "world_size": 1, "train_func": one_gpu_train}),
                         ("PIPELINE, 2 GPUs (GPipe, 2 stages)", {"parallelism": "PIPELINE", "world_size": 2,
                                                                 "train_func": models.pipe_train})):
        model = models.StageLM(models.GPTConfig(**BIG))
        t0 = time.time()
        r = sdk.submit_job(model, capped_loaders, kwargs["train_func"], models.pipe_eval,
                           torch.optim.AdamW(model.parameters(), lr=1e-4), kwargs["parallelism"],
                           resources=zwdx.Resources(world_size=kwargs["world_size"]), training=zwdx.Training(epochs=1),
                           run=zwdx.Run(progress=False, raise_on_failure=False, timeout=900, recovery=zwdx.Recovery(max_restarts=0)))
        wall = time.time() - t0
        why = (r.get("reason") or "")[:160].replace("|", "/").replace("\n", " ")
        out(f"| {name} | {r['status']} | {wall:.1f} | {why or 'eval loss ' + format(r['results']['eval_loss'], '.4f')} |")
        expected = "failed" if kwargs["parallelism"] == "DDP" else "completed"
        if r["status"] != expected:
            problems.append(f"P: {name} {r['status']} ({why}), expected {expected}")
    out("")


def diloco_on_gpus(sdk, out, problems) -> None:
    """G: the MNIST example as DILOCO and as DDP on 2 GPU clients, the same samples."""
    out("## G. DILOCO against DDP (MNIST example, 2 GPU clients, 3 epochs)")
    out("| parallelism | final loss | held-out accuracy | MB of the largest round upload (rank 0) | rounds | wall s |")
    out("|---|---|---|---|---|---|")
    for par, extra in (("DDP", {}), ("DILOCO", {"strategy": zwdx.Diloco(inner_steps=20, compression="int8")})):
        t0 = time.time()
        r = sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=mnist.train,
                           eval_func=mnist.test, optimizer=torch.optim.AdamW(mnist.Net().parameters(), lr=3e-3),
                           parallelism=par, resources=zwdx.Resources(world_size=2), training=zwdx.Training(epochs=3),
                           run=zwdx.Run(progress=False, raise_on_failure=False), **extra)
        wall = time.time() - t0
        metrics = sdk.get_job_metrics(r["job_id"])
        sent = [p["value"] for p in metrics.get("sent_bytes", []) if p["rank"] == 0]
        rounds = [p["value"] for p in metrics.get("outer_round", []) if p["rank"] == 0]
        acc = mnist.held_out_accuracy(sdk.get_trained_model(r["job_id"], mnist.Net())) \
            if r["status"] == "completed" else float("nan")
        out(f"| {par} | {r.get('final_loss') or float('nan'):.4f} | {acc:.3f} | "
            f"{(max(sent) / 1e6 if sent else 0):.2f} | {int(max(rounds)) if rounds else '-'} | {wall:.1f} |")
        if r["status"] != "completed":
            problems.append(f"G: {par} {r['status']}: {r.get('reason')}")
    out("")


def mnist_both(sdk, out) -> None:
    out("## A. MNIST example, 2 GPU clients")
    out("| parallelism | world size | backend | time per epoch (s) | final loss | eval accuracy | held-out accuracy | equal weights |")
    out("|---|---|---|---|---|---|---|---|")
    for par in ("DDP", "FSDP"):
        epochs = 3
        r = sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=mnist.train,
                           eval_func=mnist.test, optimizer=torch.optim.AdamW(mnist.Net().parameters(), lr=3e-3),
                           parallelism=par, resources=zwdx.Resources(world_size=2),
                           training=zwdx.Training(epochs=epochs), run=zwdx.Run(progress=False))
        job = sdk.get_job(r["job_id"])
        per_epoch = (job["ended_at"] - job["running_at"]) / epochs
        acc = mnist.held_out_accuracy(sdk.get_trained_model(r["job_id"], mnist.Net()))
        same = len({v["fingerprint"] for v in job["ranks"].values()}) == 1
        out(f"| {par} | {job['world_size']} | {job['backend']} | {per_epoch:.3f} | {r['final_loss']:.4f} | "
            f"{r['results'].get('accuracy', 0):.3f} | {acc:.3f} | {same} |")


def metrics_of_a_short_job(sdk, out, problems) -> None:
    out("")
    out("## E. Platform metrics of a short DDP job (2 GPU clients, three steps)")
    out("| rank | gpu_utilization samples | values (%) | throughput samples |")
    out("|---|---|---|---|")
    model = mnist.Net()
    r = sdk.submit_job(model=model, data_loader_func=mnist.create_loader, train_func=a_few_steps,
                       optimizer=torch.optim.SGD(model.parameters(), lr=0.05), resources=zwdx.Resources(world_size=2),
                       run=zwdx.Run(progress=False))
    metrics = sdk.get_job_metrics(r["job_id"])
    for rank in (0, 1):
        util = [p["value"] for p in metrics["gpu_utilization"] if p["rank"] == rank]
        speed = [p for p in metrics["throughput"] if p["rank"] == rank]
        out(f"| {rank} | {len(util)} | {', '.join(f'{v:g}' for v in util)} | {len(speed)} |")
        if len(util) < 2:
            problems.append(f"E: rank {rank} has {len(util)} gpu_utilization sample(s), expected 2 or more")
    if len(metrics["throughput"]) < 2:
        problems.append(f"E: {len(metrics['throughput'])} throughput sample(s), expected 2 or more")



def lost_client(args, sdk, server, clients, token, out):
    out("")
    out("## B. SIGKILL one of three GPU clients mid-epoch (NCCL), resume on two")
    out("| run | detected after (s) | training again after (s) | resumed from epoch | final status |")
    out("|---|---|---|---|---|")
    det, again = [], []
    for run in range(args.repeats):
        job_id = sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=slow_train,
                                optimizer=torch.optim.AdamW(mnist.Net().parameters(), lr=3e-3),
                                resources=zwdx.Resources(world_size=3), training=zwdx.Training(epochs=5),
                                run=zwdx.Run(recovery=zwdx.Recovery(min_world_size=2)), wait=False)
        job = wait_until(lambda: (j := sdk.get_job(job_id)).get("latest_checkpoint") and
                         j["latest_checkpoint"]["epoch"] >= 1 and j, 180, what="checkpoint")
        victim_id = job["placement"][1]["client_id"]
        gpu = int(victim_id[3:])
        clients[gpu].kill(signal.SIGKILL)
        t0 = time.time()
        r = sdk.wait(job_id, progress=False, timeout=300, raise_on_failure=False)
        job = sdk.get_job(job_id)
        res = next(t["at"] for t in job["timeline"] if t["status"] == "resuming")
        run_again = next(t["at"] for t in job["timeline"] if t["status"] == "running" and t["at"] > res)
        det.append(res - t0)
        again.append(run_again - t0)
        out(f"| {run + 1} | {res - t0:.2f} | {run_again - t0:.2f} | "
            f"{job['restart_history'][0]['from_checkpoint']['epoch'] + 1} | {r['status']} |")
        clients[gpu].stop()
        clients[gpu] = gpu_client(server.url, token, gpu, os.path.join(args.work, f"c{gpu}-{run}"))
        online(sdk, 3)
    out(f"| median | {statistics.median(det):.2f} | {statistics.median(again):.2f} | | |")

    return server


def server_restarts(args, sdk, server, out):
    out("")
    out("## C. SIGKILL the server mid-job and restart it (2 GPU clients, DDP over NCCL)")
    out("| run | GPU clients back after (s) | final status | restarts | loss points rank 0 | gaps or duplicates |")
    out("|---|---|---|---|---|---|")
    back_times = []
    for run in range(args.repeats):
        job_id = sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=slow_train,
                                optimizer=torch.optim.AdamW(mnist.Net().parameters(), lr=3e-3),
                                resources=zwdx.Resources(world_size=2), training=zwdx.Training(epochs=3), wait=False)
        wait_until(lambda: len(sdk.get_job_metrics(job_id).get("loss", [])) > 10, 120, what="training")
        server.kill(signal.SIGKILL)
        server.popen.wait()
        t0 = time.time()
        server = Server(server.data_dir, port=server.port)
        r = sdk.wait(job_id, progress=False, timeout=300, raise_on_failure=False)
        back = max(c["connected_at"] for c in sdk.get_room()["clients"] if c["status"] == "online") - t0
        back_times.append(back)
        series = sdk.get_job_metrics(job_id)["loss"]
        bad = any([p["step"] for p in series if p["rank"] == rk] !=
                  list(range(len([p for p in series if p["rank"] == rk]))) for rk in (0, 1))
        out(f"| {run + 1} | {back:.2f} | {r['status']} | {sdk.get_job(job_id).get('restarts', 0)} | "
            f"{len([p for p in series if p['rank'] == 0])} | {bad} |")
    out(f"| median | {statistics.median(back_times):.2f} | | | | |")
    return server


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_the_end_to_end_checks_pass_on_this_machines_gpus(tmp_path):
    """Every section this machine's GPUs allow (two at least), once, as ``python -m pytest -m gpu``
    runs it; the results table is printed (``-s``) and left in the test's tmp_path."""
    needs.cuda(2)
    results = tmp_path / "results.md"
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--repeats", "1", "--out", str(results),
                           "--work", str(tmp_path / "work")], capture_output=True, text=True, timeout=7000)
    print(results.read_text() if results.exists() else "")
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]


if __name__ == "__main__":
    main()
