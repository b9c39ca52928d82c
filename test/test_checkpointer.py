"""The rank's Checkpointer in-process (gpu_client/rank/checkpoint.py), against a reporter that
keeps uploads in a folder: what a DDP or PIPELINE checkpoint holds and gives back, where a
resumed job goes on from, and what it refuses. The slow lane runs it through real ranks and a
server; these reach it where a mutation tool can credit them (docs/testing.md)."""
from __future__ import annotations

import os
import shutil

import pytest
import requests
import torch

from gpu_client.rank.checkpoint import Checkpointer
from zwdx.protocol.job import CheckpointEntry
from zwdx.protocol.vocab import CheckpointFormat, Parallelism

CPU = torch.device("cpu")


class FolderReporter:
    """The reporter's checkpoint calls, over a folder; ``missing_first`` commits are refused as
    the server refuses one whose files are not all up yet."""

    def __init__(self, root, missing_first: int = 0, fail_upload: bool = False):
        self.root, self.commits, self.lines = str(root), [], []
        self.missing_first, self.fail_upload = missing_first, fail_upload

    def upload(self, path, file_path):
        if self.fail_upload:
            raise requests.ConnectionError("the server went away")
        os.makedirs(os.path.dirname(os.path.join(self.root, path)), exist_ok=True)
        shutil.copy(file_path, os.path.join(self.root, path))
        return {"id": path}

    def download(self, path, file_path):
        shutil.copy(os.path.join(self.root, path), file_path)

    def commit_checkpoint(self, n, files, **fields):
        if self.missing_first:
            self.missing_first -= 1
            resp = requests.Response()
            resp.status_code, resp._content = 400, b'{"error": {"field": "files", "missing": ["rng-1.pt"]}}'
            raise requests.HTTPError("400", response=resp)
        # the server adds the job's world size (a rank does not say it)
        self.commits.append(CheckpointEntry(n=n, world_size=1, files={f: f"checkpoints/{n}/{f}" for f in files},
                                            **fields))

    def log(self, text):
        self.lines.append(text)


