"""Checkpoint staging on a GPU (gpu_client/rank/staging.py), on a GPU machine (the suite collects
it, and deselects it where torch sees no GPU; see needs.leave_out_gpu_tests):

    python -m pytest -m gpu             # with gpu_e2e.py's checks
    python -m pytest test/gpu_staging.py

(On a host whose Python already has pytest plugins that do not fit the pytest you bring, e.g.
a newer pytest-timeout: ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``.)

The snapshot is taken on the device without waiting and freed once copied to pinned host
blocks; a GPU without room for it gets its host copies while training waits.
"""
import pytest
import torch

import needs
from gpu_client.rank.staging import Staging
from test_staging import _check, _state, _train_on

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def a_gpu():
    needs.cuda()  # asked for on a machine without one: a skip, or a failure under CI


def test_on_a_gpu_the_snapshot_is_taken_without_waiting_and_freed_once_copied():
    staging = Staging()
    state = _state("cuda")
    big = torch.zeros(64 << 20, device="cuda")  # 256 MB: the snapshot's memory shows
    state["model"]["big"] = big
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    host = staging.stage_tree(state)
    assert torch.cuda.memory_allocated() >= before + big.numel() * 4, "the snapshot is on the device"
    _train_on(state)
    big.add_(1)
    tree = host()
    assert torch.cuda.memory_allocated() == before, "the snapshot is freed once copied"
    _check(tree, state)
    assert tree["model"]["big"].sum().item() == 0.0
    assert tree["model"]["w"].is_pinned()


def test_a_gpu_without_room_for_a_snapshot_gets_its_host_copies_while_training_waits():
    free, _ = torch.cuda.mem_get_info()
    filler = torch.empty(max(free - (256 << 20), 0), dtype=torch.uint8, device="cuda")  # leaves < the margin
    try:
        staging = Staging()
        state = _state("cuda")
        before = torch.cuda.memory_allocated()
        host = staging.stage_tree(state)
        assert torch.cuda.memory_allocated() == before, "no snapshot"
        _train_on(state)
        _check(host(), state)
    finally:
        del filler
