"""The rank's Checkpointer where test_checkpointer.py left mutants alive (issue 31 §3): the temporary
folders a save or a restore leaves (none), the background thread and its log lines, the commit's
retry schedule on a fake clock, track's names and refusals, a model or optimizer that is absent,
the world a restore requires, GPU generators through a fake CUDA device, and an FSDP save that holds
the values of the moment it was called."""
from __future__ import annotations

import logging
import os
import tempfile
import threading
import types

import pytest
import requests
import torch
from test_checkpointer import CPU, Counter, FolderReporter, _fresh, _same, _trained

from gpu_client.rank import checkpoint as ckpt
from gpu_client.rank import shards
from gpu_client.rank.checkpoint import Checkpointer, plain_load, rng_states, set_rng_states
from zwdx.protocol.job import CheckpointEntry
from zwdx.protocol.vocab import CheckpointFormat, Parallelism


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """The folder tempfile hands out, to see what a save or restore leaves behind."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def _ours(folder) -> list[str]:
    return [name for name in os.listdir(folder) if name.startswith("zwdx-")]  # torch keeps its own there


class Watching(FolderReporter):
    """A FolderReporter that notes where each upload comes from and in which thread, and where
    each download goes."""

    def __init__(self, root):
        super().__init__(root)
        self.uploads, self.downloads = [], []

    def upload(self, path, file_path):
        me = threading.current_thread()
        self.uploads.append((path, os.path.basename(os.path.dirname(file_path)), me.name, me.daemon))
        return super().upload(path, file_path)

    def download(self, path, file_path):
        self.downloads.append((path, os.path.basename(os.path.dirname(file_path))))
        return super().download(path, file_path)


def test_save_and_restore_leave_no_folder_and_the_work_runs_in_a_named_daemon_thread(tmp_path, scratch, caplog):
    torch.set_num_threads(1)
    caplog.set_level(logging.INFO, logger="gpu_client.rank.checkpoint")
    reporter = Watching(tmp_path / "store")
    model, opt = _trained()
    saver = Checkpointer(reporter, model, opt, Parallelism.DDP, 0, 1, CPU)
    assert (saver.commit_timeout, saver.stall, saver.next_n) == (600.0, 0.0, 0)
    assert [saver.save(5, 7), saver.save(6, 8), saver.save(7, 9)] == [0, 1, 2] and saver.next_n == 3
    saver.wait()
    assert 0.0 < saver.stall < 60
    assert _ours(scratch) == []
    assert {(p.split("/")[1], folder.rsplit("-", 1)[0], name, daemon) for p, folder, name, daemon in reporter.uploads} \
        == {(str(n), f"zwdx-ckpt-{n}-r0", f"zwdx-checkpoint-{n}", True) for n in range(3)}
    assert [c.epoch_complete for c in reporter.commits] == [True] * 3  # save's default
    waited, committed = (float(x) for x in reporter.lines[0].split("waited ")[1].split(" s to commit")[0]
                         .split(" s for it, "))
    assert 0.0 <= waited < 60 and 0.0 <= committed < 60
    assert [r.getMessage() for r in caplog.records] == [
        f"rank 0: checkpoint {n} saved (epoch {e}, step {s})" for n, e, s in [(0, 5, 7), (1, 6, 8), (2, 7, 9)]]

    caplog.clear()
    resumed = Checkpointer(reporter, *_fresh(), Parallelism.DDP, 0, 1, CPU, latest=reporter.commits[2])
    resumed.restore()
    assert _ours(scratch) == []
    assert {folder.rsplit("-", 1)[0] for _, folder in reporter.downloads} == {"zwdx-restore-2-r0"}
    assert [r.getMessage() for r in caplog.records] == ["rank 0: restored checkpoint 2 (epoch 7, step 9)"]


def test_a_save_that_fails_while_staging_leaves_no_folder(tmp_path, scratch):
    class Opaque(Counter):
        def state_dict(self):
            return {"fn": print}
    saver = Checkpointer(FolderReporter(tmp_path / "store"), *_trained(), Parallelism.DDP, 0, 1, CPU)
    saver.track(Opaque(), "opaque")
    with pytest.raises(TypeError, match="reporter.track"):
        saver.save(0, 1)
    assert _ours(scratch) == []


class FakeTime:
    """``time`` for the checkpoint module: a clock that moves only when slept on."""

    def __init__(self):
        self.now, self.sleeps = 0.0, []

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


def _missing():
    resp = requests.Response()
    resp.status_code, resp._content = 400, b'{"error": {"field": "files", "missing": ["rng-1.pt"]}}'
    return requests.HTTPError("400", response=resp)


def test_the_commit_retries_50_ms_apart_doubling_up_to_a_second_until_the_timeout_inclusive(tmp_path, monkeypatch):
    clock = FakeTime()
    monkeypatch.setattr(ckpt, "time", clock)

    class Missing(FolderReporter):
        def commit_checkpoint(self, n, files, **fields):
            raise _missing()

    saver = Checkpointer(Missing(tmp_path), *_trained(), Parallelism.DDP, 0, 1, CPU, commit_timeout=3.0)
    with pytest.raises(requests.HTTPError):
        saver._commit(0, ["state.pt"])
    assert clock.sleeps == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0])

    clock.now, clock.sleeps = 0.0, []
    saver.commit_timeout = 0.05 + 0.1  # the clock reads exactly the deadline after two sleeps: one more try
    with pytest.raises(requests.HTTPError):
        saver._commit(0, ["state.pt"])
    assert clock.sleeps == pytest.approx([0.05, 0.1, 0.2])

    class Late(FolderReporter):
        def __init__(self, root):
            super().__init__(root)
            self.tries = 0

        def commit_checkpoint(self, n, files, **fields):
            self.tries += 1
            if self.tries < 3:
                raise _missing()
            return {"n": n}

    clock.now, clock.sleeps = 0.0, []
    saver.reporter = Late(tmp_path)
    assert saver._commit(0, ["state.pt"]) == {"n": 0} and clock.sleeps == pytest.approx([0.05, 0.1])


def test_track_names_each_object_by_its_type_and_order_and_refuses_one_that_cannot_load(tmp_path):
    saver = Checkpointer(FolderReporter(tmp_path), *_trained(), Parallelism.DDP, 0, 1, CPU)
    saver.track(Counter())
    saver.track(Counter(), 3)
    saver.track(Counter())
    assert list(saver.tracked) == ["Counter-0", "3", "Counter-2"]

    class SaveOnly:
        def state_dict(self):
            return {}

    class LoadOnly:
        def load_state_dict(self, state):
            pass
    for half in (SaveOnly(), LoadOnly()):
        with pytest.raises(TypeError, match=f"got {type(half).__name__}$"):
            saver.track(half)
    assert list(saver.tracked) == ["Counter-0", "3", "Counter-2"]


def test_a_fresh_job_has_no_generators_to_restore(tmp_path):
    saver = Checkpointer(FolderReporter(tmp_path), *_fresh(), Parallelism.DDP, 0, 1, CPU)
    torch.manual_seed(5)
    saver.restore_rng()  # nothing restored: a no-op
    expected = torch.rand(2)
    torch.manual_seed(5)
    assert saver.rng_state is None and torch.equal(torch.rand(2), expected)


def test_a_model_without_an_optimizer_saves_and_restores_and_ignores_a_checkpoints_optimizer(tmp_path):
    reporter = FolderReporter(tmp_path)
    model, opt = _trained()
    bare = Checkpointer(reporter, model, None, Parallelism.DDP, 0, 1, CPU)
    bare.save(0, 1)
    bare.wait()
    assert plain_load(os.path.join(reporter.root, reporter.commits[0].files["state.pt"]))["optimizer"] is None
    with_opt = Checkpointer(reporter, model, opt, Parallelism.DDP, 0, 1, CPU)
    with_opt.save(0, 2)
    with_opt.wait()
    inner, _ = _fresh()
    Checkpointer(reporter, inner, None, Parallelism.DDP, 0, 1, CPU, latest=reporter.commits[1]).restore()
    assert _same(inner.state_dict(), model.state_dict())


class Wrapper(torch.nn.Module):  # as DistributedDataParallel holds the user's module
    def __init__(self, module):
        super().__init__()
        self.module = module


def test_ddp_writes_the_inner_modules_keys_and_a_pipeline_stage_its_own_even_with_a_module_attribute(tmp_path):
    reporter = FolderReporter(tmp_path)
    model, opt = _trained()
    for saver in (Checkpointer(reporter, Wrapper(model), opt, Parallelism.DDP, 0, 1, CPU),
                  Checkpointer(FolderReporter(tmp_path / "p"), Wrapper(model), opt, Parallelism.PIPELINE, 0, 1, CPU)):
        saver.save(0, 1)
        saver.wait()
    ddp = plain_load(str(tmp_path / "checkpoints" / "0" / "state.pt"))["model"]
    assert sorted(ddp) == sorted(model.state_dict())  # no "module." prefix
    staged = plain_load(str(tmp_path / "p" / "checkpoints" / "0" / "stage-0.pt"))["model"]
    assert sorted(staged) == sorted(f"module.{k}" for k in model.state_dict())  # the stage whole


def _committed(tmp_path, **kw) -> tuple[FolderReporter, CheckpointEntry]:
    reporter = FolderReporter(tmp_path)
    saver = Checkpointer(reporter, *_trained(), Parallelism.DDP, 0, 1, CPU)
    saver.track(Counter(3), "c")
    saver.save(0, 1)
    saver.wait()
    return reporter, reporter.commits[0].model_copy(update=kw)


def test_a_ddp_checkpoint_of_a_larger_world_serves_a_group_of_one(tmp_path):
    """A DILOCO worker (a world of one) goes on from its job's checkpoint, which rank 0 wrote in a
    world of two: rank 1's generators are not needed."""
    reporter, entry = _committed(tmp_path, world_size=2)
    model, opt = _fresh()
    resumed = Checkpointer(reporter, model, opt, Parallelism.DDP, 0, 1, CPU, latest=entry)
    resumed.restore()
    assert resumed.rng_state is not None and resumed.tracked_state == {"c": {"value": 3}}
    with pytest.raises(ValueError, match="checkpoint 0 lacks rng-1.pt: it holds"):
        Checkpointer(reporter, model, opt, Parallelism.DDP, 0, 2, CPU, latest=entry).restore()


