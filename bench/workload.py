"""The training both sides of the overhead benchmark run: the same models, synthetic data and
train step, whether under bare torchrun (bench/ddp_train.py) or as a zwdx job (bench/overhead.py).

    cfg = config("gpt2", device_type="cuda")
    model, optimizer = build(cfg)
    data_loader, train = functions(cfg)       # zwdx's data_loader_func and train_func

``train`` times itself: ``warmup`` steps, then the rest in ``chunks`` windows, each closed
by a device synchronize; it returns (and, under zwdx, reports through ``reporter``) the
steady-state samples/s of the whole world and the wall-clock times of its first step.
The functions are closures over ``cfg``; this module travels by value in the job bundle.
"""
from __future__ import annotations

import importlib
import itertools
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

#: Full sizes (GPU) and CI sizes (CPU smoke runs).
PRESETS = {
    "cnn": {"full": {"batch": 128, "image": 224, "steps": 1500, "warmup": 100},
            "smoke": {"batch": 16, "image": 32, "steps": 40, "warmup": 5}},
    "gpt2": {"full": {"batch": 8, "seq": 1024, "layers": 12, "heads": 12, "dim": 768, "vocab": 50304,
                      "steps": 200, "warmup": 20},
             "smoke": {"batch": 4, "seq": 64, "layers": 2, "heads": 4, "dim": 128, "vocab": 1024,
                       "steps": 30, "warmup": 5}},
}


def config(model: str, device_type: str, **overrides) -> dict:
    """The workload's settings: the preset for the device (full on CUDA, smoke on CPU), overridden."""
    size = "full" if device_type == "cuda" else "smoke"
    cfg = {"model": model, "size": size, "device_type": device_type, "seed": 0, "lr": 3e-4,
           "log_every": 50, "chunks": 5, "bf16": device_type == "cuda", **PRESETS[model][size]}
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    cfg["warmup"] = min(cfg["warmup"], max(cfg["steps"] - cfg["chunks"], 1))
    return cfg


# -- models ---------------------------------------------------------------------------------------
class Probe(nn.Module):
    """Notes when the model was unpickled: on a zwdx rank, the moment the job bundle is loaded."""

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__["unpickled_at"] = time.time()


