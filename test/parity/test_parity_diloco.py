"""Parity for DILOCO (issue 30 item 1). DiLoCo is not DDP's arithmetic: each worker (here each of
two GPU clients) trains alone with the inner optimizer for ``inner_steps`` (H) steps, then the
workers average their pseudo-gradients (global weights - own weights) and the global weights take
one step of the outer optimizer (SGD, Nesterov momentum) with that average (arXiv 2311.08105;
``gpu_client/rank/strategies/diloco.py``). What it trains, and what this module checks:

- H = 1, plain SGD inside, and an outer SGD of lr 1 without momentum (compression none): the
  outer step subtracts the mean of the workers' SGD steps, which is one SGD step on the mean
  gradient: DDP's arithmetic. The weights equal one process's on the same samples (``harness
  .reference`` with DDP's two replicas) within ``harness.TOLERANCE``, the rounds averaged by
  all-reduce among the workers and through the server alike.
- H > 1 with the paper's outer optimizer and AdamW inside: the weights equal this module's
  ``simulate`` (the algorithm above in one process: a model and an AdamW per worker, the same
  samples) within ``harness.TOLERANCE`` (compression none; int8's rounding is the codec's, tested
  in test_diloco.py); and its held-out loss lands within ``MARGIN`` of DDP's trained on the same
  samples for the same steps (0.665 against 0.624, from 1.461). That holds for this short run
  only: the outer defaults are made for H in the hundreds, and with H = 4 the momentum overshoots
  (the simulation: 2.82 against DDP's 0.41 after 4 epochs, 18.3 after 8; an outer SGD of lr 1
  without momentum, the workers' weights averaged, stays within 0.03 of DDP's at 2, 4 and 8
  epochs). Choose ``outer_lr`` and ``inner_steps`` together.
"""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from parity import harness, zoo
from parity.zoo import blobs
import zwdx
from zwdx import codec

pytestmark = pytest.mark.slow

WORKERS = 2
#: DiLoCo's held-out loss may exceed DDP's by this much, relative (measured: 0.665 against 0.624).
MARGIN = 0.15

#: The zoo's MLP on a shuffled DistributedSampler, with plain SGD inside (H = 1's case).
SGD_MLP = dataclasses.replace(zoo.case("mlp"), name="mlp_sgd",
                              optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.2))


def more_blobs():
    return blobs(256)  # not zoo.blobs: the zoo module would travel whole, with its `import models`


#: The zoo's MLP (AdamW inside) on four times the samples: H > 1's case, 8 rounds of 4 steps.
ADAM_MLP = dataclasses.replace(zoo.case("mlp"), name="mlp_256", data=more_blobs)

DDP = harness.MODES["DDP"]
AS_DDP = {"inner_steps": 1, "outer_lr": 1.0, "outer_momentum": 0.0, "compression": "none"}
PAPER = {"inner_steps": 4, "compression": "none"}  # outer SGD lr 0.7, Nesterov momentum 0.9: the defaults


def mode(settings: dict) -> harness.Mode:
    return harness.Mode("DILOCO", "DILOCO", WORKERS, WORKERS, zwdx.Diloco(**settings))


def held_out_loss(case: zoo.Case, state: dict) -> float:
    """The case's loss over samples drawn as ``zoo.blobs`` draws them, from another seed."""
    g = torch.Generator().manual_seed(zoo.SEED + 99)
    x = torch.randn(512, 8, generator=g) * torch.linspace(0.5, 2.0, 8) + 0.5
    model = case.model()
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        return case.loss(model, (x, x[:, :4].argmax(1))).item()


# -- DiLoCo in one process ----------------------------------------------------------------------------
def simulate(case: zoo.Case, settings: dict, epochs: int | None = None) -> dict:
    """The weights a DILOCO job of ``WORKERS`` workers returns: each worker's model and inner
    optimizer (the case's) on its loader's batches (``harness.loader_func``, its generator its
    own), a round every ``inner_steps`` steps and after the last: the mean of the workers'
    ``global - local`` (through ``codec``) steps the global weights with the outer SGD, every
    worker restarts from them."""
    from zwdx.protocol.diloco import DilocoSettings
    s = DilocoSettings.model_validate(settings)
    m = mode(settings)
    with torch.random.fork_rng(devices=[]):
        models = [case.model() for _ in range(WORKERS)]
        inner = [case.make_optimizer(model) for model in models]
        flat = lambda model: torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])  # noqa: E731
        global_ = torch.nn.Parameter(flat(models[0]))
        outer = torch.optim.SGD([global_], lr=s.outer_lr, momentum=s.outer_momentum, nesterov=s.nesterov)
        gens = harness.Replicas(WORKERS, torch.device("cpu"))
        loaders = []
        for w in range(WORKERS):
            with gens.of(w):
                loaders.append(harness.loader_func(case, m)(w, WORKERS))

        def sync() -> None:
            sent = [codec.decode(codec.encode((global_.detach() - flat(model)).numpy(), s.compression.value))
                    for model in models]
            global_.grad = torch.from_numpy(sum(sent[1:], sent[0].copy())) / WORKERS
            outer.step()
            outer.zero_grad(set_to_none=True)
            for model in models:
                torch.nn.utils.vector_to_parameters(global_.detach().clone(), model.parameters())

        steps = 0
        for epoch in range(epochs or case.epochs):
            batches = []
            for w in range(WORKERS):
                with gens.of(w):
                    loaders[w].sampler.set_epoch(epoch)
                    batches.append(list(loaders[w]))
            for step in zip(*batches):
                for w, batch in enumerate(step):
                    with gens.of(w):
                        models[w].train()
                        inner[w].zero_grad()
                        case.loss(models[w], batch).backward()
                        inner[w].step()
                steps += 1
                if steps == s.inner_steps:
                    sync()
                    steps = 0
        if steps:
            sync()
        return harness.returned_state(models[0], m)


