"""Parity for PIPELINE (issue 30 item 1): zoo models cut into two stages on two GPU clients (CPU
slots, gloo) under each schedule (gpipe, 1f1b, interleaved1f1b) return the weights one process
trains on the same batches split into the same micro-batches: the gradient of each batch's mean
loss (each micro-batch's loss divided by their number), one optimizer step a batch or, with
gradient accumulation, every few batches (``reference``), within ``harness.TOLERANCE`` (float32
round-off; most cases come back bit for bit).

The batches are the job's own: ``harness.loader_func`` (a ``DistributedSampler(shuffle=True,
seed=0)``, ``set_epoch`` each pass), which a pipeline calls as rank 0 of 1 on every stage; only
the first stage iterates it, its targets travel to the last stage.

What the platform promises of random numbers (dropout): each stage draws from its own process's
generator, which the job's ``data_loader_func`` seeded (zwdx seeds nothing), in micro-batch
order; so under gpipe and 1f1b (one stage a rank) the masks are those of one process that keeps
a generator per stage and switches to stage k's where stage k begins (``Stages``), and the
weights equal that, to round-off. Interleaved 1F1B's rank runs its stages' forwards in the
schedule's order from one generator: not promised here. A stage's train/eval modes are fixed
when it is traced, in training mode: ``model.eval()`` on a stage changes nothing (evaluation runs
on the whole model, on rank 0).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import models
import zwdx
from parity import harness, zoo

pytestmark = pytest.mark.slow

RANKS = 2


# -- a zoo model a pipeline can cut that the zoo's LMs are not: tied, logits out ---------------------
class TiedLM(nn.Module):
    """Token embedding, LayerNorm + residual blocks, a head tied to the embedding (nanoGPT's
    tying): the embedding sits on the first stage, the head on the last."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.embed = nn.Embedding(models.VOCAB, dim)
        self.blocks = nn.ModuleList([zoo.ResidualBlock(dim) for _ in range(2)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, models.VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def next_tokens() -> TensorDataset:
    rows = zoo.token_rows().tensors[0]
    return TensorDataset(rows[:, :-1], rows[:, 1:])


def token_loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


TIED = zoo.Case("tied_embeddings", zoo.seeded(TiedLM), next_tokens, lambda m, b: token_loss(m(b[0]), b[1]),
                lr=3e-3)


@dataclass(frozen=True)
class PipeCase:
    """A zoo case under one schedule: ``settings`` (``pipeline=``), the last stage's ``loss_fn``;
    ``eval_mode``: submitted in eval mode (as ``from_pretrained`` returns a model), ``train_func``
    calls ``model.train()``; ``accumulate``: batches whose gradients add up before each optimizer
    step (each one's loss divided by their number, as nanoGPT's loop does)."""
    case: zoo.Case
    settings: dict
    loss_fn: object = F.cross_entropy
    eval_mode: bool = False
    accumulate: int = 1
    marks: tuple = field(default_factory=tuple)

    @property
    def name(self) -> str:
        more = ("-eval" if self.eval_mode else "") + (f"-accumulate{self.accumulate}" if self.accumulate > 1 else "")
        return f"{self.case.name}-{self.settings['schedule']}{more}"

    @property
    def mode(self) -> harness.Mode:
        return harness.Mode(f"PIPELINE-{self.settings['schedule']}", "PIPELINE", RANKS, 1, zwdx.Pipeline(**self.settings))

    @property
    def stages(self) -> int:
        return RANKS * (2 if self.settings["schedule"] == "interleaved1f1b" else 1)

    @property
    def microbatches(self) -> int:
        return self.settings.get("microbatches") or RANKS


CASES = [
    PipeCase(zoo.case("sequential"), {"schedule": "gpipe"}),  # a mixed nn.Sequential, cut by its children
    PipeCase(zoo.case("residual"), {"schedule": "1f1b", "microbatches": 4}, accumulate=2),
    PipeCase(zoo.case("residual"), {"schedule": "interleaved1f1b", "microbatches": 4,
                                    "stage_plan": ["blocks.0", "blocks.1", "norm"]}),
    PipeCase(zoo.case("batchnorm"), {"schedule": "gpipe"}),  # per-micro-batch statistics, in order
    PipeCase(zoo.case("dropout"), {"schedule": "1f1b"}, eval_mode=True),
    PipeCase(TIED, {"schedule": "gpipe"}, loss_fn=token_loss, accumulate=2),
]


# -- the job ---------------------------------------------------------------------------------------
def train_func(loss_fn, accumulate: int = 1):
    """The plain loop with ``pipeline.step`` where forward and backward were; an optimizer step
    every ``accumulate`` batches."""
    def scaled(output, target):
        return loss_fn(output, target) / accumulate

    def train(model, loader, optimizer, epochs, pipeline):
        model.train()
        loss = torch.tensor(float("nan"))
        for epoch in range(epochs):
            loader.sampler.set_epoch(epoch)
            for i, (x, y) in enumerate(loader):
                loss = pipeline.step(x, y, scaled)
                if (i + 1) % accumulate == 0:
                    optimizer.step()
                    optimizer.zero_grad()
        return loss.item()
    return train


def run_job(sdk, pc: PipeCase, timeout: float = 240) -> tuple[dict, dict]:
    model = pc.case.model()
    model.train(not pc.eval_mode)
    result = sdk.submit_job(model, harness.loader_func(pc.case, pc.mode), train_func(pc.loss_fn, pc.accumulate), None,
                            pc.case.make_optimizer(model), "PIPELINE", strategy=zwdx.Pipeline(**pc.settings),
                            resources=zwdx.Resources(world_size=RANKS),
                            training=zwdx.Training(epochs=pc.case.epochs, collective_timeout=60),
                            run=zwdx.Run(name=f"parity-{pc.name}", progress=False, timeout=timeout))
    assert result["status"] == "completed", result.get("reason")
    return harness.returned_weights(sdk, result["job_id"]), result


# -- one process -----------------------------------------------------------------------------------
class Stages:
    """One generator a stage (``states``: each one's state), switched to where each stage begins
    (a forward pre-hook on the module each split point names); ``switch(0)`` after the forward."""

    def __init__(self, model: nn.Module, points: list[str], states: list[torch.Tensor]):
        self.states, self.current = states, 0
        modules = dict(model.named_modules())
        for k, name in enumerate(points, start=1):
            modules[name].register_forward_pre_hook(lambda *_, k=k: self.switch(k))

    def switch(self, stage: int) -> None:
        if stage != self.current:
            self.states[self.current] = torch.get_rng_state()
            torch.set_rng_state(self.states[stage])
            self.current = stage


def reference(pc: PipeCase) -> dict:
    """One process on the job's batches, each split into the job's micro-batches (see the
    module's docstring), dropout drawn from each stage's generator."""
    from gpu_client.rank.strategies.stage_plan import split_points
    case = pc.case
    with torch.random.fork_rng(devices=[]):
        model = case.model()
        optimizer = case.make_optimizer(model)
        plan = pc.settings.get("stage_plan")
        points, _ = split_points(model, plan, pc.stages)
        states = []
        for _ in range(pc.stages):  # each stage's process calls data_loader_func, which seeds its generator
            loader = harness.loader_func(case, pc.mode)(0, 1)
            states.append(torch.get_rng_state())
        stages = Stages(model, points, states)
        model.train()
        for epoch in range(case.epochs):
            loader.sampler.set_epoch(epoch)
            for i, (x, y) in enumerate(loader):
                for xm, ym in zip(x.tensor_split(pc.microbatches), y.tensor_split(pc.microbatches)):
                    out = model(xm)
                    stages.switch(0)
                    (pc.loss_fn(out, ym) / pc.accumulate / pc.microbatches).backward()  # the batch's mean
                if (i + 1) % pc.accumulate == 0:
                    optimizer.step()
                    optimizer.zero_grad()
        return harness.returned_state(model, pc.mode)


# -- the tests -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    from gpu_pool import GpuPool
    pool = GpuPool(str(tmp_path_factory.mktemp("parity-pipeline")))
    yield pool
    pool.stop()


def check(sdk, pc: PipeCase) -> harness.Outcome:
    """The job's weights against one process's, as a row of ``run.py``'s table."""
    began = time.time()
    try:
        got, result = run_job(sdk, pc)
        want = reference(pc)
        diff = harness.compare(got, want)
        print(f"\nPIPELINE {pc.name}: worst relative difference {diff:.2e} ({harness.worst_tensor(got, want)})")
        return harness.Outcome(pc.mode.name, pc.case.name, diff, harness.TOLERANCE, time.time() - began,
                               where=harness.placed(sdk.get_job(result["job_id"])))
    except Exception as exc:  # a row says what went wrong; the test asserts on it
        return harness.Outcome(pc.mode.name, pc.case.name, None, harness.TOLERANCE, time.time() - began,
                               f"{type(exc).__name__}: {exc}")


def outcomes(sdk) -> list[harness.Outcome]:
    """Every case, as ``run.py``'s rows (its hook: ``--modes PIPELINE``)."""
    return [check(sdk, pc) for pc in CASES]


@pytest.mark.parametrize("pc", [pytest.param(c, id=c.name, marks=c.marks) for c in CASES])
def test_a_pipeline_trains_what_one_process_does_on_the_same_micro_batches(pool, pc):
    from procs import wait_until
    wait_until(pool.idle, 60, what="the pool's slots free")
    outcome = check(pool.sdk, pc)
    assert outcome.passed, outcome
