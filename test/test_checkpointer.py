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


def test_every_generator_comes_back_python_numpy_and_torch(tmp_path):
    import random

    import numpy as np
    reporter = FolderReporter(tmp_path)
    model, opt = _trained()
    np.random.seed(3)
    np.random.randn()  # numpy now holds a cached gaussian, which the state keeps too
    saver = Checkpointer(reporter, model, opt, Parallelism.DDP, 0, 1, CPU)
    saver.save(0, 1)
    expected = (random.random(), np.random.randn(), np.random.rand(), torch.rand(2))
    saver.wait()
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    resumed = Checkpointer(reporter, *_fresh(), Parallelism.DDP, 0, 1, CPU, latest=reporter.commits[0])
    resumed.restore()
    resumed.restore_rng()
    got = (random.random(), np.random.randn(), np.random.rand(), torch.rand(2))
    assert got[:3] == expected[:3] and torch.equal(got[3], expected[3])
    assert reporter.lines and reporter.lines[0].startswith("checkpoint 0 saved (epoch 0, step 1)")


def test_a_commit_refused_for_another_reason_is_raised_at_once_and_missing_files_only_until_the_timeout(tmp_path):
    class Refusing(FolderReporter):
        def __init__(self, root, status, body):
            super().__init__(root)
            self.status, self.body, self.tries = status, body, 0

        def commit_checkpoint(self, n, files, **fields):
            self.tries += 1
            resp = requests.Response()
            resp.status_code, resp._content = self.status, self.body
            raise requests.HTTPError(str(self.status), response=resp)

    model, opt = _trained()
    for status, body in [(400, b'{"error": {"field": "name", "missing": ["x"]}}'),
                         (400, b'{"error": {"field": "files", "missing": []}}'),
                         (409, b'{"error": {"field": "files", "missing": ["x"]}}'),
                         (400, b'not json'), (400, b'{"other": 1}')]:
        reporter = Refusing(tmp_path / str(len(body)) / str(status), status, body)
        saver = Checkpointer(reporter, model, opt, Parallelism.DDP, 0, 1, CPU)
        saver.save(0, 1)
        with pytest.raises(RuntimeError, match=f"HTTPError: {status}"):
            saver.wait()
        assert reporter.tries == 1, body
    waiting = Refusing(tmp_path / "w", 400, b'{"error": {"field": "files", "missing": ["rng-1.pt"]}}')
    saver = Checkpointer(waiting, model, opt, Parallelism.DDP, 0, 1, CPU, commit_timeout=0.3)
    saver.save(0, 1)
    with pytest.raises(RuntimeError, match="HTTPError: 400"):
        saver.wait()
    assert 2 <= waiting.tries <= 8  # tried again (50, 100, 200 ms apart) until the timeout


def _forge(reporter, name: str, value, files=("state.pt", "rng-0.pt")) -> CheckpointEntry:
    """A committed checkpoint whose ``name`` holds ``value`` (the others as a rank writes them)."""
    model, opt = _trained()
    saver = Checkpointer(reporter, model, opt, Parallelism.DDP, 0, 1, CPU)
    saver.save(0, 1)
    saver.wait()
    entry = reporter.commits[-1]
    torch.save(value, os.path.join(reporter.root, entry.files[name]))
    return entry.model_copy(update={"files": {**entry.files, **{f: f"checkpoints/0/{f}" for f in files}}})


class Kept:
    """A class of the job's code: never loaded from a checkpoint, even where the job allowed it."""


@pytest.mark.parametrize("name, value, message", [
    ("state.pt", {"model": [1, 2]}, "state.pt is not a model and optimizer state"),
    ("state.pt", {"model": {"w": 1.0}, "optimizer": None}, "state.pt is not a model and optimizer state"),
    ("state.pt", {"model": {}, "optimizer": [1]}, "state.pt is not a model and optimizer state"),
    ("state.pt", [torch.zeros(1)], "state.pt is not a model and optimizer state"),
    ("rng-0.pt", {"python": "x", "torch": torch.zeros(1)}, "a rank's generators are not the state zwdx saves"),
    ("rng-0.pt", {"python": (1, 2), "torch": 3}, "a rank's generators are not the state zwdx saves"),
    ("rng-0.pt", [1], "a rank's generators are not the state zwdx saves"),
])
def test_a_file_that_is_not_what_a_rank_writes_is_refused_naming_it(tmp_path, name, value, message):
    entry = _forge(FolderReporter(tmp_path), name, value)
    with pytest.raises(ValueError, match=f"checkpoint 0: {message}"):
        Checkpointer(FolderReporter(tmp_path), *_fresh(), Parallelism.DDP, 0, 1, CPU, latest=entry).restore()