class Counter:
    """A tracked object of the user's."""

    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def _trained(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    return model, opt


def _fresh(seed=1):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("parallelism", [Parallelism.DDP, Parallelism.PIPELINE])
def test_a_checkpoint_gives_back_the_model_the_optimizer_the_tracked_state_and_the_generators(tmp_path, parallelism):
    torch.set_num_threads(1)
    reporter = FolderReporter(tmp_path)
    model, opt = _trained()
    saver = Checkpointer(reporter, model, opt, parallelism, 0, 1, CPU)
    counter = saver.track(Counter(7), "counter")
    assert saver.save(epoch=3, step=41, epoch_complete=False) == 0
    after_save = torch.rand(3)  # what the generator gives next, from the state saved
    counter.value = 99  # changed after the save: the checkpoint holds 7
    saver.wait()
    [entry] = reporter.commits
    assert (entry.n, entry.epoch, entry.step, entry.epoch_complete) == (0, 3, 41, False)
    assert entry.format == (CheckpointFormat.STAGES if parallelism == Parallelism.PIPELINE else CheckpointFormat.TORCH)

    model2, opt2 = _fresh()
    resumed = Checkpointer(reporter, model2, opt2, parallelism, 0, 1, CPU, latest=entry)
    assert resumed.next_n == 1 and resumed.start_epoch == 3  # the epoch was not complete: it goes on in it
    resumed.restore()
    assert _same(model2.state_dict(), model.state_dict())
    momentum = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    assert all(torch.equal(opt2.state[p]["momentum_buffer"], m) for p, m in zip(model2.parameters(), momentum))
    assert resumed.track(Counter(), "counter").value == 7
    torch.manual_seed(12345)
    resumed.restore_rng()
    assert torch.equal(torch.rand(3), after_save)


def test_a_complete_epoch_goes_on_at_the_next_and_a_fresh_job_at_zero(tmp_path):
    model, opt = _fresh()
    fresh = Checkpointer(FolderReporter(tmp_path), model, opt, Parallelism.DDP, 0, 1, CPU)
    assert (fresh.start_epoch, fresh.next_n, fresh.resume) == (0, 0, None)
    done = CheckpointEntry(n=4, epoch=2, step=9, format=CheckpointFormat.TORCH, epoch_complete=True)
    resumed = Checkpointer(FolderReporter(tmp_path), model, opt, Parallelism.DDP, 0, 1, CPU, latest=done)
    assert (resumed.start_epoch, resumed.next_n) == (3, 5)
    assert resumed.resume == {"epoch": 2, "step": 9, "epoch_complete": True, "checkpoint": 4}


def test_a_checkpoint_of_another_format_or_lacking_a_file_is_refused_before_anything_is_read(tmp_path):
    model, opt = _fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    shards = CheckpointEntry(n=2, format=CheckpointFormat.SHARDS, world_size=1, files={"x": "y"})
    with pytest.raises(ValueError, match="'shards' format; a DDP job reads only 'torch'"):
        Checkpointer(FolderReporter(tmp_path), model, opt, Parallelism.DDP, 0, 1, CPU, latest=shards).restore()
    partial = CheckpointEntry(n=2, format=CheckpointFormat.TORCH, world_size=1, files={"state.pt": "a"})
    with pytest.raises(ValueError, match="checkpoint 2 lacks rng-0.pt"):
        Checkpointer(FolderReporter(tmp_path), model, opt, Parallelism.DDP, 0, 1, CPU, latest=partial).restore()
    assert _same(model.state_dict(), before)


def test_rank_0_waits_out_files_not_up_yet_and_a_failed_upload_is_raised_at_the_next_wait(tmp_path):
    model, opt = _trained()
    reporter = FolderReporter(tmp_path, missing_first=2)
    saver = Checkpointer(reporter, model, opt, Parallelism.DDP, 0, 1, CPU)
    saver.save(0, 1)
    saver.wait()
    assert [c.n for c in reporter.commits] == [0]  # committed on the third try
    failing = Checkpointer(FolderReporter(tmp_path / "f", fail_upload=True), model, opt, Parallelism.DDP, 0, 1, CPU)
    assert failing.save(0, 1) == 0
    with pytest.raises(RuntimeError, match="checkpoint upload failed: ConnectionError: the server went away"):
        failing.wait()
    failing.wait()  # raised once


def test_other_ranks_upload_without_committing_and_a_rank_outside_the_world_skips(tmp_path):
    model, opt = _trained()
    reporter = FolderReporter(tmp_path)
    rank1 = Checkpointer(reporter, model, opt, Parallelism.DDP, 1, 2, CPU)
    rank1.save(0, 1)
    rank1.wait()
    assert reporter.commits == [] and os.listdir(tmp_path / "checkpoints" / "0") == ["rng-1.pt"]
    outside = Checkpointer(FolderReporter(tmp_path / "o"), model, opt, Parallelism.DDP, 1, 1, CPU)
    assert outside.save(0, 1) == 0 and outside.next_n == 1
    outside.wait()
    assert not (tmp_path / "o").exists()  # nothing uploaded


def test_track_refuses_what_it_cannot_keep_and_names_a_state_the_checkpoint_lacks(tmp_path):
    model, opt = _trained()
    reporter = FolderReporter(tmp_path)
    saver = Checkpointer(reporter, model, opt, Parallelism.DDP, 0, 1, CPU)
    with pytest.raises(TypeError, match="needs an object with state_dict"):
        saver.track(object())
    saver.track(Counter(), "c")
    with pytest.raises(ValueError, match="'c' is tracked already"):
        saver.track(Counter(), "c")
    assert saver.track(Counter()).value == 0  # named by type and order: Counter-1

    class Opaque(Counter):
        def state_dict(self):
            return {"fn": print}
    saver.track(Opaque(), "opaque")
    with pytest.raises(TypeError, match="reporter.track: a tracked object's state_dict"):
        saver.save(0, 1)

    entry = CheckpointEntry(n=0, format=CheckpointFormat.TORCH, world_size=1)
    resumed = Checkpointer(reporter, model, opt, Parallelism.DDP, 0, 1, CPU, latest=entry)
    resumed.track(Counter(5), "new")
    assert reporter.lines == ["checkpoint 0 holds no state for 'new': it starts afresh"]
