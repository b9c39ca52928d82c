"""A DILOCO shadow (``zwdx.verify``) resumed from a checkpoint: it must restore what the worker
it runs again restores (its generators above all: else its rounds after a resume differ from an
honest worker's and both are named), and write nothing. In process: the rank's ``_restore``
over a reporter that keeps the checkpoint in a folder (test_checkpointer's)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from gpu_client.rank.checkpoint import Checkpointer
from gpu_client.rank.runner import Trainer
from zwdx.protocol.vocab import Parallelism
from test_checkpointer import CPU, FolderReporter, _fresh, _trained


def _worker_0s_checkpoint(tmp_path):
    """Worker 0 of a DILOCO job saves checkpoint 0 (its checkpoints are the job's: a world of
    one); what its generator gives next from the state saved."""
    reporter = FolderReporter(tmp_path)
    model, opt = _trained()
    saver = Checkpointer(reporter, model, opt, Parallelism.DDP, 0, 1, CPU)
    saver.save(epoch=1, step=8)
    after = torch.rand(4)
    saver.wait()
    [entry] = reporter.commits
    return reporter, entry, after


def _restored(reporter, entry, rank: int, shadow: int | None) -> Checkpointer:
    """The rank's own ``Trainer._restore``, for worker ``rank`` (or its shadow, rank ``shadow``)."""
    model, opt = _fresh()
    spec = SimpleNamespace(checkpoint=entry, rank=rank, shadow=shadow, own_rank=rank if shadow is None else shadow,
                           parallelism=Parallelism.DILOCO, collective_timeout=30.0, joining=False)
    me = SimpleNamespace(spec=spec, reporter=reporter, model=model, optimizer=opt, device=CPU,
                         strategy=SimpleNamespace(wrap_as=Parallelism.DDP), startup=SimpleNamespace(mark=lambda _: None))
    return Trainer._restore(me)


def test_a_shadow_of_worker_0_restores_the_workers_generators_as_the_worker_does(tmp_path):
    torch.set_num_threads(1)
    reporter, entry, after = _worker_0s_checkpoint(tmp_path)
    for shadow in (None, 2):  # worker 0 itself, then its shadow (rank 2 of a job of two workers)
        restored = _restored(reporter, entry, 0, shadow)
        torch.manual_seed(999)
        restored.restore_rng()
        assert torch.equal(torch.rand(4), after), f"shadow {shadow}: not the worker's generators"


def test_a_shadow_writes_no_checkpoint(tmp_path):
    torch.set_num_threads(1)
    reporter, entry, _ = _worker_0s_checkpoint(tmp_path)
    restored = _restored(reporter, entry, 0, 2)
    assert restored.save(epoch=2, step=16) == 1  # numbered as the worker's next, but nothing written
    restored.wait()
    assert len(reporter.commits) == 1
    worker = _restored(reporter, entry, 0, None)
    worker.save(epoch=2, step=16)
    worker.wait()
    assert [c.n for c in reporter.commits] == [0, 1]
