"""Where a job's compiled kernels go: the caches of ``torch.compile`` (Inductor, its Triton
kernels, Dynamo's packages) and of C++ extensions built as the job runs.

    <sandbox>/tmp/compile_cache/   the job's own, removed with its sandbox (the default)
    <DIR>/<room>/                  ``zwdx gpu-client --compile-cache DIR``: its room's, kept
        inductor/ triton/ torch_extensions/

Rank side: ``point(box)``, right after ``rank_process.enter``, before the job's code. Libraries
read their cache folder from variables a standby rank process resolved as root before it had a
job (``import torch._dynamo`` sets ``TORCHINDUCTOR_CACHE_DIR`` to /tmp/torchinductor_root, and
``torch._dynamo.package`` keeps a cache object made from it), so ``point`` sets the variables
and makes again, or forgets, what torch computed from them.

Agent side (``RoomCaches``): one folder per room under ``DIR``, the agent's, lent to one job of
that room at a time (a record lock, so GPU clients of one machine may share ``DIR``), as the
job's per-job user for the job's duration; a job of the room that finds it lent compiles in its
sandbox. When the job's processes are gone the folder becomes the agent's again: every link,
FIFO, socket, device and hard-linked file in it is removed, group and other lose all access and
set-id bits go (and a folder an agent killed meanwhile left lent is emptied when an agent of
``DIR`` starts, or lends it). So a room's job reads only what earlier jobs of the same room (the same
submitters) compiled; what one plants there runs in the room's next compiling job, which those
submitters could run themselves anyway. No job of another room ever reads it.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import shutil
import stat
import sys
from dataclasses import dataclass

from . import folder as sandbox

log = logging.getLogger("gpu_client.sandbox.compile_cache")

#: In the sandbox's ``tmp``: the job's compile caches when its room keeps none here.
IN_SANDBOX = "compile_cache"
#: The variables libraries read, and the folder each names (in the compile cache).
VARIABLES = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton",
             "TORCH_EXTENSIONS_DIR": "torch_extensions"}

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


# -- the rank's side ----------------------------------------------------------------------------------
def folder(box) -> str:
    """The job's compile cache: its room's (``box.compile_cache``), else its sandbox's."""
    return str(box.compile_cache or os.path.join(sandbox.tmp(box), IN_SANDBOX))


def point(box) -> None:
    """In a rank process, once in its sandbox: the compile caches there, whatever torch resolved
    before (a standby imported it as root)."""
    if box is None:
        return
    root = folder(box)
    for variable, name in VARIABLES.items():
        path = os.path.join(root, name)
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.environ[variable] = path
    _forget_torch()


def _forget_torch() -> None:
    """Make again what torch computed from the cache folder it saw first, where it has loaded
    (torch 2.13: Dynamo's package cache, the precompiled headers' folder, Inductor's lru caches).
    Private parts of torch: one that moved costs a warning, never the rank."""
    try:
        package = sys.modules.get("torch._dynamo.package")
        if package is not None and hasattr(package, "DiskDynamoCache"):
            package.DynamoCache = package.DiskDynamoCache(os.path.join(package.cache_dir(), "dynamo"))
        codecache = sys.modules.get("torch._inductor.codecache")
        if codecache is not None and hasattr(codecache, "_HEADER_DIR"):
            from torch._inductor.runtime.cache_dir_utils import default_cache_dir
            codecache._HEADER_DIR = os.path.join(default_cache_dir(), "precompiled_headers")
            codecache._HEADER_LOCK_DIR = os.path.join(codecache._HEADER_DIR, "locks")
        utils = sys.modules.get("torch._inductor.utils")
        if utils is not None and hasattr(utils, "clear_caches"):
            utils.clear_caches()  # what Inductor forgets when it gets a fresh cache folder
    except Exception:
        log.warning("torch's compile caches may still name the folder torch saw first", exc_info=True)


# -- the agent's side ---------------------------------------------------------------------------------
@dataclass
class Lent:
    """A room's compile cache lent to one job: its path, the lock that holds it, its uid."""
    path: str
    lock: int
    uid: int | None


