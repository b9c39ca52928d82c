"""FSDP step checks, the rank side (``gpu_client/rank/strategies/fsdp_check.py``, issue 33): two
workers and their shadows as real processes over gloo on the CPU, made as a rank makes them
(``FsdpChecked``: a shadow's world of one, the check group on rank 0's store), over a TCPStore this
test hosts; a small model of three FSDP units whose dim-0 sizes are odd (FSDP pads every shard).

- honest: every party (workers and shadows) ends with plain FSDP's weights, bit for bit;
- a worker that lies from its second step on (its loss scaled, in its process only): every party
  stops at step 1 with the same ``StepCheck`` naming it alone (its two shadows agree, rule 3);
- a lying shadow, with another on the same worker: that shadow alone (rule 2).
In process: the layout arithmetic (canonical form, shards) against torch's own copy-in, and the
checked sum over a stand-in group of three workers (where the order of the sum shows).
"""
from __future__ import annotations

import datetime
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gpu_client.rank.strategies.fsdp_check import FsdpChecked, canonical, shard_of
from gpu_client.rank.strategies.fsdp_weights import padded_shard
from gpu_client.rank.strategies.parallel import full_state_dict, wrap
from gpu_client.rank.strategies.step_check import StepChecker, StepCheckFailed
from test_step_check import _equal, run_parties, send
from zwdx.protocol.spec import FSDP
from zwdx.protocol.vocab import Parallelism

slow = pytest.mark.slow  # workers and shadows as processes: about 7 s a test on two cores

WORKERS, STEPS, TIMEOUT = 2, 3, 60.0


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(7, 7)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    """Units blocks.0 and blocks.1, then the root (inp, head): dim-0 sizes 7 and 3, padded at W=2."""

    def __init__(self):
        super().__init__()
        self.inp, self.blocks, self.head = nn.Linear(8, 7), nn.ModuleList([Block(), Block()]), nn.Linear(7, 3)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.drop(x))


def _model() -> nn.Module:
    torch.manual_seed(0)  # the same start on every party
    return Net()


def _train(model: nn.Module, identity: int, lie: str | None) -> None:
    """``STEPS`` steps of SGD on rank ``identity``'s batches, its own dropout draws, each step
    followed by an evaluation (``eval()``, ``no_grad``); ``lie``: from step 1 on, this process's
    gradients are not what its rank identity computes ("loss": its loss scaled; "weights": noise
    added to its stored weight shards after step 0)."""
    data = torch.Generator().manual_seed(7 + identity)
    torch.manual_seed(100 + identity)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = torch.randn(8, 8, generator=data), torch.randint(0, 3, (8,), generator=data)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        (loss * 1.001 if lie == "loss" and step >= 1 else loss).backward()
        optimizer.step()
        if lie == "weights" and step == 0:  # every unit is sharded here: its parameters are its shards
            with torch.no_grad():
                for p in model.parameters():
                    p.to_local().add_(1e-3)
        model.eval()
        with torch.no_grad():  # no weights check here: every party would have to meet in it
            model(x)
        model.train()


def _weights(model: nn.Module) -> dict:
    return full_state_dict(model, "FSDP", dist.get_rank())


