"""Checkpoint staging (gpu_client/rank/staging.py): what a checkpoint holds is the state at the moment
training was let go, whatever training does to its tensors after; the snapshot is freed once
copied to the host. The same on a GPU: test/gpu_staging.py, run by hand on a GPU machine."""
from collections import OrderedDict

import torch

from gpu_client.rank.staging import Staging


def _state(device):
    weight = torch.arange(12, dtype=torch.float32, device=device).reshape(3, 4)
    model = OrderedDict(w=weight, tied=weight, b=torch.ones(4, dtype=torch.bfloat16, device=device))
    return {"model": model, "optimizer": {"state": {0: {"step": torch.tensor(3.0)}},
                                          "param_groups": [{"lr": 0.1, "params": [0]}]}}


def _train_on(state):
    """What the next steps do to a state, in place: every tensor and the learning rate change."""
    state["model"]["w"].add_(100)
    state["model"]["b"].mul_(7)
    state["optimizer"]["state"][0]["step"].add_(1)
    state["optimizer"]["param_groups"][0]["lr"] = 0.5


def _check(tree, device_before):
    assert torch.equal(tree["model"]["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert tree["model"]["tied"] is tree["model"]["w"], "a tied weight is copied once"
    assert torch.equal(tree["model"]["b"], torch.ones(4, dtype=torch.bfloat16))
    assert tree["optimizer"]["state"][0]["step"].item() == 3.0
    assert tree["optimizer"]["param_groups"][0]["lr"] == 0.1
    assert isinstance(tree["model"], OrderedDict)
    assert all(t.device.type == "cpu" for t in (tree["model"]["w"], tree["model"]["b"]))
    assert device_before["model"]["w"][0, 0].item() == 100.0  # training went on


def test_a_staged_tree_is_the_state_when_it_was_staged_not_after_training_went_on():
    staging = Staging()
    state = _state("cpu")
    host = staging.stage_tree(state)
    _train_on(state)
    _check(host(), state)


def test_the_host_blocks_are_reused_from_one_checkpoint_to_the_next():
    staging = Staging()
    state = _state("cpu")
    first = staging.stage_tree(state)()
    blocks = {dtype: b.data_ptr() for dtype, b in staging._blocks.items()}
    second = staging.stage_tree(state)()
    assert {dtype: b.data_ptr() for dtype, b in staging._blocks.items()} == blocks
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()


def test_a_snapshot_is_freed_once_copied_to_the_host(monkeypatch):
    """The snapshot path, on the CPU (as on a GPU with room for it): training goes on past the
    snapshot, and once the background copy is done nothing holds the snapshot any more (on a
    GPU it is device memory the next steps want back)."""
    import gc
    import weakref
    monkeypatch.setattr(Staging, "_room_for_snapshot", staticmethod(lambda tensors: True))
    taken, stage = [], Staging._stage

    def watched(self, tensors):
        staged, finish = stage(self, tensors)
        taken.extend(weakref.ref(t) for t in staged)
        return staged, finish
    monkeypatch.setattr(Staging, "_stage", watched)
    state = _state("cpu")
    host = Staging().stage_tree(state)
    gc.collect()
    assert taken and all(ref() is not None for ref in taken), "the snapshot is held for the background"
    _train_on(state)
    tree = host()
    _check(tree, state)
    gc.collect()
    assert all(ref() is None for ref in taken), "the snapshot outlived the copy"