def test_a_tracked_state_that_is_no_dict_is_refused_and_no_global_of_the_jobs_is_ever_loaded(tmp_path):
    reporter = FolderReporter(tmp_path)
    model, opt = _trained()
    saver = Checkpointer(reporter, model, opt, Parallelism.DDP, 0, 1, CPU)
    saver.track(Counter(1), "c")
    saver.save(0, 1)
    saver.wait()
    entry = reporter.commits[-1]
    torch.save({"tracked": [1]}, os.path.join(reporter.root, entry.files["extra.pt"]))
    with pytest.raises(ValueError, match="checkpoint 0: extra.pt is not the tracked objects' state"):
        Checkpointer(reporter, *_fresh(), Parallelism.DDP, 0, 1, CPU, latest=entry).restore()
    torch.save({"tracked": {"c": Kept()}}, os.path.join(reporter.root, entry.files["extra.pt"]))
    torch.serialization.add_safe_globals([Kept])  # the job's code allowed it: the checkpoint still does not
    try:
        with pytest.raises(Exception, match="Kept"):
            Checkpointer(reporter, *_fresh(), Parallelism.DDP, 0, 1, CPU, latest=entry).restore()
        assert Kept in torch.serialization.get_safe_globals()  # given back after the load
    finally:
        torch.serialization.clear_safe_globals()


def test_ddp_saves_the_module_inside_the_wrapper_and_pipeline_ranks_each_their_stage(tmp_path):
    class Wrapper(torch.nn.Module):  # as DistributedDataParallel holds the user's module
        def __init__(self, module):
            super().__init__()
            self.module = module

    reporter = FolderReporter(tmp_path)
    model, opt = _trained()
    saver = Checkpointer(reporter, Wrapper(model), opt, Parallelism.DDP, 0, 1, CPU)
    saver.save(0, 1)
    saver.wait()
    inner, opt2 = _fresh()
    Checkpointer(reporter, Wrapper(inner), opt2, Parallelism.DDP, 0, 1, CPU, latest=reporter.commits[0]).restore()
    assert _same(inner.state_dict(), model.state_dict())  # keys without "module."

    stage1 = Checkpointer(FolderReporter(tmp_path / "p"), model, opt, Parallelism.PIPELINE, 1, 2, CPU)
    stage1.save(1, 2)
    stage1.wait()
    assert sorted(os.listdir(tmp_path / "p" / "checkpoints" / "0")) == ["rng-1.pt", "stage-1.pt"]


def test_fsdp_shards_give_back_the_model_the_optimizer_the_tracked_state_and_the_generators(tmp_path, group_of_one):
    from torch.distributed.fsdp import fully_shard
    reporter = FolderReporter(tmp_path)

    def sharded(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    model, opt = sharded(0)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    saver = Checkpointer(reporter, model, opt, Parallelism.FSDP, 0, 1, CPU)
    saver.track(Counter(4), "counter")
    saver.save(2, 5, epoch_complete=True)
    after_save = torch.rand(2)
    saver.wait()
    [entry] = reporter.commits
    assert entry.format == CheckpointFormat.SHARDS and (entry.epoch, entry.step) == (2, 5)

    model2, opt2 = sharded(1)
    resumed = Checkpointer(reporter, model2, opt2, Parallelism.FSDP, 0, 1, CPU, latest=entry)
    assert resumed.start_epoch == 3
    resumed.restore()
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    assert _same({k: v.full_tensor() for k, v in model2.state_dict().items()}, full)
    steps = [opt.state[p]["exp_avg"].full_tensor() for p in model.parameters()]
    assert all(torch.equal(opt2.state[p]["exp_avg"].full_tensor(), s) for p, s in zip(model2.parameters(), steps))
    assert resumed.track(Counter(), "counter").value == 4
    torch.manual_seed(7)
    resumed.restore_rng()
    assert torch.equal(torch.rand(2), after_save)