# -- the job -----------------------------------------------------------------------------------------
def run_job(sdk, case: zoo.Case, settings: dict, timeout: float = 240) -> dict:
    model = case.model()
    result = sdk.submit_job(model, harness.loader_func(case, DDP), harness.train_func(case), None,
                            case.make_optimizer(model), "DILOCO", strategy=zwdx.Diloco(**settings),
                            resources=zwdx.Resources(world_size=WORKERS),
                            training=zwdx.Training(epochs=case.epochs, collective_timeout=60),
                            run=zwdx.Run(name=f"parity-DILOCO-{case.name}", progress=False, timeout=timeout))
    assert result["status"] == "completed", result.get("reason")
    return harness.returned_weights(sdk, result["job_id"])


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    from gpu_pool import GpuPool
    pool = GpuPool(str(tmp_path_factory.mktemp("parity-diloco")))
    yield pool
    pool.stop()


def ready(pool) -> None:
    from procs import wait_until
    wait_until(pool.idle, 60, what="the pool's slots free")


def outcomes(sdk) -> list[harness.Outcome]:
    """``run.py``'s rows (its hook: ``--modes DILOCO``): H = 1 against DDP's one process, H = 4
    against the simulation."""
    rows = []
    for label, case, settings, want in [("DILOCO H=1", SGD_MLP, AS_DDP, lambda: harness.reference(SGD_MLP, DDP)),
                                        ("DILOCO H=4", ADAM_MLP, PAPER, lambda: simulate(ADAM_MLP, PAPER))]:
        began = time.time()
        try:
            diff = harness.compare(run_job(sdk, case, settings), want())
            rows.append(harness.Outcome(label, case.name, diff, harness.TOLERANCE, time.time() - began))
        except Exception as exc:  # a row says what went wrong
            rows.append(harness.Outcome(label, case.name, None, harness.TOLERANCE, time.time() - began,
                                        f"{type(exc).__name__}: {exc}"))
    return rows


# -- the tests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("all_reduce", [True, False], ids=["all-reduce", "server"])
def test_one_inner_sgd_step_and_a_plain_outer_step_of_lr_1_is_ddp(pool, all_reduce):
    ready(pool)
    got = run_job(pool.sdk, SGD_MLP, {**AS_DDP, "all_reduce": all_reduce})
    want = harness.reference(SGD_MLP, DDP)
    diff = harness.compare(got, want)
    print(f"\nDILOCO H=1 outer SGD lr 1 ({'all-reduce' if all_reduce else 'server'}) vs DDP's one process: "
          f"worst relative difference {diff:.2e}")
    assert diff <= harness.TOLERANCE
    assert harness.compare(simulate(SGD_MLP, AS_DDP), want) <= harness.TOLERANCE  # the simulation agrees


def test_h_inner_steps_train_diloco_and_reach_ddps_held_out_loss(pool):
    ready(pool)
    got = run_job(pool.sdk, ADAM_MLP, PAPER)
    want = simulate(ADAM_MLP, PAPER)
    diff = harness.compare(got, want)
    ddp = harness.reference(ADAM_MLP, DDP)
    start = held_out_loss(ADAM_MLP, ADAM_MLP.model().state_dict())
    ours, theirs = held_out_loss(ADAM_MLP, got), held_out_loss(ADAM_MLP, ddp)
    print(f"\nDILOCO H={PAPER['inner_steps']} vs its simulation: worst relative difference {diff:.2e}; held-out loss "
          f"{start:.4f} -> {ours:.4f}, DDP on the same samples {theirs:.4f}")
    assert diff <= harness.TOLERANCE
    assert harness.compare(got, ddp) > 100 * harness.TOLERANCE  # not DDP's arithmetic: the check above can fail
    assert ours <= theirs * (1 + MARGIN) and ours < start / 2