def test_a_checkpoint_without_a_world_size_or_several_files_is_refused_naming_them(tmp_path):
    reporter, entry = _committed(tmp_path)
    holds = ckpt.files_of.describe(CheckpointFormat.TORCH, 1)
    for world in (None, 0):
        with pytest.raises(ValueError) as err:
            Checkpointer(reporter, *_fresh(), Parallelism.DDP, 0, 1, CPU,
                         latest=entry.model_copy(update={"world_size": world})).restore()
        assert str(err.value) == f"checkpoint 0 lacks its world size: it holds {holds}"
    with pytest.raises(ValueError, match="^checkpoint 0 lacks rng-0.pt, state.pt: it holds"):
        Checkpointer(reporter, *_fresh(), Parallelism.DDP, 0, 1, CPU,
                     latest=entry.model_copy(update={"files": {}})).restore()
    fsdp = entry.model_copy(update={"format": CheckpointFormat.SHARDS, "world_size": 2,
                                    "files": dict.fromkeys(shards.file_names(0), "x")})
    with pytest.raises(ValueError, match="^checkpoint 0 lacks " + ", ".join(sorted(shards.file_names(1))) + ": it"):
        Checkpointer(reporter, *_fresh(), Parallelism.FSDP, 0, 1, CPU, latest=fsdp).restore()


