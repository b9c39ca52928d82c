"""The child processes of tests and benchmarks (zwdx/testing.py): stop() leaves nothing of the
process group behind, children do not inherit the caller's ZWDX_* settings unless asked, and a
port from free_port() stays this process's, so a server restarts on it safely."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from zwdx.testing import Child, ServerProc, free_port, holds, wait_until


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


def test_a_port_from_free_port_stays_held_and_a_server_restarts_only_on_a_held_one(tmp_path):
    port = free_port()
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    assert port < low  # below the ephemeral range: no outgoing connection is given it meanwhile
    # another process asking for that port finds it held (as its free_port() would)
    probe = (f"import fcntl, os; from zwdx.testing import PORT_LOCKS; fd = os.open(PORT_LOCKS, os.O_RDWR)\n"
             f"try:\n    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, {port}); print('free')\n"
             f"except OSError:\n    print('held')")
    child = Child([sys.executable, "-c", probe], str(tmp_path / "probe.log"))
    assert child.wait(30) == 0 and child.output().strip() == "held", child.output()
    with pytest.raises(ValueError, match="not held by this process"):
        ServerProc(str(tmp_path / "server"), port=port + 1 if not holds(port + 1) else port + 2)
