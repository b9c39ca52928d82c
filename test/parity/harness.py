"""Train a zoo case (``zoo.py``) in one process and as a zwdx job, and compare the weights.

    from parity.harness import MODES, reference, run_job, compare
    mode = MODES["DDP"]
    ref = reference(case, mode)                   # {name: tensor}: one process
    got, result = run_job(sdk, case, mode)        # {name: tensor}: the job's returned weights
    diff = compare(got, ref)                      # the largest relative difference
    assert diff <= mode.tolerance

What "one process" means (``reference``): the job's replicas (DDP/FSDP ranks, TP groups, the
ranks of a mixed job) run one after the other in this process, step by step, each on the batch
its loader gives it, and their gradients are averaged before one optimizer step. The loaders are
the job's own, ``data_loader_func(rank, world_size)`` as zwdx calls it for each replica, so the
samples and their order are what the replicas read (a ``DistributedSampler(shuffle=True,
seed=0)``, ``set_epoch`` every pass). For a model whose output for a sample does not depend on
the rest of its batch and that draws no random numbers, this is one process training on the
global batch (the replicas' batches of a step, together) with the mean loss: ``test_parity.py``
checks the two agree to round-off. What it adds:

- A loader without a ``DistributedSampler`` (``Case.sharded`` False: ``DataLoader(shuffle=True)``
  as written for one process): zwdx does not shard it (there is no sampler injection; the manual
  asks for a ``DistributedSampler``), so every replica reads the whole set. Seeded alike on
  every replica, they read it in one order, their gradients are equal, and the job trains what
  one process trains with that loader: its batch, every sample once an epoch (the other
  replicas repeat the work). The reference needs nothing special for it.
- Random numbers (dropout, augmentation in ``__getitem__`` or the collate function): each
  replica has its own generator, seeded by the job's ``data_loader_func`` with ``SEED +
  REPLICA_SEED + rank`` (what nanoGPT's ``seed_offset`` does, and what zwdx leaves to the user:
  zwdx itself seeds nothing, and a rank's generators start where a fresh process's do). The
  reference keeps one generator state per replica and switches between them, so every replica's
  draws (the loader's, the collate's, dropout's) are the job's, exactly.
- BatchNorm: each replica normalises by its own batch (as DDP and FSDP do); the running
  statistics that come back are rank 0's (zwdx gives every rank rank 0's buffers after training).
- Mixed devices: the ranks' shares of the global batch depend on measured speed; the reference
  is one process on the whole global batch (``Sampling`` of all of it), which any split equals
  for a loss that is a mean over the batch and a model whose samples are independent
  (``Case.independent``: no BatchNorm, no random draws; zwdx promises nothing more there, since
  the shares are the speed's).
- LoRA: the same peft model (the adapter's initialisation seeded) in both; only the adapter is
  compared, as only the adapter comes back.

The comparison (``compare``): for each tensor, the largest absolute difference over the
reference's largest absolute value; the largest over all tensors. Where the arithmetic is the
same up to the order of sums (every mode here) the tolerance is ``TOLERANCE``.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import zwdx
from parity.zoo import SEED, Case

#: Relative difference allowed where the job's arithmetic is one process's up to summation order.
TOLERANCE = 1e-5
#: The replicas' generators are seeded with SEED + REPLICA_SEED + their index (see the docstring).
REPLICA_SEED = 1000


@dataclass(frozen=True)
class Mode:
    """How a case is submitted: ``parallelism``, ``world_size`` ranks forming ``replicas``
    replicas (TP: one group is one), its ``strategy`` (``zwdx.FSDP(tp=...)``, ...; None: the
    parallelism's own); ``mixed``: a ``zwdx.Mixed`` job (the loader takes ``batch_size`` and ``sampler``); ``lora``: the case's
    model with an adapter (``lora_config``); ``slots``: CPU slots a GPU client needs for it."""
    name: str
    parallelism: str
    world_size: int
    replicas: int
    strategy: Any = None
    mixed: bool = False
    lora: bool = False
    tolerance: float = TOLERANCE


MODES = {m.name: m for m in [
    Mode("DDP", "DDP", 2, 2),
    Mode("FSDP", "FSDP", 2, 2),
    Mode("TP", "TP", 2, 1),
    Mode("FSDP+TP", "FSDP+TP", 4, 2, zwdx.FSDP(tp=zwdx.TensorParallel(size=2))),
    Mode("LoRA", "DDP", 2, 2, lora=True),
    Mode("LoRA-FSDP", "FSDP", 2, 2, lora=True),
    Mode("mixed", "DDP", 2, 1, mixed=True),
]}

#: LoRA's target modules per case (cases not named here have no LoRA variant).
LORA_TARGETS = {"hf_gpt2": {"target_modules": ["c_attn"], "fan_in_fan_out": True},
                "residual": {"target_modules": ["up", "down"]}}


def supports(case: Case, mode: Mode) -> bool:
    """Whether ``mode`` applies to ``case``: TP needs Linear pairs; LoRA a target; mixed devices
    a model whose samples are independent and that draws nothing (see the module's docstring)."""
    if mode.parallelism in ("TP", "FSDP+TP"):
        return case.tp
    if mode.lora:
        return case.name in LORA_TARGETS
    if mode.mixed:  # the ranks' batches are shares by speed: their draws and batch statistics are not one process's
        return case.independent and case.sharded  # (its loader always takes zwdx's sampler)
    return True


def lora_config(case: Case):
    from peft import LoraConfig
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **LORA_TARGETS[case.name])


def initial_model(case: Case, mode: Mode):
    """The model both sides start from: the case's, with its seeded adapter for LoRA."""
    model = case.model()
    if mode.lora:
        from peft import get_peft_model
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            model = get_peft_model(model, lora_config(case))
    return model


def initial_optimizer(case: Case, mode: Mode, model):
    """The case's optimizer (over the adapter's parameters, for LoRA: peft froze the rest)."""
    return case.make_optimizer(model)


# -- what the job runs -----------------------------------------------------------------------------
def loader_func(case: Case, mode: Mode):
    """The job's ``data_loader_func``: this replica's ``DataLoader`` of its share of each global
    batch; it seeds the replica's generator first. Mixed devices: zwdx's ``batch_size`` and
    ``sampler`` (this rank's share)."""
    if mode.mixed:
        def mixed_loader(rank, world_size, batch_size=case.batch // mode.world_size, sampler=None):
            torch.manual_seed(SEED + REPLICA_SEED + rank)
            data = case.data()
            return DataLoader(data, batch_size=batch_size, sampler=sampler(data, shuffle=case.shuffle, seed=SEED),
                              collate_fn=case.collate)
        return mixed_loader

    def loader(rank, world_size):
        if not case.sharded:  # as written for one process: the same seed, the whole set, on every replica
            torch.manual_seed(SEED + REPLICA_SEED)
            return DataLoader(case.data(), batch_size=case.batch, shuffle=case.shuffle, drop_last=True,
                              collate_fn=case.collate)
        torch.manual_seed(SEED + REPLICA_SEED + rank)
        data = case.data()
        sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=case.shuffle, seed=SEED)
        return DataLoader(data, batch_size=case.batch // world_size, sampler=sampler, drop_last=True,
                          collate_fn=case.collate)
    return loader


def train_func(case: Case):
    """The job's ``train_func``: a plain loop, ``set_epoch`` every pass; returns the last loss.
    float32 on CUDA (TF32 off), as the reference."""
    def train(model, loader, optimizer, epochs, device):
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        loss = torch.tensor(float("nan"))
        for epoch in range(epochs):
            if hasattr(loader.sampler, "set_epoch"):
                loader.sampler.set_epoch(epoch)
            for batch in loader:
                optimizer.zero_grad()
                loss = case.loss(model, to(batch, device))
                loss.backward()
                optimizer.step()
        return loss.item()
    return train


def to(batch, device):
    return [t.to(device) for t in batch] if isinstance(batch, (list, tuple)) else batch.to(device)


def run_job(sdk, case: Case, mode: Mode, epochs: int | None = None, timeout: float = 300, **options):
    """Submit ``case`` as a ``mode`` job through ``sdk`` (its room token set) and wait: the
    returned weights ({name: tensor}; LoRA: the adapter) and the result."""
    model = initial_model(case, mode)
    optimizer = initial_optimizer(case, mode, model)
    strategy = zwdx.Mixed(global_batch=case.batch) if mode.mixed else mode.strategy
    result = sdk.submit_job(model, loader_func(case, mode), train_func(case), None, optimizer, mode.parallelism,
                            strategy=strategy, resources=zwdx.Resources(world_size=mode.world_size),
                            training=zwdx.Training(epochs=epochs or case.epochs),
                            run=zwdx.Run(name=f"parity-{mode.name}-{case.name}", progress=False, timeout=timeout,
                                         fail_if_unschedulable=True), **options)
    return returned_weights(sdk, result["job_id"]), result


def returned_weights(sdk, job_id: str) -> dict:
    """The weights a finished job returned ({name: tensor}), as downloaded."""
    from safetensors.torch import load_file
    fd, path = tempfile.mkstemp(suffix=".safetensors")
    os.close(fd)
    try:
        sdk.download_weights(job_id, path)
        return load_file(path)
    finally:
        os.unlink(path)


# -- one process -----------------------------------------------------------------------------------
class Replicas:
    """One generator state per replica (the CPU's, and ``device``'s on CUDA); ``with
    replicas.of(r):`` runs as replica ``r``."""

    def __init__(self, n: int, device: torch.device):
        self.cuda = device if device.type == "cuda" else None
        self.states: list[tuple | None] = [None] * n

    @contextlib.contextmanager
    def of(self, r: int):
        if self.states[r] is not None:
            torch.set_rng_state(self.states[r][0])
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.states[r][1], self.cuda)
        try:
            yield
        finally:
            self.states[r] = (torch.get_rng_state(),
                              torch.cuda.get_rng_state(self.cuda) if self.cuda is not None else None)