def _party(port: int, tag: str, rank: int, shadows_of: list[int], liar: int | None, lie: str, plain: bool,
           out) -> None:
    """One party: a worker (``rank`` < WORKERS) or a shadow of ``shadows_of[rank - WORKERS]``."""
    torch.set_num_threads(1)
    wait = datetime.timedelta(seconds=TIMEOUT)
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=wait)
    worker = rank < WORKERS
    identity = rank if worker else shadows_of[rank - WORKERS]
    checked = FsdpChecked(SimpleNamespace(
        job=SimpleNamespace(strategy=FSDP(verify=len(shadows_of) / WORKERS)), parallelism=Parallelism.FSDP,
        rank=identity, shadow=None if worker else rank, own_rank=rank, world_size=WORKERS, master_addr="127.0.0.1",
        master_port=port, attempt=0, collective_timeout=TIMEOUT))
    if worker:  # the test's store stands for rank 0's
        dist.init_process_group("gloo", store=dist.PrefixStore(f"{tag}/default", store), rank=rank,
                                world_size=WORKERS, timeout=wait)
    else:  # a world of its own: its user code's collectives are no-ops
        dist.init_process_group("gloo", **checked.rendezvous())
    result: dict = {"said": []}
    if plain and worker:
        model = wrap(_model(), "FSDP", torch.device("cpu"))
        _train(model, identity, lie=None)
        result["plain"] = _weights(model)
    model = checked.wrap(_model(), torch.device("cpu"), {}, result["said"].append)
    result["start"] = _weights(model)
    try:
        _train(model, identity, lie=lie if rank == liar else None)
    except StepCheckFailed as exc:
        result["check"] = exc.check.model_dump()
        assert checked.failed_check() == exc.check
    result["weights"], result["steps"] = _weights(model), checked.steps.steps
    dist.destroy_process_group()
    send(out, rank, result)


def _run(tag: str, shadows_of: list[int], liar: int | None = None, lie: str = "loss",
         plain: bool = False) -> dict[int, dict]:
    return run_parties(_party, WORKERS + len(shadows_of), "gpu_client.rank.strategies.fsdp_check", __name__,
                       args=lambda port, rank, out: (port, tag, rank, shadows_of, liar, lie, plain, out))


