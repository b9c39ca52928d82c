"""DDP step checks, the rank side (``gpu_client/rank/strategies/step_check.py``, issue 33): workers
and shadows as real processes over gloo on the CPU, talking over a TCPStore this test hosts; a
small model with dropout, a shuffled shard per rank identity, buckets small enough to be several.

- honest: every party (workers and shadows) ends with the same weights, bit for bit, and they
  are a plain DDP run's (gloo's all-reduce sums in another order: within float tolerance);
- a worker whose gradient is forged (noise added by a parameter hook, in its process only):
  every party stops at step 0 with the same ``StepCheck``, its weights never took the step;
  one shadow per worker names the worker and its shadow (rule 5), two shadows the worker
  alone (rule 3);
- a lying shadow, with another on the same worker: that shadow alone (rule 2).
"""
from __future__ import annotations

import datetime
import io
import multiprocessing
import queue
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from gpu_client.rank.strategies.step_check import Checked, StepChecker, StepCheckFailed, check_group
from zwdx.protocol.spec import DDP
from zwdx.protocol.vocab import Parallelism

pytestmark = pytest.mark.slow  # workers and shadows as processes: 30-120 s on two cores

WORKERS, STEPS, TIMEOUT = 2, 3, 60.0
#: Bytes of gradient per DDP bucket (MB): the model's 420 parameters make several buckets.
BUCKET_MB = 0.0005


def _model() -> nn.Module:
    torch.manual_seed(0)  # the same start on every party
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))


def _train(model: nn.Module, identity: int, forge: bool) -> None:
    """``STEPS`` steps of SGD on rank ``identity``'s shuffled shard, its own dropout draws."""
    data = torch.Generator().manual_seed(7)
    dataset = TensorDataset(torch.randn(64, 8, generator=data), torch.randint(0, 4, (64,), generator=data))
    sampler = DistributedSampler(dataset, num_replicas=WORKERS, rank=identity, shuffle=True, seed=3)
    torch.manual_seed(100 + identity)
    if forge:  # this process alone: its gradient is not what its rank identity computes
        noise = torch.randn(32, 8, generator=torch.Generator().manual_seed(5))
        model.module[0].weight.register_hook(lambda grad: grad + noise)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(DataLoader(dataset, batch_size=8, sampler=sampler)):
        if step == STEPS:
            break
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def _weights(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def _party(port: int, tag: str, rank: int, shadows_of: list[int], forger: int | None, plain: bool, out,
           strategy: bool = False) -> None:
    """One party: a worker (``rank`` < WORKERS) or a shadow of ``shadows_of[rank - WORKERS]``;
    ``strategy``: made as a rank makes it (``Checked``: its rendezvous, its wrap), else by hand
    with buckets small enough to be several."""
    torch.set_num_threads(1)
    wait = datetime.timedelta(seconds=TIMEOUT)
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=wait)
    worker = rank < WORKERS
    identity = rank if worker else shadows_of[rank - WORKERS]
    checked = Checked(SimpleNamespace(
        job=SimpleNamespace(strategy=DDP(verify=len(shadows_of) / WORKERS)), parallelism=Parallelism.DDP,
        rank=identity, shadow=None if worker else rank, own_rank=rank, world_size=WORKERS, master_addr="127.0.0.1",
        master_port=port, attempt=0, collective_timeout=TIMEOUT))
    if worker:  # the test's store stands for rank 0's
        dist.init_process_group("gloo", store=dist.PrefixStore(f"{tag}/default", store), rank=rank,
                                world_size=WORKERS, timeout=wait)
    else:  # a world of its own: its user code's collectives are no-ops
        dist.init_process_group("gloo", **checked.rendezvous())
    result: dict = {}
    if plain and worker:
        model = DistributedDataParallel(_model())
        _train(model, identity, forge=False)
        result["plain"] = _weights(model)
    if strategy:
        result["said"] = []  # the job's log
        model = checked.wrap(_model(), torch.device("cpu"), {}, result["said"].append)
        checker = checked.checker
    else:
        group = check_group(dist.PrefixStore(tag, store), 0, rank, WORKERS + len(shadows_of), TIMEOUT)
        checker = StepChecker(group, WORKERS, rank, None if worker else identity)
        model = checker.attach(DistributedDataParallel(_model(), bucket_cap_mb=BUCKET_MB))
    result["start"] = _weights(model)
    try:
        _train(model, identity, forge=rank == forger)
    except StepCheckFailed as exc:
        result["check"] = exc.check.model_dump()
        assert checker.check == exc.check and (not strategy or checked.failed_check() == exc.check)
    result["weights"], result["steps"] = _weights(model), checker.step
    dist.destroy_process_group()
    send(out, rank, result)


