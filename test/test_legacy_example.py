"""The earlier project's example runs as it is.

test/legacy_mnist.py is the earlier project's test/mnist.py (github zenwor/zwdx) byte for byte,
except its ``create_loader``, which makes synthetic digits instead of downloading MNIST. It
runs as a real script, against a real server and one GPU client, and must reach its success
branch with the train function's own ``epochs=3``.
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys

import psutil

import needs
from procs import ROOT

SCRIPT = os.path.join(ROOT, "test", "legacy_mnist.py")
#: sha256 of the earlier script with its create_loader taken out: the rest must stay as it was.
EARLIER_SHA256 = "d4aaecf8bf45ed5ef3bc7a1832f90835c5cedd56ccc37ef2e9471e63e1eed2a3"
MEMORY_REQUIRED = 12_000_000_000  # what the script asks of its slot


def test_the_copy_differs_from_the_earlier_script_only_in_its_loader():
    text = open(SCRIPT, encoding="utf-8").read()
    start, end = text.index("def create_loader("), text.index("def train(")
    assert hashlib.sha256((text[:start] + text[end:]).encode()).hexdigest() == EARLIER_SHA256
    assert "import torchvision" not in text and "from torchvision" not in text


def test_the_earlier_example_runs_unchanged_and_reaches_its_success_branch(server, room, start_client, sdk):
    if psutil.virtual_memory().available < MEMORY_REQUIRED + 2**30:
        # The script asks memory_required=12 GB, and a CPU slot offers the host's available memory.
        needs.missing(f"memory (this host has {psutil.virtual_memory().available >> 30} GB available; the earlier "
                      "script asks memory_required=12 GB)", "run the suite on a host with 13 GB available")
    start_client("a")
    done = subprocess.run([sys.executable, SCRIPT, "-rt", room["token"]], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "SERVER_URL": server.url, "PYTHONPATH": ROOT}, timeout=480)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert " - INFO - Submitting MNIST training job..." in out
    assert re.search(r" - INFO - Final loss: \d+\.\d{4}\n", out), out
    assert " - INFO - Successfully retrieved trained model weights!" in out, out
    assert room["token"] not in out.replace(f"-rt {room['token']}", "")

    [job] = sdk.list_jobs(room["token"])
    assert job["spec"]["training"]["epochs"] is None and job["name"] == "train"
    epochs = [line["text"].split(":")[0] for line in sdk.get_job_logs(job["id"], room["token"])
              if re.match(r"Epoch \d+: Loss=", line["text"])]
    assert epochs == ["Epoch 0", "Epoch 1", "Epoch 2"]  # train's own epochs=3, not a default of ours
