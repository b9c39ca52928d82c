"""Real processes for tests: a zwdx server and GPU clients, each its own OS process,
on 127.0.0.1 with free ports, stopped by the test that started them (by their pid)."""
from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UI = os.path.join(ROOT, "ui")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.1, what: str = "condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout} s waiting for {what}")


class Proc:
    """A child process with its log file; ``stop()`` ends it (SIGTERM, then SIGKILL)."""

    def __init__(self, args: list[str], log_path: str, env: dict | None = None, cwd: str = ROOT):
        self.args, self.log_path = args, log_path
        self._log = open(log_path, "ab")
        self.popen = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                      start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.alive():
            os.kill(self.popen.pid, sig)

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        self._log.close()
        return self.popen.returncode

    def output(self) -> str:
        with open(self.log_path, "rb") as fh:
            return fh.read().decode(errors="replace")


class Server(Proc):
    def __init__(self, data_dir: str, port: int | None = None, extra: list[str] | None = None,
                 env: dict | None = None, host: str = "127.0.0.1", cwd: str = ROOT):
        self.port = port or free_port()
        self.host = host
        self.url = f"http://{host}:{self.port}"
        self.data_dir = data_dir
        os.makedirs(data_dir, exist_ok=True)
        super().__init__([sys.executable, "-m", "zwdx.cli", "server", "--host", host, "--port", str(self.port),
                          "--data-dir", data_dir, *(extra or [])],
                         os.path.join(data_dir, f"server-{self.port}.log"), env, cwd)
        wait_until(self.healthy, 30, what=f"server on {self.url}\n{self.output()}")

    def healthy(self) -> bool:
        if not self.alive():
            raise RuntimeError(f"server exited:\n{self.output()}")
        try:
            return requests.get(f"{self.url}/health", timeout=1).status_code == 200
        except requests.RequestException:
            return False


class GpuClient(Proc):
    def __init__(self, server_url: str, token: str, work_dir: str, client_id: str | None = None,
                 extra: list[str] | None = None, env: dict | None = None):
        self.client_id = client_id or f"test-{os.path.basename(work_dir)}"
        os.makedirs(work_dir, exist_ok=True)
        super().__init__([sys.executable, "-m", "zwdx.cli", "gpu-client", "--server", server_url,
                          "--room-token", token, "--cpu", "--threads", "1", "--client-id", self.client_id,
                          "--work-dir", work_dir, *(extra or [])],
                         os.path.join(work_dir, "gpu-client.log"), env)