def test_the_canonical_form_undoes_fsdps_padded_rank_major_layout():
    sizes = [torch.Size([7, 3]), torch.Size([5]), torch.Size([2, 2])]
    grads = [torch.randn(s) for s in sizes]
    whole = torch.cat([g.reshape(-1) for g in grads])
    for world in (1, 2, 3, 4):
        padded = sum(-(-s[0] // world) * s.numel() // s[0] for s in sizes) * world
        flat = torch.full((padded,), float("nan"))
        torch.ops.fsdp.chunk_cat(grads, dim=0, num_chunks=world, out=flat.view(world, -1))  # FSDP's copy-in
        assert torch.equal(canonical(flat, sizes, world), whole)
        shards = [shard_of(whole, sizes, world, r) for r in range(world)]
        assert torch.equal(torch.cat(shards).nan_to_num(), flat.view(world, -1).reshape(-1).nan_to_num())


def test_a_shadow_cuts_its_workers_weight_shard_as_fsdp_shards_and_pads_it():
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty
    for size in (torch.Size([7, 3]), torch.Size([5]), torch.Size([1, 2]), torch.Size([3, 2, 2])):
        whole = torch.randn(size)
        for world in (1, 2, 3, 4):
            chunks = _chunk_with_empty(whole, world, dim=0)  # FSDP2's sharding; chunk 0 is the padded size
            for rank, chunk in enumerate(chunks):
                padded = torch.zeros(chunks[0].numel())
                padded[:chunk.numel()] = chunk.reshape(-1)
                assert torch.equal(padded_shard(whole, size, world, rank), padded)  # a shadow's
                assert torch.equal(padded_shard(chunk, size, world), padded)  # the worker's own


@slow
def test_honest_parties_end_with_plain_fsdps_weights_bit_for_bit():
    results = _run("honest", shadows_of=[0, 1], plain=True)
    plain = results[0]["plain"]
    assert _equal(results[1]["plain"], plain) and not _equal(plain, results[0]["start"])  # it trained
    assert all("check" not in r and r["steps"] == STEPS for r in results.values())
    assert all(_equal(r["weights"], plain) for r in results.values())  # workers and shadows
    assert [len(r["said"]) for _, r in sorted(results.items())] == [2, 0, 0, 0]  # rank 0 alone, the job's log
    assert "FSDP step checks: 2 ranks and 2 shadow rank(s)" in results[0]["said"][0]


@slow
@pytest.mark.parametrize("shadows_of, liar, named", [
    ([1, 1], 1, {"1"}),         # rule 3: its two shadows agree with each other
    ([0, 0], 3, {"3"}),         # rule 2: the other shadow backs the worker
], ids=["worker-two-shadows", "lying-shadow"])
def test_a_lie_stops_every_party_at_its_first_lying_step_and_names_the_liar_alone(shadows_of, liar, named):
    results = _run(f"lie-{liar}", shadows_of, liar)
    checks = [r.get("check") for r in results.values()]
    assert checks[0] is not None and all(c == checks[0] for c in checks)  # every party, the same account
    assert (checks[0]["step"], checks[0]["bucket"], checks[0]["what"]) == (1, 0, "gradients")
    assert set(checks[0]["named"]) == named
    # Step 0 was taken, step 1 never: every party holds the same weights, not the start's.
    assert all(_equal(r["weights"], results[0]["weights"]) for r in results.values())
    assert not _equal(results[0]["weights"], results[0]["start"])


@slow
@pytest.mark.parametrize("shadows_of, liar", [
    ([0, 1, 1], 1),  # its own two shadows agree (rule 3); rank 0's shadow backs rank 0
    ([1, 1], 0),     # nobody shadows it: rank 1's two shadows check its shard too
], ids=["shadowed", "unshadowed"])
def test_a_rank_that_alters_its_stored_weight_shard_is_named_alone_and_no_honest_rank_is(shadows_of, liar):
    # The liar's shard reaches the honest rank's forward through FSDP's all-gather: unchecked, the
    # honest rank's gradients would disagree with its shadows' and it would be named.
    results = _run(f"lie-weights-{liar}", shadows_of, liar=liar, lie="weights")
    checks = [r.get("check") for r in results.values()]
    assert checks[0] is not None and all(c == checks[0] for c in checks)  # every party, the same account
    assert set(checks[0]["named"]) == {str(liar)} and (checks[0]["step"], checks[0]["what"]) == (1, "weights")
    assert set(checks[0]["distances"]) == {str(liar)}  # every shadow's account of it
    assert len(checks[0]["distances"][str(liar)]) == len(shadows_of)
    # Stopped before step 1's forward: the shadows hold step 0's weights; the workers, whose weights
    # are gathered from both, the liar's noise too.
    shadows = [r["weights"] for rank, r in results.items() if rank >= WORKERS]
    assert all(_equal(w, shadows[0]) for w in shadows) and not _equal(shadows[0], results[0]["start"])
    assert _equal(results[0]["weights"], results[1]["weights"]) and not _equal(results[0]["weights"], shadows[0])


class _Group:
    """A check group of three workers and one shadow (of worker 1) whose all-gathers answer
    ``given`` (every party's first contribution) with this party's own at ``rank``."""

    def __init__(self, rank: int, given: list[torch.Tensor]):
        self.rank, self.given, self.sent = rank, given, []

    def size(self) -> int:
        return 4

    def allgather(self, outs, ins):
        self.sent.append(ins[0].clone())
        for who, out in enumerate(outs[0]):
            out.copy_(ins[0] if who == self.rank else self.given[who] if ins[0].dtype == torch.float32
                      else torch.full_like(ins[0], -1))  # the verdicts: every other party agrees
        return SimpleNamespace(wait=lambda: None)


def test_every_party_sums_the_workers_gradients_in_rank_order_and_a_shadow_sends_zeros():
    # float32 sums that depend on their order: (1e8 + 1) - 1e8 is 0, (1e8 - 1e8) + 1 is 1
    workers = [torch.tensor([1e8, 1.0]), torch.tensor([1.0, 1e8]), torch.tensor([-1e8, -1e8])]
    given = workers + [torch.zeros(2)]
    totals = []
    for rank in range(4):
        group = _Group(rank, given)
        checker = StepChecker(group, 3, rank, worker_of=1 if rank == 3 else None)
        own = workers[1] if rank == 3 else workers[rank]
        totals.append(checker.checked_sum(0, own.clone()))
        assert torch.equal(group.sent[0], torch.zeros(2) if rank == 3 else own)  # whom it shadows stays secret
    assert all(torch.equal(t, torch.tensor([0.0, 0.0])) for t in totals), totals


class _Scripted:
    """A check group of 2 workers and 2 shadows whose all-gathers answer from ``script`` (each
    call's every party's tensor), this party's own at ``rank``."""

    def __init__(self, rank: int, script: list[list[torch.Tensor]]):
        self.rank, self.script = rank, list(script)

    def size(self) -> int:
        return 4

    def allgather(self, outs, ins):
        for who, (out, given) in enumerate(zip(outs[0], self.script.pop(0))):
            out.copy_(ins[0] if who == self.rank else given)
        return SimpleNamespace(wait=lambda: None)


@pytest.mark.parametrize("shown, why", [
    (1.0, "disagreed with the worker (rank 1), which another shadow confirmed"),  # its expectation is wrong
    (0.0, "claimed rank 1's weight shard was not what it should be"),  # it shows the truth, flags anyway
], ids=["wrong-expectation", "unfounded-flag"])
def test_a_shadow_that_flags_an_honest_workers_weight_shard_is_named_alone(shown, why):
    from gpu_client.rank.strategies.fsdp_weights import Weights
    truth = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 0.0])]  # each worker's padded shards
    flags = [torch.zeros(2, dtype=torch.uint8)] * 4
    script = [truth + [torch.zeros(2)] * 2,  # (1) the workers' vectors; shadows send zeros
              flags[:2] + [torch.tensor([0, 1], dtype=torch.uint8), flags[3]],  # shadow 2 flags rank 1
              [torch.zeros(2, 2)] * 2 + [torch.stack([truth[0], truth[1] + shown]), torch.stack(truth)]]
    accounts = []
    for rank in (0, 1, 3):  # the honest parties, each with the liar's word (2) from the script
        checker = StepChecker(_Scripted(rank, script), 2, rank, worker_of=1 if rank >= 2 else None)
        weights = Weights.__new__(Weights)  # no model: every party's shards are the truth
        weights.checker, weights.workers, weights.shadow = checker, 2, rank >= 2
        weights.shards = truth.__getitem__
        with pytest.raises(StepCheckFailed) as caught:
            weights.check()
        accounts.append(caught.value.check)
    assert all(a == accounts[0] for a in accounts) and accounts[0].what == "weights"
    assert set(accounts[0].named) == {"2"} and accounts[0].named["2"].startswith(why), accounts[0]


