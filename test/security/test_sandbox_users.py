"""Issue 29, H4 and L2: the per-job users of ``--isolation user``.

H4: a job's process that forks and exits every 2 ms outran the pid scan that ended the job's
uid, stayed alive after the job and, once its uid served another room's job, read that job's
rank key from ``/proc/<pid>/mem``. Replayed: the hopper is dead once its job is released; a uid
one of whose processes survives is not handed to another job; a rank process is not dumpable
(another process of its uid reads neither its memory nor its environment).

L2: the machine-wide uid lock was keyed by position in ``--rank-uids``, not by uid: two GPU
clients with overlapping ranges gave one uid to two jobs at once."""
from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

import gpu_client.sandbox.isolation as isolation
from gpu_client.sandbox.isolation import IsolationError, UserIsolation
from sandbox_rig import as_job, has_process, rig, uid_range  # noqa: F401  (rig: a fixture)

pytestmark = pytest.mark.slow

#: Forks, and its parent exits, every 2 ms: its pid changes faster than a scan of pids goes.
HOPPER = """
import os, sys, time
end = time.time() + 20  # bounded: whatever happens, it stops by itself
print("hopping", flush=True)
os.close(1)
while time.time() < end:
    if os.fork():
        os._exit(0)
    time.sleep(0.002)
"""


def hop(box) -> None:
    hopper = as_job(box, HOPPER, wait=False)
    assert hopper.stdout.readline().strip() == "hopping", hopper.stderr.read()
    hopper.wait(10)  # its first parent exits at once; its descendants hop on
    assert has_process(box.uid), "the hopper is not running"


def test_a_process_that_changes_its_pid_every_2_ms_is_dead_when_its_job_is_released(rig):
    iso, base, boxes = rig
    box = iso.lease("c", "job-hop", 0)
    boxes.append(box)
    hop(box)
    iso.release(box)
    assert not has_process(box.uid), f"processes of uid {box.uid} survived the job's release"


def test_a_uid_whose_process_survives_serves_no_other_job(rig, monkeypatch):
    """SIGKILL made to fail (as if a process of the uid could not be killed): the uid stays
    held, and the next job gets another one or none, never that one."""
    iso, base, boxes = rig
    iso.uids = uid_range(1)
    box = iso.lease("c", "job-left", 0)
    boxes.append(box)
    hop(box)
    from gpu_client.sandbox import rank_users
    monkeypatch.setattr(rank_users, "kill_all", lambda uid: None)
    monkeypatch.setattr(rank_users, "END_PATIENCE", 0.2)
    iso.release(box)
    assert has_process(box.uid), "the hopper died by itself: the test proves nothing"
    with pytest.raises(IsolationError, match="in use"):
        boxes.append(iso.lease("c", "job-next", 0))  # another room's job: not on that uid
    monkeypatch.undo()
    iso._give(box.uid)  # (as an agent started again would: it ends what is left before using the uid)
    again = iso.lease("c", "job-later", 0)
    boxes.append(again)
    assert again.uid == box.uid and not has_process(box.uid)


def test_a_rank_process_is_not_dumpable(rig):
    """``rank_process.enter``, as a rank calls it: another process of the uid reads nothing of it."""
    iso, base, boxes = rig
    box = iso.lease("c", "job-dump", 0)
    boxes.append(box)
    rank = subprocess.Popen(
        [sys.executable, "-c", "import ctypes, sys; from gpu_client.sandbox.rank_process import enter; "
         "from zwdx.protocol.rank import Sandbox; enter(Sandbox.model_validate_json(sys.argv[1])); "
         "print(ctypes.CDLL(None).prctl(3, 0, 0, 0, 0), flush=True); sys.stdin.read()", box.model_dump_json()],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "ZWDX_RANK_KEY": "zr_secret"})
    try:
        assert rank.stdout.readline().strip() == "0"  # PR_GET_DUMPABLE
        assert psutil.Process(rank.pid).uids().real == box.uid
        peer = as_job(box, f"""
for name in ("mem", "environ"):
    try:
        fh = open("/proc/{rank.pid}/" + name, "rb")
        fh.seek(0x400000) if name == "mem" else None
        print(name, "read", fh.read(16))
    except OSError as exc:
        print(name, type(exc).__name__)
""")
        assert peer.stdout.split("\n")[:2] == ["mem PermissionError", "environ PermissionError"], peer.stdout + peer.stderr
    finally:
        rank.kill()
        rank.wait()


def test_two_isolations_with_overlapping_uid_ranges_never_hold_one_uid(tmp_path, monkeypatch):
    """Two GPU clients of one machine (here, one process: the locks are per open file, not per
    process), ranges ``[s, s+8)`` and ``[s+4, s+12)``."""
    monkeypatch.setattr(isolation, "UID_LOCKS", str(tmp_path / "locks" / "rank-uids.lock"))
    start = uid_range(12).start
    a = UserIsolation(str(tmp_path / "a"), range(start, start + 8), str(tmp_path / "wa"))
    b = UserIsolation(str(tmp_path / "b"), range(start + 4, start + 12), str(tmp_path / "wb"))
    held_a = {a._take() for _ in range(8)}
    assert held_a == set(range(start, start + 8))
    held_b = set()
    with pytest.raises(IsolationError, match="in use"):
        while True:
            held_b.add(b._take())
    assert held_b == set(range(start + 8, start + 12)), sorted(held_b & held_a)
    a._give(start + 5)
    assert b._take() == start + 5  # given back: the other may have it now
