"""DDP vs DILOCO over shaped links: the server and two GPU clients (CPU slots) each in a network
namespace, every client's link shaped as a donor's (100 Mbit/s, 50 ms RTT; 1 Gbit/s, 20 ms), a
GPT-2-shaped small model. Needs root, iproute2 and the kernel's tbf qdisc (netem for the delay:
without it the links are rate-limited only, and the table says so).

    sudo python bench/wan.py                                    # both links, DDP and DILOCO (H 50, 500; int8, fp16)
    sudo python bench/wan.py --links 100 --steps 200 --out bench/results/wan-2cpu.md

For each link and each way to train, the same job (the same seeded model, the same synthetic
batches per rank, the same number of steps: equal samples):

- **utilisation**: the share of the wall time, from the first step to the last round, that rank
  0's training thread spent computing: running on a CPU or waiting for one (the kernel's
  ``/proc/thread-self/schedstat``), not sleeping on the network. Counting the time it waited for
  a CPU keeps the figure for what the links cost when other processes share the machine (a
  DILOCO job with no round but the last, on unshaped links, shows what the measure gives with
  no communication);
- **MB sent / worker**: bytes out of each client's namespace during the job (its link's own
  counter: gradients or pseudo-gradients, the trained weights rank 0 uploads at the end, and the
  little else a rank reports; no checkpoints);
- **loss**: the returned weights' loss on held-out batches of the same synthetic language.

The language is a fixed random bigram table (each token has a few likely successors), so the
loss falls from ln(vocab) toward the table's entropy.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import harness  # noqa: F401  (puts the checkout on sys.path)
import requests
import torch
import torch.nn.functional as F

from harness import Child, fmt, free_port, machine, table, wait_until, write_out
from workload import GPT

CFG = {"vocab": 512, "seq": 64, "layers": 4, "heads": 4, "dim": 192, "batch": 8, "lr": 1e-3, "successors": 4}


def sh(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


# -- the synthetic language and the job's functions --------------------------------------------------
def language(seed: int = 0) -> torch.Tensor:
    """A bigram table: each token's next-token probabilities, a few successors each."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.full((CFG["vocab"], CFG["vocab"]), -1e9)
    for t in range(CFG["vocab"]):
        nxt = torch.randperm(CFG["vocab"], generator=gen)[:CFG["successors"]]
        logits[t, nxt] = torch.randn(CFG["successors"], generator=gen)
    return logits.softmax(1)