def reference(case: Case, mode: Mode, epochs: int | None = None, replicas: int | None = None,
              device: str = "cpu") -> dict:
    """The weights one process trains (see the module's docstring): ``replicas`` (default the
    mode's) simulated in turn, gradients averaged per step, on ``device``. LoRA: the adapter
    alone. Returned on the CPU."""
    n = replicas or mode.replicas
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), float32():
        model = initial_model(case, mode).to(device)
        optimizer = initial_optimizer(case, mode, model)
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        gens = Replicas(n, device)
        loaders = []
        for r in range(n):
            with gens.of(r):
                loaders.append(_reference_loader(case, mode, r, n))
        for epoch in range(epochs or case.epochs):
            iters = []
            for r, loader in enumerate(loaders):
                with gens.of(r):
                    if hasattr(loader.sampler, "set_epoch"):
                        loader.sampler.set_epoch(epoch)
                    iters.append(iter(loader))
            while True:
                batches, grads, kept = [], [], None
                before = _buffers(model)
                for r in range(n):
                    with gens.of(r):
                        batch = next(iters[r], None)
                        if batch is None:
                            break
                        _load_buffers(model, before)  # every replica starts the step from rank 0's buffers
                        optimizer.zero_grad()
                        case.loss(model, to(batch, device)).backward()
                        grads.append([None if p.grad is None else p.grad.clone() for p in params])
                        if r == 0:
                            kept = _buffers(model)
                    batches.append(batch)
                if len(batches) < n:
                    assert not batches, "the replicas' loaders took different numbers of steps"
                    break
                _load_buffers(model, kept)
                for i, p in enumerate(params):
                    got = [g[i] for g in grads if g[i] is not None]
                    p.grad = None if not got else torch.stack(got).sum(0) / n
                optimizer.step()
    return returned_state(model, mode)


