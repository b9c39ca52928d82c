"""The uids of per-job users (``--isolation user``): held by one job at a time across the GPU
clients of a machine, and ended whole before they serve another job.

    locks = UidLocks(path)      locks.take(uid) -> bool, locks.give(uid)
    end(uid) -> bool            every process of the uid killed (True), its files in /tmp,
                                /var/tmp and /dev/shm removed

A uid's lock is a record lock on the byte at offset ``uid`` of one file, held by an open file
description (an OFD lock): two GPU clients whose ``--rank-uids`` overlap, or two isolations in
one process, never hold the same uid.

A job's processes are killed by a child of the agent that becomes the uid and calls
``kill(-1, SIGKILL)``: the kernel signals every process of that uid in one pass and undoes a fork
under way, so a process that changes its pid every few milliseconds is caught too (a scan of
pids followed by kills is outrun). That is repeated until no process of the uid is left (counted
once they are stopped: a zombie does not count); a uid that keeps one is not given to another job.
"""
from __future__ import annotations

import fcntl
import logging
import os
import signal
import struct
import time

log = logging.getLogger("gpu_client.sandbox.rank_users")

#: World-writable places where a job may have left files, removed when its uid is released.
SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")
#: How long ``end`` tries before it says a uid still has processes.
END_PATIENCE = 10.0


class UidLocks:
    """One uid per job across a machine's GPU clients: OFD record locks in ``path``, at offset uid."""

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None

    def _open(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        return self._fd

    def take(self, uid: int) -> bool:
        """Whether the lock of ``uid`` is ours now (False: another holder has it)."""
        try:
            _lock(self._open(), fcntl.F_WRLCK, uid)
        except OSError:
            return False
        return True

    def give(self, uid: int) -> None:
        if self._fd is not None:
            _lock(self._fd, fcntl.F_UNLCK, uid)


def _lock(fd: int, kind: int, uid: int) -> None:
    cmd = getattr(fcntl, "F_OFD_SETLK", None)
    if cmd is None:  # not Linux: a process's own locks (two isolations of one process may overlap)
        fcntl.lockf(fd, fcntl.LOCK_UN if kind == fcntl.F_UNLCK else fcntl.LOCK_EX | fcntl.LOCK_NB, 1, uid)
        return
    # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for an OFD lock)
    fcntl.fcntl(fd, cmd, struct.pack("hhqqi4x", kind, os.SEEK_SET, uid, 1, 0))


def end(uid: int, patience: float | None = None) -> bool:
    """Kill every process of ``uid`` and remove its files from the world-writable folders; False
    (and its files kept) when a process of it is still alive after ``patience`` seconds."""
    patience = END_PATIENCE if patience is None else patience
    deadline = time.monotonic() + patience
    while True:
        kill_all(uid)
        _signal_all(uid, signal.SIGSTOP)  # what survived, if anything did, stands still to be counted
        left = alive(uid)
        if not left:
            break
        if time.monotonic() > deadline:
            log.error("uid %d: processes %s still alive after %.0f s of SIGKILL", uid, left[:10], patience)
            return False
        time.sleep(0.01)
    _remove_files(uid)
    return True


def kill_all(uid: int) -> None:
    """SIGKILL to every process of ``uid`` at once (``kill(-1)`` as that uid)."""
    _signal_all(uid, signal.SIGKILL)


def _signal_all(uid: int, signum: int) -> bool:
    """``kill(-1, signum)`` in a child become ``uid``: whether any process of the uid was there."""
    pid = os.fork()
    if pid == 0:  # only system calls here: the agent has threads, and this child has just one
        code = 2
        try:
            os.setresuid(uid, uid, uid)
            os.kill(-1, signum)
            code = 0
        except ProcessLookupError:
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code == 2:
        raise OSError(f"could not signal the processes of uid {uid} as that uid")
    return code == 0


def alive(uid: int) -> list[int]:
    """The pids of the live (not zombie) processes with ``uid`` as any of their uids."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as fh:
                status = fh.read()
        except OSError:
            continue  # gone
        fields = dict(line.split(b":", 1) for line in status.splitlines() if b":" in line)
        ids = {int(v) for v in fields.get(b"Uid", b"").split()}
        if uid in ids and not fields.get(b"State", b"").strip().startswith((b"Z", b"X")):
            found.append(int(name))
    return found


def _remove_files(uid: int) -> None:
    """What ``uid`` left in /tmp, /var/tmp and /dev/shm. No process of it is left to race this,
    the folders are sticky (no other user renames its entries), and ``rmtree`` follows no link."""
    import shutil
    for base in SHARED_TMP:
        try:
            entries = list(os.scandir(base))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            except OSError:
                pass