class RoomCaches:
    """``--compile-cache DIR``: a compile cache per room, kept between the room's jobs (see the module)."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)

    def check(self, other_users: bool) -> None:
        """``root`` made, the agent's, passable by per-job users (0711: ``other_users``, as every
        folder above it must be) and listing nothing to them; else an IsolationError."""
        from .isolation import IsolationError, _blocked
        try:
            os.makedirs(self.root, mode=0o711, exist_ok=True)
            st = os.lstat(self.root)
        except OSError as exc:
            raise IsolationError(f"--compile-cache {self.root}: {exc.strerror}") from None
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise IsolationError(f"--compile-cache {self.root} must be a folder of this GPU client's user (uid "
                                 f"{os.geteuid()}), not a link nor another user's: the rooms' caches are kept from "
                                 f"one another there")
        os.chmod(self.root, 0o711)
        for name in os.listdir(self.root):  # what an agent killed with a folder lent left
            if name.startswith("room-") and name.endswith(".lock"):
                self._reclaim(name[:-len(".lock")])
        blocked = _blocked(self.root) if other_users else None
        if blocked:
            raise IsolationError(f"--compile-cache {self.root}: the jobs' users cannot reach it, as {blocked} is "
                                 f"mode {stat.S_IMODE(os.stat(blocked).st_mode):04o} (they need o+x on every folder "
                                 f"above it): pick a folder elsewhere, or chmod o+x {blocked}")

    def _reclaim(self, name: str) -> None:
        """Room folder ``name`` the agent's (emptied if it was a job's), unless a job has it."""
        lock = self._lock(name)
        if lock is not None:
            try:
                _fresh_if_not_ours(os.path.join(self.root, name))
            finally:
                os.close(lock)

    def _lock(self, name: str) -> int | None:
        lock = os.open(os.path.join(self.root, f"{name}.lock"),
                       os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock)
            return None
        return lock

    def lend(self, room_id: str, uid: int | None) -> Lent | None:
        """The room's folder for one job (``uid``: its per-job user's, who gets it), or None while
        another job of the room has it (that job's own sandbox then)."""
        name = _room_name(room_id)
        lock = self._lock(name)
        if lock is None:
            return None
        try:
            path = os.path.join(self.root, name)
            _fresh_if_not_ours(path)
            if uid is not None:
                _own(path, uid)
        except BaseException:
            os.close(lock)
            raise
        return Lent(path, lock, uid)

    def shut(self, lent: Lent) -> None:
        """The job's ranks exited: its user no longer enters the folder (the agent's, 0700), before
        its leftover processes are ended and its uid may serve another job."""
        if lent.uid is not None:
            os.chown(lent.path, os.geteuid(), os.getegid(), follow_symlinks=False)
            os.chmod(lent.path, 0o700)

    def give_back(self, lent: Lent) -> None:
        """The job's processes are gone: all in the folder the agent's again, cleaned; unlocked."""
        try:
            if lent.uid is not None:
                _own(lent.path, os.geteuid())
        finally:
            os.close(lent.lock)


def _fresh_if_not_ours(path: str) -> None:
    """``path`` a folder of the agent's: what an agent killed while it was lent left (a job's
    user's, which that uid's next job, of any room, could reach) is removed first."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid()):
        log.warning("compile cache %s was not given back (a GPU client killed while a job had it): emptied", path)
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path)  # from descriptors, following no link
        else:
            os.unlink(path)
        st = None
    if st is None:
        os.mkdir(path, 0o700)


def _room_name(room_id: str) -> str:
    if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", room_id):
        return f"room-{room_id}"
    return f"room-{hashlib.sha256(room_id.encode()).hexdigest()[:32]}"


def _own(path: str, uid: int) -> None:
    """``path`` and every folder and regular file under it ``uid``'s (its gid the same number;
    the agent's own gid for the agent), ``u`` modes only, no set-id bits; links, FIFOs, sockets,
    devices and files with another name (hard links) removed. The top first, which shuts out
    the previous owner; then from directory descriptors, following no link."""
    gid = os.getegid() if uid == os.geteuid() else uid
    top = os.open(path, _DIR_FLAGS)
    try:
        os.fchown(top, uid, gid)
        os.fchmod(top, 0o700)
        _own_below(top, uid, gid)
    finally:
        os.close(top)


def _own_below(fd: int, uid: int, gid: int) -> None:
    for name in os.listdir(fd):
        try:
            st = os.lstat(name, dir_fd=fd)
        except FileNotFoundError:
            continue
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode) and st.st_nlink == 1):
            os.unlink(name, dir_fd=fd)  # a link, FIFO, socket, device, or a hard link to another file
            continue
        flags = _DIR_FLAGS if stat.S_ISDIR(st.st_mode) else os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            sub = os.open(name, flags, dir_fd=fd)
        except OSError:  # swapped for something else meanwhile
            _remove(fd, name)
            continue
        try:
            got = os.fstat(sub)
            if (got.st_dev, got.st_ino, stat.S_IFMT(got.st_mode)) != (st.st_dev, st.st_ino, stat.S_IFMT(st.st_mode)) \
                    or not stat.S_ISDIR(got.st_mode) and got.st_nlink != 1:
                _remove(fd, name)
                continue
            os.fchown(sub, uid, gid)
            os.fchmod(sub, stat.S_IMODE(got.st_mode) & 0o700 | (0o700 if stat.S_ISDIR(got.st_mode) else 0o600))
            if stat.S_ISDIR(got.st_mode):
                _own_below(sub, uid, gid)
        finally:
            os.close(sub)


def _remove(fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=fd)
    except IsADirectoryError:
        shutil.rmtree(name, dir_fd=fd)
    except FileNotFoundError:
        pass