def _reference_loader(case: Case, mode: Mode, rank: int, n: int):
    if mode.mixed:  # one process: the whole global batch as one share
        from gpu_client.rank.strategies.mixed import Sampling
        return loader_func(case, mode)(rank, n, batch_size=case.batch, sampler=Sampling(0, case.batch, case.batch))
    return loader_func(case, mode)(rank, n)


def _buffers(model) -> dict:
    return {k: v.clone() for k, v in model.named_buffers()}


def _load_buffers(model, saved: dict) -> None:
    for k, v in model.named_buffers():
        v.copy_(saved[k])


def returned_state(model, mode: Mode) -> dict:
    """What the job returns of ``model``: every tensor of its state dict; LoRA: the adapter's."""
    if mode.lora:
        from peft import get_peft_model_state_dict
        return {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(model).items()}
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


@contextlib.contextmanager
def float32():
    """float32 arithmetic on CUDA too (TF32 off for matrix products and cuDNN's convolutions, as
    the job's ``train_func`` sets it): parity is about float32 round-off, TF32's is 1e-3."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# -- the comparison --------------------------------------------------------------------------------
def compare(got: dict, want: dict) -> float:
    """The largest relative difference between two state dicts with the same names: per tensor
    ``max|got - want| / max|want|`` (its scale, so a value near zero does not blow it up).
    Different names or shapes raise ``AssertionError`` saying which."""
    assert set(got) == set(want), f"names differ: only returned {sorted(set(got) - set(want))[:5]}, " \
                                  f"only in one process {sorted(set(want) - set(got))[:5]}"
    worst = 0.0
    for name, ref in want.items():
        a, b = got[name].double(), ref.double()
        assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} returned, {tuple(b.shape)} in one process"
        if not b.numel():
            continue
        scale = b.abs().max().item() or 1.0
        worst = max(worst, (a - b).abs().max().item() / scale)
    return worst


def worst_tensor(got: dict, want: dict) -> str:
    """The name of the tensor that differs most (for a failure's message)."""
    def diff(name):
        b = want[name].double()
        return (got[name].double() - b).abs().max().item() / (b.abs().max().item() or 1.0) if b.numel() else 0.0
    return max(want, key=diff)


@dataclass
class Outcome:
    """One row of the table: a case under a mode."""
    mode: str
    case: str
    diff: float | None
    tolerance: float
    seconds: float
    error: str = ""
    where: str = ""  # the ranks' slots: "cpu x2", "cuda x2", "cuda + cpu"

    @property
    def passed(self) -> bool:
        return self.diff is not None and self.diff <= self.tolerance


def check(sdk, case: Case, mode: Mode, device: str = "cpu", **options) -> Outcome:
    """``run_job`` and ``reference`` (on ``device``) and their comparison, as one row."""
    began = time.time()
    try:
        got, result = run_job(sdk, case, mode, **options)
        diff = compare(got, reference(case, mode, device=device))
        where = placed(sdk.get_job(result["job_id"]))
        return Outcome(mode.name, case.name, diff, mode.tolerance, time.time() - began, where=where)
    except Exception as exc:  # a row says what went wrong; the test asserts on it
        return Outcome(mode.name, case.name, None, mode.tolerance, time.time() - began, f"{type(exc).__name__}: {exc}")


def placed(job: dict) -> str:
    """The kinds of slot the job's ranks ran on: "cpu x2", "cuda x2", "cuda x1 + cpu x1"."""
    kinds: dict[str, int] = {}
    for p in job.get("placement") or []:
        kinds[p["kind"]] = kinds.get(p["kind"], 0) + 1
    return " + ".join(f"{k} x{n}" for k, n in sorted(kinds.items(), key=lambda kv: kv[0] != "cuda"))
