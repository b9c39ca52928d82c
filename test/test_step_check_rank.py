"""DDP step checks wired into a rank (issue 33), in process: the registry gives a DDP job with
``verify`` the ``Checked`` strategy (a shadow meets no one, uploads no weights), the runner's
checkpointer gives a shadow the workers' world, and a rank stopped by a step check reports the
``StepCheck`` (read from the strategy: DDP may wrap the hook's exception), not a lost peer."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpu_client.rank.runner import Trainer
from gpu_client.rank.strategies.registry import STRATEGIES, strategy, strategy_type
from zwdx.protocol.report import StepCheck
from zwdx.protocol.spec import DDP
from zwdx.protocol.vocab import Parallelism

CHECK = StepCheck(step=4, bucket=1, distances={"1": {"3": 0.25}}, named={"1": "disagreed", "3": "disagreed"})


def _spec(verify: float, rank: int = 0, shadow: int | None = None, world: int = 2):
    return SimpleNamespace(job=SimpleNamespace(strategy=DDP(verify=verify)), parallelism=Parallelism.DDP, rank=rank,
                           shadow=shadow, own_rank=rank if shadow is None else shadow, world_size=world,
                           master_addr="127.0.0.1", master_port=29500, attempt=0, collective_timeout=30.0)


def test_ddp_with_verify_gets_the_checked_strategy_and_without_it_the_plain_one():
    assert strategy_type(_spec(1.0).job) == "ddp+verify" and strategy_type(_spec(0.0).job) == "ddp"
    assert STRATEGIES["ddp+verify"][1] == "Checked"
    assert type(strategy(_spec(0.0), None)).__name__ == "Collective"
    checked = strategy(_spec(1.5, world=4), None)
    assert type(checked).__name__ == "Checked" and checked.parties == 4 + 6  # ceil(1.5 * 4) shadows
    assert checked.failed_check() is None


def test_a_shadow_meets_no_one_and_uploads_no_weights():
    worker, shadow = strategy(_spec(1.0, rank=0), None), strategy(_spec(1.0, rank=0, shadow=3), None)
    assert worker.rendezvous()["init_method"] == "tcp://127.0.0.1:29500" and worker.uploads_weights()
    assert shadow.rendezvous()["world_size"] == 1 and not shadow.uploads_weights()
    assert strategy(_spec(1.0, rank=0, shadow=2), None).loader_arguments() == {"rank": 0, "world_size": 2}


def test_a_ddp_shadows_checkpointer_restores_in_the_workers_world():
    """No process group here: a shadow's world is the spec's W, not its own group's (of one)."""
    spec = SimpleNamespace(**vars(_spec(1.0, rank=1, shadow=3, world=2)), checkpoint=None, joining=False)
    me = SimpleNamespace(spec=spec, reporter=None, model=None, optimizer=None, device="cpu",
                         strategy=SimpleNamespace(wrap_as=Parallelism.DDP), startup=SimpleNamespace(mark=lambda _: None))
    restored = Trainer._restore(me)
    assert (restored.rank, restored.world, restored.writes) == (1, 2, False)


class _Reporter:
    def __init__(self):
        self.sent: list[dict] = []

    def status(self, status, **fields):
        self.sent.append({"status": status, **fields})


@pytest.mark.parametrize("check", [CHECK, None], ids=["step-check", "other"])
def test_a_failed_rank_reports_the_step_check_that_stopped_it(check, monkeypatch):
    from gpu_client.rank import failures
    monkeypatch.setattr(failures, "collectives", failures.CollectiveWatch())  # no lost peer noted by another test
    me = SimpleNamespace(spec=SimpleNamespace(where="here"), reporter=_Reporter(), joined=True,
                         strategy=SimpleNamespace(failed_check=lambda: check))
    Trainer.fail(me, RuntimeError("Unable to cast the hook's exception"))  # DDP's words, not the check's
    [sent] = me.reporter.sent
    assert sent["status"] == "failed" and sent["collective"] is False
    assert sent.get("check") == (None if check is None else CHECK.model_dump(mode="json"))


class _Group:
    def size(self) -> int:
        return 4


