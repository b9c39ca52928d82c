"""The parity harness itself, in process: its one-process reference is one process on the
global batch where the model allows (no batch statistics, no random draws), and tells the
replicas apart where it does not; its comparison sees a difference of one part in 1e5."""
from __future__ import annotations

import pytest
import torch

from parity import harness, zoo
from parity.harness import MODES


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


@pytest.mark.parametrize("name", ["mlp", "residual", "sequential", "unsharded"])
def test_two_replicas_equal_one_process_on_the_global_batch(name):
    case = zoo.case(name)
    two, one = harness.reference(case, MODES["DDP"]), harness.reference(case, MODES["DDP"], replicas=1)
    assert harness.compare(two, one) <= harness.TOLERANCE
    assert harness.compare(one, case.model().state_dict()) > 0.1  # and it trained


@pytest.mark.parametrize("name", ["dropout", "batchnorm", "augment"])
def test_replicas_draw_and_normalise_on_their_own(name):
    """Each replica's generator and batch statistics are its own: not one process's at 2b."""
    case = zoo.case(name)
    two, one = harness.reference(case, MODES["DDP"]), harness.reference(case, MODES["DDP"], replicas=1)
    assert harness.compare(two, one) > 100 * harness.TOLERANCE


def test_the_reference_is_the_same_on_every_call_and_leaves_the_callers_generator():
    torch.manual_seed(5)
    before = torch.get_rng_state()
    case = zoo.case("dropout")
    assert harness.compare(harness.reference(case, MODES["DDP"]), harness.reference(case, MODES["DDP"])) == 0.0
    assert torch.equal(torch.get_rng_state(), before)


def test_compare_is_relative_to_each_tensors_scale_and_names_a_mismatch():
    want = {"w": torch.tensor([100.0, 0.001]), "b": torch.tensor([1.0])}
    assert harness.compare({"w": torch.tensor([100.0, 0.002]), "b": torch.tensor([1.0])}, want) == pytest.approx(1e-5)
    assert harness.compare({"w": want["w"], "b": torch.tensor([1.0 + 2e-5])}, want) == pytest.approx(2e-5, rel=1e-2)
    with pytest.raises(AssertionError, match="only in one process"):
        harness.compare({"w": want["w"]}, want)
