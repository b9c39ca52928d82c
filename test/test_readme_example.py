"""The README's first command runs ``test/mnist.py`` (run_all.sh) against a server and its GPU
clients: the script itself, as a process, to its end. CI runs only the second command, so this
is where the first one's example is kept working (the example broke once, unnoticed: a local
``zwdx = ZWDX(...)`` hid the module whose settings it then asked for)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from procs import ROOT

SCRIPT = os.path.join(ROOT, "test", "mnist.py")


def test_the_readme_example_runs_to_its_end(server, room, start_client):
    start_client("a")
    done = subprocess.run([sys.executable, SCRIPT, "--server", server.url, "--world-size", "1", "--epochs", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=480,
                          env={**os.environ, "ZWDX_ROOM_TOKEN": room["token"], "PYTHONPATH": ROOT})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert re.search(r"job \S+: completed on 1 rank\(s\), final loss \d+\.\d{4}", out), out
    accuracy = float(re.search(r"held-out accuracy of the trained model: (\d\.\d{3})", out).group(1))
    assert accuracy > 0.5, out  # one epoch of the 8x8 digits: well above chance (0.1)
    assert "metric series:" in out, out