def test_the_account_of_a_disagreement_is_decided_from_the_gradients_every_party_holds():
    """Two workers, shadows 2 (of 0) and 3 (of 1): what a party's verdicts claim is checked
    against the contributions it holds; ``zwdx.verify.decide`` names who disagreed."""
    import torch

    from gpu_client.rank.strategies.step_check import StepChecker
    checker = StepChecker(_Group(), 2, rank=0)
    same = [torch.ones(5) for _ in range(4)]
    forged = same[:1] + [torch.full((5,), 3.0)] + same[2:]
    real = checker._account(2, forged, [-1, -1, -1, 1], [-1, -1, 0, 1])  # shadow 3 disagrees with worker 1
    assert (real.step, real.bucket, set(real.named)) == (0, 2, {"1", "3"})  # rule 5
    assert real.distances == {"1": {"3": pytest.approx(2 / 3)}}
    lying = checker._account(0, same, [-1, -1, 0, -1], [-1, -1, 0, 1])  # shadow 2 claims what its bytes deny
    assert lying.named == {"2": "claimed a disagreement with rank 0 that the step's gradients do not show"}
    assert lying.distances == {"0": {"2": 0.0}}
    stranger = checker._account(0, same, [1, -1, -1, -1], [-1, -1, 0, 1])  # a worker has no shadow's word
    assert set(stranger.named) == {"0"} and stranger.distances == {"0": {}}


class _Gathers:
    """A check group of 4 whose all-gathers answer what the test gives, this party's own input at
    its rank (3: the shadow of worker 1)."""

    def __init__(self, *answers):
        self.answers, self.sent = list(answers), []

    def size(self) -> int:
        return 4

    def allgather(self, outs, ins):
        self.sent.append(ins[0].clone())
        given = self.answers.pop(0)
        for rank, out in enumerate(outs[0]):
            out.copy_(ins[0] if rank == 3 else given[rank])
        return SimpleNamespace(wait=lambda: None)


@pytest.mark.parametrize("tolerance", [0.05, 0.0])
def test_a_shadow_within_the_tolerance_agrees_and_beyond_it_stops_the_step(tolerance):
    import torch

    from gpu_client.rank.strategies.step_check import Checked, StepChecker, StepCheckFailed
    assert Checked(SimpleNamespace(**{**vars(_spec(1.0)), "job": SimpleNamespace(
        strategy=DDP(verify=1.0, verify_tolerance=tolerance))})).tolerance == tolerance
    ones = torch.ones(6)
    contributions = [ones, 2 * ones, ones, None]
    own = 2 * ones * 1.01  # 1 % off worker 1's
    none, shadows = [torch.tensor([-1])] * 4, [torch.tensor([w]) for w in (-1, -1, 0, 1)]
    # Once a check disagreed the shadows show their gradients; worker 1 sends another one then (as a
    # liar could, now that it knows it is watched): the account keeps what it sent first.
    shown = [0 * ones, own, ones, None]
    group = _Gathers(contributions, none, shadows, shown)
    checker = StepChecker(group, 2, rank=3, worker_of=1, tolerance=tolerance)
    if tolerance:
        assert torch.equal(checker._bucket(0, own), 1.5 * ones) and checker.check is None  # the workers' mean
    else:
        with pytest.raises(StepCheckFailed) as failed:
            checker._bucket(0, own)
        assert set(failed.value.check.named) == {"1", "3"} and checker.check == failed.value.check
        assert failed.value.check.distances["1"]["3"] == pytest.approx(0.01 / 1.01)
        assert torch.equal(group.sent[3], own)  # shown only now
    # A shadow never sends its gradients while every check agrees: they would tell the workers
    # whom it shadows.
    assert torch.equal(group.sent[0], torch.zeros(6))


def test_a_shadow_reports_its_end_before_any_worker_reports_its_own():
    """``Checked.report_end`` over a real gloo check group of 2 workers and 1 shadow (threads):
    however slow the shadow's report, the workers report after it, so the server holds its
    fingerprint with theirs against the weights that came back (``suspects.compare_upload``)."""
    import datetime
    import threading
    import time

    import torch.distributed as dist

    store, said, lock = dist.HashStore(), [], threading.Lock()
    parties = [strategy(_spec(1.0, rank=0), None), strategy(_spec(1.0, rank=1), None),
               strategy(_spec(1.0, rank=0, shadow=2), None)]

    def party(own: int) -> None:
        group = dist.ProcessGroupGloo(store, own, 3, datetime.timedelta(seconds=30))
        parties[own].checker = SimpleNamespace(group=group)

        def report():
            if own == 2:
                time.sleep(0.5)  # a slow shadow
            with lock:
                said.append(own)
        parties[own].report_end(report)

    threads = [threading.Thread(target=party, args=(own,)) for own in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert said[0] == 2 and sorted(said) == [0, 1, 2], said
