"""Lost peer or the rank's own error? Told by where the error came from, not by its words.

Two real rank processes over gloo, the model wrapped as the runner wraps it; one dies (or not)
at a chosen point and the other says how ``gpu_client.rank.failures`` classifies what it caught.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from procs import ROOT, free_port

pytestmark = pytest.mark.slow  # real rank processes over gloo

RANK = r'''
import datetime, json, os, sys, time
import torch, torch.distributed as dist
from gpu_client.rank.failures import is_collective_error
from gpu_client.rank.strategies.parallel import wrap

case, rank, port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
torch.manual_seed(0)
model = wrap(torch.nn.Linear(4, 2), "DDP", torch.device("cpu"))
for _ in range(3):  # DDP has rebuilt its buckets: from here on its only collective is in backward()
    model(torch.randn(8, 4)).sum().backward()
if rank == 1:
    if case.startswith("peer_dies"):
        os._exit(3)
    time.sleep(60)  # alive, and out of the way (the test ends it)
    sys.exit(0)
while not os.path.exists("go"):  # the test says go once rank 1 is gone (or, in the other cases, at once)
    time.sleep(0.02)
try:
    if case == "peer_dies_in_backward":
        for _ in range(3):
            model(torch.randn(8, 4)).sum().backward()
    elif case == "peer_dies_in_barrier":
        dist.barrier()
    elif case == "own_timeout":
        raise TimeoutError("timed out reading data")
    elif case == "own_backward_error":
        model(torch.randn(8, 4)).detach().sum().backward()  # nothing requires grad
    elif case == "peer_dies_and_the_user_raises_another":
        try:
            dist.barrier()
        except RuntimeError as exc:
            raise ValueError("gave up") from exc
    raise AssertionError("no error")
except Exception as exc:
    print(json.dumps({"type": type(exc).__name__, "collective": is_collective_error(exc)}))
'''


def classify(case: str, tmp_path) -> dict:
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": ROOT}
    peer = subprocess.Popen([sys.executable, "-c", RANK, case, "1", port], env=env, cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        rank0 = subprocess.Popen([sys.executable, "-c", RANK, case, "0", port], env=env, cwd=tmp_path,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            if case.startswith("peer_dies"):
                assert peer.wait(120) == 3, "rank 1 did not exit as staged"
            (tmp_path / "go").touch()
            stdout, stderr = rank0.communicate(timeout=120)
        finally:
            rank0.kill()
            rank0.wait()
    finally:
        peer.kill()
        peer.wait()
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert lines, stderr[-3000:]
    return json.loads(lines[-1])


@pytest.mark.parametrize("case, kind, collective", [
    ("peer_dies_in_backward", "RuntimeError", True),    # DDP's all-reduce, inside the autograd engine
    ("peer_dies_in_barrier", "RuntimeError", True),     # raised in torch.distributed's code
    ("peer_dies_and_the_user_raises_another", "ValueError", True),  # its cause is the lost peer
    ("own_timeout", "TimeoutError", False),             # "timed out" in the user's words
    ("own_backward_error", "RuntimeError", False),      # the autograd engine, no collective broke
])
def test_a_rank_tells_a_lost_peer_from_its_own_error_by_where_it_came_from(tmp_path, case, kind, collective):
    assert classify(case, tmp_path) == {"type": kind, "collective": collective}
