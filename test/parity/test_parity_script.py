"""Parity for script jobs (issue 30 item 1): a torchrun script that knows nothing of zwdx
(``scripts/train_ddp.py``: DDP over gloo, a shuffled DistributedSampler, LayerNorm, dropout from
per-rank seeds, AdamW) run by ``zwdx run --nproc 2`` on two GPU clients writes the weights that
``torchrun --nproc-per-node 2`` writes here, within ``harness.TOLERANCE`` (they come back bit for
bit: the same ranks, environment, seeds and collectives). One pool for the module."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from parity import harness
from procs import ROOT, SLACK
from zwdx.testing import child_env

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "train_ddp.py")
ARGS = ("--epochs", "3")
#: Seconds a 2-rank run may take here, start to end, plus the slack.
RUN_TIME = 180 + SLACK


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    from gpu_pool import GpuPool
    base = tmp_path_factory.mktemp("parity-script")
    pool = GpuPool(str(base))
    pool.token_file = base / "token"
    pool.token_file.write_text(pool.token + "\n")
    yield pool
    pool.stop()


def workdir(folder) -> str:
    os.makedirs(folder)
    shutil.copy(SCRIPT, folder)
    return str(folder)


def zwdx_run(pool, tmp_path) -> dict:
    """``zwdx run --nproc 2`` as a user types it; the weights rank 0 wrote, as they came back."""
    from procs import wait_until
    wait_until(pool.idle, 60, what="the pool's slots free")
    wd = workdir(tmp_path / "zwdx")
    env = child_env({"PYTHONPATH": ROOT, "ZWDX_CONFIG_DIR": str(tmp_path / "config")})
    out = subprocess.run([sys.executable, "-m", "zwdx.cli", "run", "--server", pool.server.url, "--room-token-file",
                          str(pool.token_file), "--nproc", "2", "train_ddp.py", "--", *ARGS], cwd=wd, env=env,
                         capture_output=True, text=True, timeout=RUN_TIME)
    assert out.returncode == 0, out.stdout + out.stderr
    job = re.search(r"zwdx: job ([0-9a-f]+):", out.stderr).group(1)
    return torch.load(os.path.join(wd, "zwdx-output", job, "model.pt"), weights_only=True)


def torchrun(tmp_path, nproc: int = 2) -> dict:
    """The same script under torchrun on this machine."""
    wd = workdir(tmp_path / f"torchrun{nproc}")
    ran = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                          "train_ddp.py", *ARGS], cwd=wd, env=child_env(), capture_output=True, text=True,
                         timeout=RUN_TIME)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    return torch.load(os.path.join(wd, "outputs", "model.pt"), weights_only=True)


def outcomes(sdk) -> list[harness.Outcome]:
    """``run.py``'s row (its hook: ``--modes script``): the script through ``sdk.submit_script``
    (what ``zwdx run`` calls) against torchrun here."""
    began = time.time()
    with tempfile.TemporaryDirectory(prefix="zwdx-parity-script-") as base:
        try:
            wd = workdir(os.path.join(base, "zwdx"))
            result = sdk.submit_script("train_ddp.py", list(ARGS), nproc=2, working_dir=wd, progress=False,
                                       timeout=RUN_TIME)
            dest = sdk.download_outputs(result["job_id"], os.path.join(base, "out"))
            got = torch.load(os.path.join(dest, "model.pt"), weights_only=True)
            diff = harness.compare(got, torchrun(Path(base)))
            return [harness.Outcome("script", "train_ddp", diff, harness.TOLERANCE, time.time() - began)]
        except Exception as exc:  # a row says what went wrong
            return [harness.Outcome("script", "train_ddp", None, harness.TOLERANCE, time.time() - began,
                                    f"{type(exc).__name__}: {exc}")]


def test_zwdx_run_of_a_torchrun_script_writes_the_weights_torchrun_writes(pool, tmp_path):
    got, want = zwdx_run(pool, tmp_path), torchrun(tmp_path)
    diff = harness.compare(got, want)
    print(f"\nzwdx run --nproc 2 against torchrun --nproc-per-node 2: worst relative difference {diff:.2e}")
    assert diff <= harness.TOLERANCE
    assert harness.compare(got, _initial()) > 100 * harness.TOLERANCE  # it trained: the check above can fail


def _initial() -> dict:
    """The script's model as it starts (its seed 0)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_ddp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return module.build(0.2).state_dict()