class SmallCNN(Probe):
    """Five strided conv-BN-ReLU blocks and a linear head: an image-sized convnet of ~1.3 M params."""

    def __init__(self, classes: int = 1000, widths=(32, 64, 128, 256, 256)):
        super().__init__()
        layers, cin = [], 3
        for w in widths:
            layers += [nn.Conv2d(cin, w, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU()]
            cin = w
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x):
        return self.head(F.adaptive_avg_pool2d(self.features(x), 1).flatten(1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(Probe):
    """GPT-2 small's shape (12 layers, 12 heads, 768 wide, 1024 context; 124 M params with the
    vocabulary padded to 50304, as nanoGPT does), token embedding tied to the output layer."""

    def __init__(self, vocab: int, seq: int, layers: int, heads: int, dim: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln(x))


def build(cfg: dict):
    """The model (on CPU, seeded) and its optimizer, as a submitter would make them."""
    torch.manual_seed(cfg["seed"])
    if cfg["model"] == "cnn":
        model = SmallCNN()
    else:
        model = GPT(cfg["vocab"], cfg["seq"], cfg["layers"], cfg["heads"], cfg["dim"])
    return model, optimizer(model.parameters(), cfg)


def optimizer(params, cfg: dict):
    return torch.optim.AdamW(params, lr=cfg["lr"])


# -- data -----------------------------------------------------------------------------------------
class SyntheticLoader:
    """``steps`` batches made on the device up front (a few distinct ones, cycled), so that the
    data pipeline is not what is measured."""

    def __init__(self, batches: list, steps: int):
        self.batches, self.steps = batches, steps

    def __iter__(self):
        for i in range(self.steps):
            yield self.batches[i % len(self.batches)]

    def __len__(self):
        return self.steps


def process_started_at() -> float | None:
    """When this process started, on the wall clock (10 ms resolution; Linux)."""
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError):
        return None


# -- what zwdx calls (and ddp_train.py calls the same way) ----------------------------------------
def functions(cfg: dict):
    """``(data_loader, train)`` for ``cfg``: zwdx's data_loader_func and train_func."""

    def data_loader(rank, world_size, device):
        made_at = time.time()
        # made on the device itself: a 300 MB batch set drawn on one CPU thread would take a second
        gen = torch.Generator(device=device).manual_seed(cfg["seed"] * 1000 + rank)
        batches = []
        for _ in range(4):
            if cfg["model"] == "cnn":
                x = torch.randn(cfg["batch"], 3, cfg["image"], cfg["image"], generator=gen, device=device)
                y = torch.randint(0, 1000, (cfg["batch"],), generator=gen, device=device)
            else:
                x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=gen, device=device)
                x, y = x[:, :-1].contiguous(), x[:, 1:].contiguous()
            batches.append((x, y))
        loader = SyntheticLoader(batches, cfg["steps"])
        loader.made_at = made_at
        return loader

    def loss_of(out, y):
        return F.cross_entropy(out.float().view(-1, out.shape[-1]), y.view(-1))

    def train(model, loader, optimizer, rank, world_size, device, reporter=None, pipeline=None):
        """The timed loop; under a zwdx PIPELINE job ``pipeline.step`` runs forward and backward of
        the batch's micro-batches through the stages (the pipeline is one replica)."""
        entered = time.time()
        device = torch.device(device)
        cuda = device.type == "cuda"
        if cuda:
            # imported by name: cloudpickle cannot pickle torch.backends' module subclasses
            cudnn = importlib.import_module("torch.backends.cudnn")
            cudnn.benchmark = cudnn.allow_tf32 = True
            torch.set_float32_matmul_precision("high")

        def sync():
            if cuda:
                torch.cuda.synchronize(device)

        autocast = torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=cfg["bf16"])
        steps, warmup, chunks = cfg["steps"], cfg["warmup"], cfg["chunks"]
        measured = steps - warmup
        bounds = {warmup + round(measured * k / chunks) for k in range(chunks + 1)}
        marks, first_start, first_done, loss_value = [], None, None, math.nan
        model.train()
        if 0 in bounds:
            marks.append((0, time.perf_counter()))
        for step, (x, y) in enumerate(loader):
            if step == 0:
                first_start = time.time()
            optimizer.zero_grad(set_to_none=True)
            with autocast:
                if pipeline is not None:
                    loss = pipeline.step(x, y, loss_of)
                else:
                    loss = loss_of(model(x), y)
            if pipeline is None:
                loss.backward()
            optimizer.step()
            if step == 0:
                sync()
                first_done = time.time()
                if reporter is not None:
                    reporter.log_metrics(step=0, first_step=1.0)
            if (step + 1) % cfg["log_every"] == 0:
                loss_value = loss.item()  # a sync, as any loop that logs its loss has
                if reporter is not None:
                    reporter.log_metrics(step=step, loss=loss_value)
            if step + 1 in bounds:  # windows close after a step, before the loader's epoch end
                sync()
                marks.append((step + 1, time.perf_counter()))
                last_step_at = time.time()
        loop_done = time.time()  # after the epoch's end (under zwdx: its checkpoint)
        # a TP group of ranks is one replica, and so is a pipeline
        per_sample = cfg["batch"] * (1 if pipeline is not None else world_size // cfg.get("tp", 1))
        rates = [(s1 - s0) * per_sample / (t1 - t0) for (s0, t0), (s1, t1) in itertools.pairwise(marks) if s1 > s0]
        span = marks[-1][1] - marks[0][1]
        target = getattr(model, "module", model)
        result = {"samples_per_s": measured * per_sample / span if span > 0 else math.nan,
                  "samples_per_s_min": min(rates, default=math.nan),
                  "samples_per_s_max": max(rates, default=math.nan),
                  "step_ms": 1000 * span / max(measured, 1), "loss": loss.item(),
                  "entered_at": entered, "first_step_start": first_start, "first_step_done": first_done,
                  "epoch_end_s": loop_done - last_step_at,
                  "loader_made_at": getattr(loader, "made_at", None),
                  "unpickled_at": getattr(target, "unpickled_at", None),
                  "process_started_at": process_started_at(),
                  "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None}
        if reporter is not None:
            reporter.log_metrics(step=steps, samples_per_s=result["samples_per_s"])
        return result

    return data_loader, train