@pytest.mark.parametrize("extra", [[1, 2], {"other": {}}, {"tracked": None}])
def test_an_extra_file_that_is_not_the_tracked_state_is_refused_not_taken_for_none(tmp_path, extra):
    """zwdx writes extra.pt only with tracked objects, as {"tracked": {name: state}}: anything else
    is not its file, and the tracked objects would silently start afresh."""
    reporter, entry = _committed(tmp_path)
    torch.save(extra, os.path.join(reporter.root, entry.files["extra.pt"]))
    with pytest.raises(ValueError, match="checkpoint 0: extra.pt is not the tracked objects' state"):
        Checkpointer(reporter, *_fresh(), Parallelism.DDP, 0, 1, CPU, latest=entry).restore()


def test_numpys_generator_keys_are_saved_as_int64(tmp_path):
    assert rng_states(CPU)["numpy"]["keys"].dtype == torch.int64


def test_a_ranks_gpu_generator_is_saved_and_put_back_on_its_own_device(monkeypatch):
    gpu = types.SimpleNamespace(type="cuda", index=1)
    got, put = torch.tensor([1, 2], dtype=torch.uint8), []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: got if device is gpu else None)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: put.append((state, device)))
    state = rng_states(gpu)
    assert state["cuda"] is got and "cuda" not in rng_states(CPU)
    set_rng_states(state, gpu)
    assert put == [(got, gpu)]
    set_rng_states(state, CPU)  # a CPU rank leaves the GPU's alone
    set_rng_states({k: v for k, v in state.items() if k != "cuda"}, gpu)  # a checkpoint without it too
    assert put == [(got, gpu)]


def _sharded(seed, steps=2):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    return model, opt