def _spec(verify: float, rank: int = 0, shadow: int | None = None, tp=None):
    return SimpleNamespace(job=SimpleNamespace(strategy=FSDP(verify=verify, tp=tp)), parallelism=Parallelism.FSDP,
                           rank=rank, shadow=shadow, own_rank=rank if shadow is None else shadow, world_size=2,
                           master_addr="127.0.0.1", master_port=29500, attempt=0, collective_timeout=30.0)


def test_fsdp_with_verify_gets_the_checked_strategy_whose_shadow_meets_no_one_and_uploads_no_weights():
    from gpu_client.rank.strategies.registry import strategy, strategy_type
    assert strategy_type(_spec(1.0).job) == "fsdp+verify" and strategy_type(_spec(0.0).job) == "fsdp"
    assert strategy_type(_spec(0.0, tp={"size": 2}).job) == "fsdp+tp"
    assert type(strategy(_spec(0.0), None)).__name__ == "Collective"
    worker, shadow = strategy(_spec(1.0), None), strategy(_spec(1.0, shadow=3), None)
    assert type(worker).__name__ == type(shadow).__name__ == "FsdpChecked" and worker.parties == 4
    assert worker.wrap_as == "FSDP" and worker.uploads_weights() and worker.failed_check() is None
    assert shadow.rendezvous()["world_size"] == 1 and not shadow.uploads_weights()
    assert shadow.loader_arguments() == {"rank": 0, "world_size": 2}  # the worker's shard


@slow
def test_the_bench_runs_plain_and_checked_fsdp():
    """bench/fsdp_check.py at its smallest (test_bench.py's habit: a bench that still runs)."""
    from test_bench import bench
    out = bench("fsdp_check.py", "--steps", "2", "--repeats", "1", "--models", "test")
    [row] = [line for line in out.splitlines() if line.startswith("| test |")]
    assert row.count("|") == 6 and "gradients + weights" in out, out  # four runs side by side
