"""The benchmark scripts still run against the code they measure: each, on CPU, at its smallest,
to the end, printing its tables and no failed run (a change of a token, a message or a helper's
signature broke them silently once). Figures are not checked here: bench/README.md has them, so
nothing waits for a steady machine (``--settle 0``: the standbys are waited for, not the seconds
after them) and a shaped link is the faster of wan.py's two (the same shaping, fewer seconds)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


def bench(script: str, *args: str, timeout: float = 300) -> str:
    env = {**os.environ, "PYTHONPATH": ROOT}
    env = {k: v for k, v in env.items() if not k.startswith("ZWDX_") or k == "ZWDX_CONFIG_DIR"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "FAILED" not in out, out[-4000:]
    return out


def test_overhead_runs_fsdp_on_both_sides():
    out = bench("overhead.py", "--gpus", "0", "--cpu-ranks", "2", "--model", "gpt2", "--parallelism", "FSDP",
                "--steps", "8", "--warmup", "2", "--settle", "0")
    assert "2 x CPU rank, FSDP" in out and "| gpt2" in out and "wrap FSDP" in out


def test_strategies_runs_the_four_ways():
    out = bench("strategies.py", "--gpus", "0", "--cpu-ranks", "2", "--model", "gpt2", "--steps", "8", "--warmup", "2",
                "--microbatches", "4", "--settle", "0")
    for way in ("| DDP", "| FSDP", "| TP", "| PIPELINE"):
        assert way in out, out[-4000:]


def test_job_end_runs():
    assert "job completed" in bench("job_end.py", "--jobs", "1", "--settle", "0").lower()


def test_control_plane_runs_with_rank_keys_and_donor_tokens_on_one_and_two_servers():
    import needs
    needs.tool("redis-server", "apt-get install redis-server (./setup.sh --test)")
    needs.tool("haproxy", "apt-get install haproxy (./setup.sh --test)")
    out = bench("control_plane.py", "--clients", "10", "--hold", "4", "--warm", "2", "--procs", "1",
                "--job-seconds", "2", "--users-per-100", "20", "--servers", "1,2", "--all")
    # a level with an error is not a PASS; two servers: behind HAProxy, on one SQLite file
    assert "sqlite x1 10 clients: PASS" in out and "sqlite x2 10 clients: PASS" in out, out[-4000:]
    assert "count: jobs completed" in out


def test_diloco_sync_runs_both_ways():
    out = bench("diloco_sync.py", "--workers", "2", "--numel", "100000", "--rounds", "1")
    assert "| server" in out and "| workers" in out


def test_wan_runs_ddp_and_diloco_over_a_shaped_link():
    import needs
    needs.root("network namespaces and tc")
    needs.tool("tc", "apt-get install iproute2 (./setup.sh --test)")
    out = bench("wan.py", "--links", "1000", "--steps", "8", "--ways", "smoke", timeout=600)
    assert "| DDP" in out and "DILOCO H=4 int8" in out


def test_checkpoint_stall_runs():
    out = bench("checkpoint_stall.py", "--gpus", "0", "--cpu-ranks", "2", "--checkpoints", "2", "--between", "2",
                "--where")
    assert "| this checkout |" in out and "first checkpoint's stall" in out
    assert "checkpoint 0" in out and "where rank 0's training thread was" in out  # --where's samples


def test_mixed_devices_runs_both_sharings():
    out = bench("mixed_devices.py", "--steps", "2", "--warmup", "1", "--hidden", "64", "--global-batch", "32")
    assert "| unweighted | 16 + 16 |" in out and "| weighted |" in out and "weighted / unweighted speed" in out


def test_pinning_says_it_needs_a_gpu_where_there_is_none():
    # it measures pinned memory against a GPU's training: on CPU, a clear refusal, no traceback
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "pinning.py")], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "no CUDA device here" in proc.stderr and "Traceback" not in proc.stderr


def test_step_check_runs_plain_and_checked_ddp():
    out = bench("step_check.py", "--steps", "2", "--repeats", "1", "--models", "test")
    assert out.count("| test |") == 3, out