def batches(table: torch.Tensor, seed: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        tokens = torch.empty(CFG["batch"], CFG["seq"] + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, CFG["vocab"], (CFG["batch"],), generator=gen)
        for i in range(CFG["seq"]):
            tokens[:, i + 1] = torch.multinomial(table[tokens[:, i]], 1, generator=gen).squeeze(1)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def job_functions(steps: int):
    table_ = language()

    def data_loader(rank, world_size):
        made = batches(table_, 1 + rank, 32)
        return [made[i % len(made)] for i in range(steps)]

    def busy() -> float:
        """Seconds this thread ran on a CPU or waited for one (the kernel's schedstat): what it
        spent computing, however busy the machine; not the time it slept on the network."""
        with open("/proc/thread-self/schedstat") as fh:
            ran, waited, _ = (int(v) for v in fh.read().split())
        return (ran + waited) / 1e9

    def train(model, loader, optimizer, reporter):
        started, busy_at = None, 0.0
        model.train()
        loss = torch.tensor(0.0)
        for x, y in loader:
            if started is None:
                started, busy_at = time.time(), busy()
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            optimizer.step()
        return {"final_loss": loss.item(), "train_seconds": time.time() - started, "busy_seconds": busy() - busy_at}
    return data_loader, train


def eval_loss(model) -> float:
    model.eval()
    with torch.no_grad():
        return sum(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
                   for x, y in batches(language(), 999, 8)) / 8


# -- the network ----------------------------------------------------------------------------------
class Net:
    """Namespaces <tag>s, <tag>a, <tag>b on a bridge; ``shape(mbit, rtt_ms)`` shapes each client's
    link both ways (tbf for the rate, netem for the delay where the kernel has it)."""

    def __init__(self):
        self.tag = f"zw{random.randrange(16**4):04x}"
        self.prefix = f"10.{random.randrange(100, 250)}.{random.randrange(1, 250)}"
        self.bridge = f"{self.tag}br"
        self.hosts, self.links = {}, {}
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.prefix}.254/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        self.forward = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
        subprocess.run(["iptables", "-I", *self.forward], capture_output=True)
        for i, name in enumerate(("s", "a", "b"), start=1):
            ns, outer, inner = f"{self.tag}{name}", f"{self.tag}{name}o", f"{self.tag}{name}i"
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            sh("ip", "link", "set", inner, "netns", ns)
            sh("ip", "link", "set", outer, "master", self.bridge)
            sh("ip", "link", "set", outer, "up")
            sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.prefix}.{i}/24", "dev", inner)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", inner, "up")
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            self.hosts[name] = (ns, f"{self.prefix}.{i}")
            self.links[name] = (outer, inner)
        self.delay = True

    def _qdisc(self, ns: str | None, dev: str, mbit: float, delay_ms: float) -> None:
        pre = ["ip", "netns", "exec", ns] if ns else []
        subprocess.run([*pre, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
        if mbit <= 0:
            return
        burst = max(int(mbit * 1e6 / 8 / 250), 16 * 1024)  # 4 ms of bytes
        tbf = ["tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "200ms"]
        if self.delay and delay_ms > 0:
            try:
                sh(*pre, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{delay_ms}ms")
                sh(*pre, "tc", "qdisc", "add", "dev", dev, "parent", "1:", "handle", "2:", *tbf)
                return
            except subprocess.CalledProcessError:
                self.delay = False  # no sch_netem here: rate only
                subprocess.run([*pre, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
        sh(*pre, "tc", "qdisc", "add", "dev", dev, "root", *tbf)

    def shape(self, mbit: float, rtt_ms: float) -> None:
        for name in ("a", "b"):
            outer, inner = self.links[name]
            self._qdisc(self.hosts[name][0], inner, mbit, rtt_ms / 2)  # the client's upload
            self._qdisc(None, outer, mbit, rtt_ms / 2)                  # its download

    def sent(self, name: str) -> int:
        ns, _ = self.hosts[name]
        out = sh("ip", "netns", "exec", ns, "cat", f"/sys/class/net/{self.links[name][1]}/statistics/tx_bytes")
        return int(out)

    def run(self, name: str, args: list[str], log_path: str) -> Child:
        return Child(["ip", "netns", "exec", self.hosts[name][0], *args], log_path)

    def close(self) -> None:
        for ns, _ in self.hosts.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for outer, _ in self.links.values():
            subprocess.run(["ip", "link", "del", outer], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        subprocess.run(["iptables", "-D", *self.forward], capture_output=True)


# -- one run ----------------------------------------------------------------------------------------
def run_job(sdk, net: Net, steps: int, parallelism: str, diloco: dict | None) -> dict:
    import zwdx
    from zwdx.protocol.report import from_wire
    torch.manual_seed(0)
    model = GPT(CFG["vocab"], CFG["seq"], CFG["layers"], CFG["heads"], CFG["dim"])
    data_loader, train = job_functions(steps)
    before = {n: net.sent(n) for n in ("a", "b")}
    result = sdk.submit_job(model=model, data_loader_func=data_loader, train_func=train,
                            optimizer=torch.optim.AdamW(model.parameters(), lr=CFG["lr"]), parallelism=parallelism,
                            resources=zwdx.Resources(world_size=2), training=zwdx.Training(collective_timeout=600),
                            run=zwdx.Run(progress=False, timeout=3600, recovery=zwdx.Recovery(checkpoint_every_epoch=False)),  # the bytes are training's (and the weights at the end)
                            strategy=zwdx.Diloco(all_reduce=False, **diloco) if diloco else None)  # the server's way
    sent = {n: net.sent(n) - before[n] for n in ("a", "b")}
    job = sdk.get_job(result["job_id"])
    results = from_wire(job["results"])
    last_round = max((p["value"] for p in sdk.get_job_metrics(result["job_id"]).get("sync_seconds", [])
                      if p["step"] is not None and p["value"] is not None), default=0.0)
    trained = sdk.get_trained_model(result["job_id"], GPT(CFG["vocab"], CFG["seq"], CFG["layers"], CFG["heads"],
                                                          CFG["dim"]))
    # DILOCO's last round comes after train_func: its time counts (the longest round, an upper bound)
    wall = results["train_seconds"] + (last_round if diloco else 0.0)
    return {"parallelism": parallelism, "diloco": diloco, "steps": steps, "wall_s": wall,
            "utilisation": results["busy_seconds"] / wall,
            "train_s": results["train_seconds"], "mb_sent": sum(sent.values()) / 2 / 1e6, "loss": eval_loss(trained),
            "params": sum(p.numel() for p in model.parameters())}


WAYS = {
    "all": [("DDP", None), ("DILOCO", {"inner_steps": 50, "compression": "int8"}),
            ("DILOCO", {"inner_steps": 50, "compression": "fp16"}), ("DILOCO", {"inner_steps": 500, "compression": "int8"}),
            ("DILOCO", {"inner_steps": 50, "compression": "int8", "outer_lr": 1.0, "outer_momentum": 0.0})],
    "smoke": [("DDP", None), ("DILOCO", {"inner_steps": 4, "compression": "int8"})],
    "overlap": [("DILOCO", {"inner_steps": h, "compression": "int8", **extra})
                for h in (50, 10) for extra in ({}, {"overlap": True})]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", default="100,1000", help="Mbit/s of the clients' links (100: 50 ms RTT, "
                                                            "1000: 20 ms)")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--ways", default="all", choices=sorted(WAYS),
                        help="all: DDP and DILOCO (H 50, 500; int8, fp16); overlap: DILOCO H=50 and 10, int8, waiting "
                             "for each round vs overlapped with the next round's compute; smoke: DDP and DILOCO "
                             "H=4, for the test suite")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if os.geteuid() != 0 or not shutil.which("tc"):
        sys.exit("bench/wan.py needs root and tc (iproute2): network namespaces and shaped links")
    from zwdx import ZWDX
    rtt = {100: 50, 1000: 20}
    ways = WAYS[args.ways]
    net, procs, rows, data = Net(), [], [], []
    tmp = tempfile.mkdtemp(prefix="zwdx-wan-")
    try:
        port = free_port()
        url = f"http://{net.hosts['s'][1]}:{port}"
        procs.append(net.run("s", [sys.executable, "-m", "zwdx.cli", "server", "--host", net.hosts["s"][1], "--port",
                                   str(port), "--data-dir", os.path.join(tmp, "server")], os.path.join(tmp, "server.log")))
        wait_until(lambda: _up(url), 60, what="the server")
        sdk = ZWDX(url, remember=False)
        room = sdk.create_room("wan")
        sdk.room_token = room["token"]
        for name in ("a", "b"):
            procs.append(net.run(name, [sys.executable, "-m", "zwdx.cli", "gpu-client", "--server", url, "--room-token",
                                        room["donor_token"], "--cpu", "--threads", "1", "--client-id", name,
                                        "--work-dir", os.path.join(tmp, name)], os.path.join(tmp, f"{name}.log")))
        wait_until(lambda: sum(c["status"] == "online" for c in sdk.get_room()["clients"]) == 2, 60, what="clients")
        net.shape(0, 0)
        alone = run_job(sdk, net, args.steps, "DILOCO", {"inner_steps": 10**6})  # one round, at the end
        alone.update(link_mbit=0, rtt_ms=0)
        data.append(alone)
        print(alone, flush=True)
        for mbit in (int(m) for m in args.links.split(",")):
            net.shape(mbit, rtt.get(mbit, 20))
            for parallelism, diloco in ways:
                r = run_job(sdk, net, args.steps, parallelism, diloco)
                r.update(link_mbit=mbit, rtt_ms=rtt.get(mbit, 20) if net.delay else 0)
                data.append(r)
                print(r, flush=True)
        ddp_mb = {}
        for r in data:
            diloco = r["diloco"]
            if not diloco:
                ddp_mb.setdefault(r["link_mbit"], r["mb_sent"])
            way = r["parallelism"] if not diloco else f"DILOCO H={diloco['inner_steps']} {diloco.get('compression', 'int8')}" + (
                f", outer lr {diloco['outer_lr']:g} momentum {diloco['outer_momentum']:g}" if "outer_lr" in diloco else "") + (
                ", overlapped" if diloco.get("overlap") else "")
            if r is alone:
                way, link = "DILOCO, no round but the last", "unshaped"
            else:
                link = f"{r['link_mbit']} Mbit/s, {r['rtt_ms']} ms"
            rows.append([link, way, f"{100 * r['utilisation']:.0f}%", fmt(r["wall_s"]), fmt(r["mb_sent"], 2),
                         "" if r is alone or r["link_mbit"] not in ddp_mb else
                         f"1/{ddp_mb[r['link_mbit']] / r['mb_sent']:.0f}" if diloco else "1",
                         fmt(r["loss"], 3)])
    finally:
        for proc in procs:
            proc.stop()
        net.close()
        shutil.rmtree(tmp, ignore_errors=True)
    delay = "" if net.delay else " (no sch_netem in this kernel: links rate-limited only, no added delay)"
    text = (f"\n### DDP vs DILOCO over shaped links: 2 workers, {data[0]['params'] / 1e6:.1f} M-parameter GPT, "
            f"{args.steps} steps each{delay}\n\n{machine()}\n\n"
            + table(["link", "training", "utilisation", "wall s", "MB sent / worker", "bytes vs DDP", "loss"], rows))
    print(text)
    write_out(args.out, text, {"runs": data, "machine": machine(), "delay": net.delay})
    return 0


def _up(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=1).ok
    except requests.RequestException:
        return False


if __name__ == "__main__":
    raise SystemExit(main())