def _full(model) -> dict:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def test_an_fsdp_checkpoint_holds_the_values_of_its_save_not_those_training_wrote_after(tmp_path, group_of_one,
                                                                                      monkeypatch):
    torch.set_num_threads(1)
    reporter = FolderReporter(tmp_path)
    model, opt = _sharded(0)
    at_save, trained_on = _full(model), threading.Event()
    write = shards.write

    def held(encoded, folder):  # the background write starts only once training went on
        trained_on.wait(30)
        return write(encoded, folder)
    monkeypatch.setattr(shards, "write", held)
    saver = Checkpointer(reporter, model, opt, Parallelism.FSDP, 0, 1, CPU)
    saver.save(0, 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    trained_on.set()
    saver.wait()
    model2, opt2 = _sharded(1, steps=0)
    Checkpointer(reporter, model2, opt2, Parallelism.FSDP, 0, 1, CPU, latest=reporter.commits[0]).restore()
    assert _same(_full(model2), at_save)


def _fsdp_checkpoint_0(tmp_path):
    """A one-rank FSDP model's checkpoint 0, committed: the reporter holding it, the model, its
    optimizer and the Checkpointer that saved it."""
    torch.set_num_threads(1)
    reporter = FolderReporter(tmp_path)
    model, opt = _sharded(0)
    saver = Checkpointer(reporter, model, opt, Parallelism.FSDP, 0, 1, CPU)
    saver.save(0, 1)
    saver.wait()
    return reporter, model, opt, saver


def test_fsdp_without_tracked_objects_or_an_optimizer_restores_and_refuses_an_untrackable_state(tmp_path,
                                                                                              group_of_one):
    reporter, model, opt, saver = _fsdp_checkpoint_0(tmp_path)
    model2, _ = _sharded(1, steps=0)
    resumed = Checkpointer(reporter, model2, None, Parallelism.FSDP, 0, 1, CPU, latest=reporter.commits[0])
    resumed.restore()
    assert _same(_full(model2), _full(model)) and resumed.tracked_state == {}

    class Opaque(Counter):
        def state_dict(self):
            return {"fn": print}
    saver.track(Opaque(), "opaque")
    with pytest.raises(TypeError, match=r"^reporter.track: a tracked object's state_dict\(\) holds .*: "
                                        r"tracked\['opaque'\]\['fn'\] is a builtin_function_or_method"):
        saver.save(0, 2)


def test_fsdp_rank_1_writes_no_tracked_state_and_reads_rank_0s(tmp_path, group_of_one):
    """Two ranks' files of one checkpoint, written here one after the other (each a one-rank
    group, so each holds the whole model): rank 1 keeps its tracked objects out of its own and
    reads them back from rank 0's."""
    torch.set_num_threads(1)
    reporter = FolderReporter(tmp_path)
    model, opt = _sharded(0)
    for rank in (1, 0):
        saver = Checkpointer(reporter, model, opt, Parallelism.FSDP, rank, 2, CPU)
        saver.track(Counter(10 + rank), "counter")
        saver.save(0, 1)
        saver.wait()
    index = shards.read_index(str(tmp_path / "checkpoints" / "0" / shards.file_names(1)[1]), 1, 2)
    assert sorted(k for k, _ in index["tree"]["dict"]) == ["model", "optim", "rng"]
    entry = reporter.commits[0].model_copy(update={"world_size": 2})
    resumed = Checkpointer(reporter, *_sharded(1, steps=0), Parallelism.FSDP, 1, 2, CPU, latest=entry)
    resumed.restore()
    assert resumed.track(Counter(), "counter").value == 10 and resumed.rng_state is not None


@pytest.mark.parametrize("part, value, message", [
    ("model", [1, 2], "checkpoint 0 holds no model and optimizer state"),
    ("tracked", [1], "checkpoint 0: rank 0's tracked state is no dict"),
    ("rng", [1], "checkpoint 0: a rank's generators are not the state zwdx saves"),
])
def test_an_fsdp_checkpoint_that_is_not_what_ranks_write_is_refused_naming_it(tmp_path, group_of_one, part, value,
                                                                             message):
    reporter, model, opt, saver = _fsdp_checkpoint_0(tmp_path)
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_sd, optim_sd = get_state_dict(model, opt)
    forged = {"model": model_sd, "optim": optim_sd, "rng": rng_states(CPU), part: value}
    shards.save(forged, str(tmp_path / "checkpoints" / "0"), 0, 1)
    with pytest.raises(ValueError) as err:
        Checkpointer(reporter, *_sharded(1, steps=0), Parallelism.FSDP, 0, 1, CPU, latest=reporter.commits[0]).restore()
    assert str(err.value) == message
