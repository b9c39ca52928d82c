"""The child processes of tests and benchmarks (zwdx/testing.py): stop() leaves nothing of the
process group behind, and children do not inherit the caller's ZWDX_* settings unless asked."""
from __future__ import annotations

import os
import signal
import time

from zwdx.testing import Child, wait_until


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as fh:  # a zombie waiting for its parent counts as gone
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_stop_ends_what_the_child_left_in_its_group_after_it_exited(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    child = Child(["sh", "-c", f"sleep 300 & echo $! > {pid_file}; exit 0"], str(tmp_path / "log"))
    grandchild = int(wait_until(lambda: pid_file.exists() and pid_file.read_text().strip(), 10, what="the pid"))
    wait_until(lambda: not child.alive(), 10, what="the child to exit")
    assert not _gone(grandchild)  # the shell exited; its sleep lives on in the group
    child.stop()
    wait_until(lambda: _gone(grandchild), 10, what="the grandchild to be killed")


def test_stop_kills_a_child_that_ignores_sigterm(tmp_path):
    child = Child(["sh", "-c", "trap '' TERM; echo ready; while true; do sleep 0.1; done"], str(tmp_path / "log"))
    wait_until(lambda: "ready" in child.output(), 10, what="the trap set")
    started = time.monotonic()
    assert child.stop(grace=0.5) == -signal.SIGKILL
    assert time.monotonic() - started < 30 and not child.alive()


def test_children_get_no_zwdx_settings_of_the_caller_unless_asked(tmp_path, monkeypatch, config_dir):
    monkeypatch.setenv("ZWDX_MONGO_URI", "mongodb://elsewhere:1/x")
    monkeypatch.setenv("ZWDX_ASYNC_MODE", "threading")
    child = Child(["sh", "-c", "env"], str(tmp_path / "log"), env={"ZWDX_CLIENT_TIMEOUT": "7"})
    child.wait(10)
    seen = dict(line.split("=", 1) for line in child.output().splitlines() if line.startswith("ZWDX_"))
    assert seen == {"ZWDX_CONFIG_DIR": str(config_dir), "ZWDX_CLIENT_TIMEOUT": "7"}
    child.stop()
