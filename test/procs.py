"""Real processes for tests: a zwdx server and GPU clients, each its own OS process, on
127.0.0.1 with free ports, stopped by the test that started them (by their pid, with their
process group). The processes themselves are zwdx.testing's, shared with the benchmarks; this
module gives them the test suite's defaults and builds the dashboard for the browser tests."""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess

from zwdx.testing import Child, GpuClientProc, ServerProc, free_port, wait_until

__all__ = ["ROOT", "UI", "SLACK", "Proc", "Server", "GpuClient", "free_port", "wait_until", "build_ui"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UI = os.path.join(ROOT, "ui")
#: Seconds a loaded machine (two cores, other test runs beside this one) may add to a timer of the
#: system under test. A time limit is the configured timeout plus this, never a bare constant.
SLACK = 5.0


def _newest_ui_source() -> float:
    paths = [os.path.join(UI, name) for name in ("index.html", "package-lock.json", "vite.config.js")]
    for folder in ("src", "public"):
        for base, _, files in os.walk(os.path.join(UI, folder)):
            paths += [os.path.join(base, f) for f in files]
    return max(os.path.getmtime(p) for p in paths if os.path.exists(p))


def build_ui() -> str:
    """ui/dist, built (npm ci && npm run build) when it is missing or older than the sources."""
    import pytest
    index = os.path.join(UI, "dist", "index.html")
    with open(os.path.join("/tmp", "zwdx-ui-build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # other test sessions may build at the same time
        if not os.path.exists(index) or os.path.getmtime(index) < _newest_ui_source():
            if not shutil.which("npm"):
                pytest.fail("the dashboard is not built and npm is missing (Node 20 and npm build it)")
            if not os.path.isdir(os.path.join(UI, "node_modules")):
                subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=UI, check=True)
            subprocess.run(["npm", "run", "build", "--silent"], cwd=UI, check=True)
    return os.path.dirname(index)


class Proc(Child):
    """Any command as a child process (own session, output in ``log_path``, run in the
    checkout); ``stop()`` ends it and its process group."""

    def __init__(self, args: list[str], log_path: str, env: dict | None = None, cwd: str = ROOT):
        super().__init__(args, log_path, env, cwd)


class Server(ServerProc):
    """A server process of this checkout on a free port (``url``), healthy when returned."""

    def __init__(self, data_dir: str, port: int | None = None, extra: list[str] | None = None,
                 env: dict | None = None, host: str = "127.0.0.1", cwd: str = ROOT):
        super().__init__(data_dir, port, extra, env, host, cwd, timeout=30)


class GpuClient(GpuClientProc):
    """A GPU-client process with one CPU slot and one thread (tests run without GPUs), its ranks
    processes (``PROCESSES``, whatever Docker engine the machine has) unless ``extra`` says."""

    def __init__(self, server_url: str, token: str, work_dir: str, client_id: str | None = None,
                 extra: list[str] | None = None, env: dict | None = None):
        super().__init__(server_url, token, work_dir, client_id or f"test-{os.path.basename(work_dir)}",
                         extra=extra, env={**PROCESSES, **(env or {})})


#: The isolation of test GPU clients that do not ask for one: the default without Docker (a
#: per-job user as root, else the same user), even where an engine answers (CI starts one).
PROCESSES = {"ZWDX_ISOLATION": "user" if os.geteuid() == 0 else "process"}
