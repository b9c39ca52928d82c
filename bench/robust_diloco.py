"""DILOCO with dishonest workers: the plain mean against zwdx's robust rule, at equal samples.

    python bench/robust_diloco.py                                  # 4 and 8 workers, 0-2 dishonest, 3 seeds
    python bench/robust_diloco.py --workers 4 --dishonest 0,1 --seeds 5 --out bench/results/robust-diloco.md

What it runs, in one process (no server: the rule under test is ``zwdx.robust.Combiner``, the
same code the server and the workers' all-gather use): ``n`` workers each hold a shard of
scikit-learn's handwritten digits (1,500 for training, 297 held out) and train a small MLP for
``inner_steps`` AdamW steps a round; a round's pseudo-gradients (global - local) are combined by
the rule, and the global weights take an outer step (SGD, lr 0.7, Nesterov momentum 0.9, the
DiLoCo paper's). Every configuration sees the same samples: the same shards, order and rounds.

The dishonest workers (the last ``f``), one of:
  - ``noise``: add Gaussian noise (std 0.3) to their weights after every step (a donor sending
    garbage for its share of the work);
  - ``flip``: upload -4 times their honest pseudo-gradient (pushing the weights back);
  - ``random``: upload a random vector of their honest pseudo-gradient's norm.

Per configuration: held-out accuracy and loss after the last round (median over seeds, with the
min-max spread), how many rounds each dishonest worker was flagged in, and how often honest ones
were, with their longest run of flagged rounds in a row (the server names a
worker flagged ``suspect_after`` = 5 rounds in a row and drops it; this bench keeps every worker
in, to measure the rule alone). The honest-case cost of the rule is the f = 0 rows.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from zwdx import robust  # noqa: E402


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    return x[:1500], y[:1500], x[1500:], y[1500:]


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def load(m: nn.Module, values: torch.Tensor) -> None:
    done = 0
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(values[done:done + p.numel()].view_as(p))
            done += p.numel()


def run(n: int, f: int, attack: str, rule: str, seed: int, rounds: int, inner_steps: int, batch: int) -> dict:
    x, y, x_test, y_test = digits()
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(x), generator=g)
    shards = [order[i::n] for i in range(n)]
    center = model(seed)
    global_ = torch.nn.Parameter(flat(center).clone())
    outer = torch.optim.SGD([global_], lr=0.7, momentum=0.9, nesterov=True)
    workers = [model(seed) for _ in range(n)]
    inner = [torch.optim.AdamW(w.parameters(), lr=3e-3) for w in workers]
    noise = torch.Generator().manual_seed(seed + 1000)
    flagged, run_, longest = [0] * n, [0] * n, [0] * n  # flagged rounds; the current and longest runs in a row
    for r in range(rounds):
        uploads = []
        for i, (w, opt) in enumerate(zip(workers, inner)):
            load(w, global_.detach())
            liar = i >= n - f
            for s in range(inner_steps):
                pick = shards[i][((r * inner_steps + s) * batch + torch.arange(batch)) % len(shards[i])]
                opt.zero_grad()
                F.cross_entropy(w(x[pick]), y[pick]).backward()
                opt.step()
                if liar and attack == "noise":
                    with torch.no_grad():
                        for p in w.parameters():
                            p.add_(torch.randn(p.shape, generator=noise) * 0.3)
            pg = (global_.detach() - flat(w)).numpy().astype(np.float32)
            if liar and attack == "flip":
                pg = -4 * pg
            elif liar and attack == "random":
                fake = torch.randn(pg.size, generator=noise).numpy().astype(np.float32)
                pg = fake * (np.linalg.norm(pg) / np.linalg.norm(fake))
            uploads.append(pg)
        combiner = robust.Combiner([float(np.linalg.norm(u.astype(np.float64))) for u in uploads],
                                   robust=rule == "robust")
        average = combiner.frame(uploads)
        for i, s in enumerate(combiner.scores()):
            flagged[i] += bool(s.flag)
            run_[i] = run_[i] + 1 if s.flag else 0
            longest[i] = max(longest[i], run_[i])
        global_.grad = torch.from_numpy(average)
        outer.step()
        outer.zero_grad(set_to_none=True)
    load(center, global_.detach())
    with torch.no_grad():
        logits = center(x_test)
        return {"accuracy": float((logits.argmax(1) == y_test).float().mean()),
                "loss": float(F.cross_entropy(logits, y_test)), "flagged": flagged,
                "longest": longest}


def spread(values: list[float], digits_: int = 3) -> str:
    med = statistics.median(values)
    return f"{med:.{digits_}f} ({min(values):.{digits_}f}-{max(values):.{digits_}f})" if len(values) > 1 else \
        f"{med:.{digits_}f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="4,8", help="comma-separated worker counts")
    parser.add_argument("--dishonest", default="0,1,2", help="comma-separated counts of dishonest workers")
    parser.add_argument("--attacks", default="noise,flip,random")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--inner-steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", help="append the table to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.time()
    lines = ["| workers | dishonest | attack | rule | held-out accuracy | held-out loss | rounds each liar was flagged; honest workers' flagged rounds |",
             "|---|---|---|---|---|---|---|"]
    for n in map(int, args.workers.split(",")):
        for f in map(int, args.dishonest.split(",")):
            for attack in (["-"] if f == 0 else args.attacks.split(",")):
                for rule in ("mean", "robust"):
                    runs = [run(n, f, attack, rule, seed, args.rounds, args.inner_steps, args.batch)
                            for seed in range(args.seeds)]
                    liars = [r["flagged"][i] for r in runs for i in range(n - f, n)]
                    honest_flags = sum(r["flagged"][i] for r in runs for i in range(n - f))
                    honest_run = max((r["longest"][i] for r in runs for i in range(n - f)), default=0)
                    flags = (f"{min(liars)}-{max(liars)} of {args.rounds}" if liars else "-") + \
                        (f"; honest: {honest_flags} of {len(runs) * (n - f) * args.rounds}, at most {honest_run} "
                         f"in a row" if rule == "robust" else "")
                    lines.append(f"| {n} | {f} | {attack} | {rule} | {spread([r['accuracy'] for r in runs])} | "
                                 f"{spread([r['loss'] for r in runs])} | {flags} |")
                    print(lines[-1], flush=True)
    note = (f"\n{args.seeds} seed(s) per row, median (min-max); {args.rounds} rounds of {args.inner_steps} inner "
            f"steps, batch {args.batch} per worker; {time.time() - started:.0f} s in all.\n")
    print(note)
    if args.out:
        with open(args.out, "a") as fh:
            fh.write("\n".join(lines) + "\n" + note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