def send(out, rank: int, result: dict) -> None:
    """A party's ``result`` to ``run_parties``: bytes, not tensors (a tensor is sent as a handle this
    process would have to outlive)."""
    buffer = io.BytesIO()
    torch.save(result, buffer)
    out.put((rank, buffer.getvalue()))


def _run(tag: str, shadows_of: list[int], forger: int | None = None, plain: bool = False,
         strategy: bool = False) -> dict[int, dict]:
    return run_parties(_party, WORKERS + len(shadows_of), "gpu_client.rank.strategies.step_check", __name__,
                       args=lambda port, rank, out: (port, tag, rank, shadows_of, forger, plain, out, strategy))


def run_parties(target, parties: int, *preload: str, args) -> dict[int, dict]:
    """Every party's result (``send``), each ``target(*args(port, rank, out))`` in its own process
    (torch and ``preload`` loaded once, in the forkserver), ``port`` a store's all may meet at."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", *preload])
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)  # the store binds its own port
    out = context.Queue()
    procs = [context.Process(target=target, args=args(store.port, rank, out)) for rank in range(parties)]
    for proc in procs:
        proc.start()
    results: dict[int, dict] = {}
    deadline = time.monotonic() + 2 * TIMEOUT
    try:
        while len(results) < len(procs):
            try:
                rank, result = out.get(timeout=1.0)
                results[rank] = torch.load(io.BytesIO(result))
            except queue.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not failed and time.monotonic() < deadline, f"parties failed ({failed}) or hung"
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return results


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_honest_parties_end_with_the_same_weights_as_plain_ddp():
    results = _run("honest", shadows_of=[0, 1], plain=True)
    first = results[0]["weights"]
    assert not _equal(first, results[0]["start"])  # it trained
    assert all("check" not in r and r["steps"] == STEPS for r in results.values())
    assert all(_equal(r["weights"], first) for r in results.values())  # workers and shadows, bit for bit
    for rank in range(WORKERS):
        plain = results[rank]["plain"]
        assert all(torch.allclose(first[k], plain[k], rtol=1e-5, atol=1e-6) for k in first)


@pytest.mark.parametrize("shadows_of, forger, named", [
    ([0, 1], 1, {"1", "3"}),          # rule 5: one shadow each, which lies cannot be told
    ([0, 0, 1, 1], 1, {"1"}),         # rule 3: its two shadows agree with each other
    ([0, 0, 1, 1], 5, {"5"}),         # rule 2: the other shadow backs the worker
], ids=["worker-one-shadow", "worker-two-shadows", "lying-shadow"])
def test_a_forged_gradient_stops_every_party_at_its_first_step(shadows_of, forger, named):
    """The parties made as a rank makes them (``Checked``: a shadow's world of one, the check
    group on rank 0's store, ``failed_check``), one bucket."""
    results = _run(f"forged-{forger}-{len(shadows_of)}", shadows_of, forger, strategy=True)
    checks = [r.get("check") for r in results.values()]
    assert checks[0] is not None and all(c == checks[0] for c in checks)  # every party, the same account
    assert checks[0]["step"] == 0 and set(checks[0]["named"]) == named
    worker = min(shadows_of[int(n) - WORKERS] if int(n) >= WORKERS else int(n) for n in named)
    assert set(checks[0]["distances"]) == {str(worker)}
    assert all(_equal(r["weights"], r["start"]) for r in results.values())  # the step was never taken
    assert [len(r["said"]) for _, r in sorted(results.items())] == [1] + [0] * (len(results) - 1)  # rank 0 alone
    assert f"2 ranks and {len(shadows_of)} shadow rank(s)" in results[0]["said"][0]
