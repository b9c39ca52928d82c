"""Every mode trains what one process would (issue 30, item 1): each zoo model (``zoo.py``)
trained as a zwdx job over gloo on CPU slots and in one process (``harness.py`` says what that
means per mode), its returned weights equal within ``harness.TOLERANCE`` (relative).

CI runs every zoo model under DDP and each other mode with the models that exercise it; the full
matrix (every mode x every model it applies to) runs with ``ZWDX_PARITY_FULL=1`` or ``python
test/parity/run.py``. One pool for the module: a server and two GPU clients of two CPU slots
each (TP's group of 2 on one, FSDP+TP's dp 2 x tp 2 over both)."""
from __future__ import annotations

import os

import pytest
import torch

import needs
from gpu_pool import GpuPool
from parity import harness, zoo
from parity.harness import MODES

pytestmark = pytest.mark.slow  # a server and GPU-client processes

FULL = os.environ.get("ZWDX_PARITY_FULL", "") not in ("", "0")

#: mode -> the cases CI runs it with (the full matrix: every case the mode supports). Every zoo
#: model runs under DDP or FSDP once; each other mode with a model that exercises it.
CI = {"DDP": ["mlp", "unsharded", "dropout", "sequential", "augment"],
      "FSDP": ["tied_lm", "batchnorm", "residual"],  # units around tied weights; per-rank buffers
      "TP": ["residual"],                        # the derived plan over MLP pairs
      "FSDP+TP": ["tied_lm"],                    # attention, tied embeddings, dp 2 x tp 2
      "LoRA": ["hf_gpt2"],                       # the Hugging Face model (the adapter's weights)
      "LoRA-FSDP": [],
      "mixed": ["sequential"]}


def matrix() -> list:
    params = []
    for mode in MODES.values():
        names = [c.name for c in zoo.CASES if harness.supports(c, mode)] if FULL else CI[mode.name]
        params += [pytest.param(mode.name, name, id=f"{mode.name}-{name}") for name in names]
    return params


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    pool = GpuPool(str(tmp_path_factory.mktemp("parity")), clients=())
    try:
        pool.start_all(("a", "b"), extra=["--cpu-slots", "2"])
    except BaseException:
        pool.stop()
        raise
    yield pool
    pool.stop()


@pytest.mark.parametrize("mode_name, case_name", matrix())
def test_the_job_returns_the_weights_one_process_trains(pool, mode_name, case_name):
    case, mode = zoo.case(case_name), MODES[mode_name]
    for package in case.needs + (("peft",) if mode.lora else ()):
        needs.module(package, f"pip install {package} (pip install -e '.[test]')")
    torch.set_num_threads(1)
    got, result = harness.run_job(pool.sdk, case, mode)
    want = harness.reference(case, mode)
    start = harness.returned_state(harness.initial_model(case, mode), mode)
    assert harness.compare(want, start) > 100 * mode.tolerance  # it trained: the weights moved
    diff = harness.compare(got, want)
    assert diff <= mode.tolerance, (f"{mode_name} {case_name}: relative difference {diff:.3g} (worst: "
                                    f"{harness.worst_tensor(got, want)}), job {result['job_id']}")
