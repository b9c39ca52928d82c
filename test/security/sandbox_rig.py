"""What the sandbox attacks share: a per-job-user isolation (``gpu_client.sandbox.isolation.UserIsolation``)
in a temporary folder every user may pass, with uids of a range of their own (held against every
other GPU client of the machine by the same locks), and job code run as a sandbox's user."""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

import needs
from gpu_client.sandbox.isolation import UserIsolation

#: Below DEFAULT_UIDS: never a uid a GPU client of the machine gives its jobs.
TEST_UIDS = 1_900_000_000


def uid_range(size: int) -> range:
    start = TEST_UIDS + random.randrange(0, 90_000_000 // size) * size
    return range(start, start + size)


@pytest.fixture
def rig():
    """``(isolation, base)``: a per-job-user isolation whose rank dir is in ``base`` (0711)."""
    needs.root("per-job users (setuid) and root-owned sandboxes")
    base = tempfile.mkdtemp(prefix="zwdx-sandbox-", dir="/tmp")
    os.chmod(base, 0o711)
    iso = UserIsolation(os.path.join(base, "ranks"), uid_range(8), os.path.join(base, "work"))
    os.makedirs(iso.rank_dir, 0o711)
    boxes = []
    try:
        yield iso, base, boxes
    finally:
        for box in boxes:  # whatever a test left of its job users (a failed test)
            subprocess.run(["pkill", "-KILL", "-U", str(box.uid)], check=False)
        shutil.rmtree(base, ignore_errors=True)


def home(box) -> str:
    """Where job code runs: the sandbox's ``home`` (the sandbox itself, before issue 29)."""
    path = os.path.join(str(box.dir), "home")
    return path if os.path.isdir(path) else str(box.dir)


def as_job(box, code: str, *, wait: bool = True, timeout: float = 30):
    """Python ``code`` run as the sandbox's user in its home, as job code runs (``done`` or the process)."""
    argv = [sys.executable, "-P", "-c", code]
    kw = dict(user=box.uid, group=box.gid, extra_groups=[], cwd=home(box), env={"PATH": os.environ["PATH"]})
    if not wait:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)


def root_secret_dir(base: str) -> str:
    """A folder only root may enter (0700), with a file in it: where the attacks point."""
    path = os.path.join(base, "root-only")
    os.mkdir(path, 0o700)
    with open(os.path.join(path, "secret"), "w") as fh:
        fh.write("root's")
    os.chmod(os.path.join(path, "secret"), 0o600)
    return path


def untouched(path: str) -> None:
    """``path`` is still root's 0700 folder with root's one file, unchanged."""
    st = os.lstat(path)
    assert (st.st_uid, oct(st.st_mode & 0o7777)) == (0, oct(0o700)), f"{path} was changed: {oct(st.st_mode)}"
    assert sorted(os.listdir(path)) == ["secret"], f"written into {path}: {os.listdir(path)}"
    st = os.lstat(os.path.join(path, "secret"))
    assert (st.st_mode & 0o7777, st.st_nlink) == (0o600, 1), f"{path}/secret was changed or linked"
    assert open(os.path.join(path, "secret")).read() == "root's"


def has_process(uid: int) -> bool:
    """Whether a live (not zombie) process of ``uid`` exists: each stopped first (``kill(-1,
    SIGSTOP)`` as that uid, one call that a process changing its pid every few ms does not slip
    past, as a scan of pids does), then counted, then let go on."""
    _signal_all(uid, signal.SIGSTOP)
    try:
        for pid in os.listdir("/proc"):
            try:
                with open(f"/proc/{pid}/status") as fh:
                    status = dict(line.split(":", 1) for line in fh if ":" in line)
            except (OSError, ValueError):
                continue
            if uid in map(int, status["Uid"].split()) and not status["State"].strip().startswith(("Z", "X")):
                return True
        return False
    finally:
        _signal_all(uid, signal.SIGCONT)


def _signal_all(uid: int, signum: int) -> None:
    pid = os.fork()
    if pid == 0:
        try:
            os.setresuid(uid, uid, uid)
            os.kill(-1, signum)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
