"""A job's sandbox on a GPU client: its folder, and how the agent writes into it without
following anything the job's code made there.

    <rank dir>/<client id>/<job id>.<attempt>/   the sandbox: the agent's, never writable by the job
                                                 (a per-job user: root:<its gid>, 0750; else 0700)
        bundle.zwdx, ca.pem                      what the agent shares (0444; the bundle a hard link)
        data/<name>/<path>                       the job's datasets (folders 0755, files 0444)
        home/                                    the job's own (0700): its working directory and HOME
        tmp/                                     the job's own (0700): its TMPDIR

Job code may run while the agent still writes here: ranks load a bundle as it streams in, before
the job's datasets are shared. So the agent writes only where the job cannot (the sandbox and
``data`` are the agent's), and writes as if the job could anyway: from directory file descriptors,
one path component at a time, opening no symbolic link (``O_NOFOLLOW``), entering no folder it did
not make (owned by another user), and creating each file afresh (``O_EXCL``): a link, a FIFO or a
hard link found where it writes is refused (``Refused``), never written through.
"""
from __future__ import annotations

import errno
import os
import shutil

#: The job's own folders in its sandbox.
HOME, TMP = "home", "tmp"

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Refused(PermissionError):
    """The agent will not write there: a path of the sandbox is not what the agent made."""


def home(box) -> str:
    return os.path.join(str(box.dir), HOME)


def tmp(box) -> str:
    return os.path.join(str(box.dir), TMP)


def make(path: str, owner: int | None = None) -> None:
    """The sandbox at ``path``, made afresh (what a killed agent left goes first): the agent's,
    with the job's ``home`` and ``tmp``; ``owner``: the per-job user's uid (its gid the same
    number), who owns those two and may only read and pass the sandbox itself (0750, its group)."""
    if not shutil.rmtree.avoids_symlink_attacks:  # pragma: no cover (every Linux has openat)
        raise OSError("this platform's shutil.rmtree follows links: sandboxes need openat")
    shutil.rmtree(path, ignore_errors=True)
    os.mkdir(path, 0o700)
    fd = os.open(path, _DIR_FLAGS)
    try:
        for name in (HOME, TMP):
            os.mkdir(name, 0o700, dir_fd=fd)
            if owner is not None:
                os.chown(name, owner, owner, dir_fd=fd, follow_symlinks=False)
        if owner is not None:
            os.fchown(fd, -1, owner)
            os.fchmod(fd, 0o750)
    finally:
        os.close(fd)


def remove(path: str) -> None:
    """The sandbox and all in it, following no link (``shutil.rmtree`` works from file descriptors)."""
    shutil.rmtree(path, ignore_errors=True)


def place(source: str, box_dir: str, name: str, link: bool = True) -> str:
    """``source`` in the sandbox as ``name`` (a relative path; its folders made, 0755), read-only
    (0444): a hard link to it (no copy), else (``link`` False, or across file systems) a copy.
    ``Refused`` where a component is a link, a folder the agent did not make, or not a folder."""
    parts = _parts(name)
    fd = _walk(box_dir, parts[:-1])
    leaf = parts[-1]
    try:
        try:
            os.unlink(leaf, dir_fd=fd)  # unlinkat: takes the name away, follows nothing
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            raise Refused(f"{os.path.join(box_dir, name)} is a folder, not a file the agent shares") from None
        src = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
        try:
            out = _linked(source, src, leaf, fd) if link else None
            if out is None:
                out = _copied(src, leaf, fd, os.path.join(box_dir, name))
            try:
                os.fchmod(out, 0o444)
            finally:
                os.close(out)
        finally:
            os.close(src)
    finally:
        os.close(fd)
    return os.path.join(box_dir, name)


def folder(box_dir: str, name: str) -> str:
    """The folder ``name`` in the sandbox (made, 0755, as ``place`` makes folders)."""
    os.close(_walk(box_dir, _parts(name)))
    return os.path.join(box_dir, name)


# -- helpers ------------------------------------------------------------------------------------------
def _parts(name: str) -> list[str]:
    parts = name.replace(os.sep, "/").split("/")
    if not parts or any(p in ("", ".", "..") for p in parts):
        raise Refused(f"{name!r} is not a path inside the sandbox")
    return parts


def _walk(box_dir: str, parts: list[str]) -> int:
    """A descriptor of the folder ``parts`` below the sandbox, each made if missing; every one,
    the sandbox too, the agent's (its owner this process's user) and no link."""
    fd = _open_own(box_dir, None, box_dir)
    try:
        for part in parts:
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            sub = _open_own(part, fd, box_dir)
            os.close(fd)
            fd = sub
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_own(path: str, dir_fd: int | None, box_dir: str) -> int:
    try:
        fd = os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise Refused(f"{path} in sandbox {box_dir} is not a folder (a link?): not written through") from None
        raise
    if os.fstat(fd).st_uid != os.geteuid():
        os.close(fd)
        raise Refused(f"{path} in sandbox {box_dir} is not the GPU client's folder: not written into")
    return fd


def _linked(source: str, src: int, leaf: str, fd: int) -> int | None:
    """The hard link made and opened (no link followed), or None where a copy must do."""
    # read-only for all before it shows in the sandbox (a link is the same inode): a rank waiting
    # for the file would otherwise find it the agent's 0600 until the fchmod after (EACCES)
    os.fchmod(src, 0o444)
    try:
        os.link(source, leaf, dst_dir_fd=fd, follow_symlinks=False)
    except FileExistsError:
        raise Refused(f"{leaf} appeared in the sandbox while the GPU client shared it") from None
    except OSError:
        return None  # another file system, or a file system without hard links: a copy
    out = os.open(leaf, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    got, want = os.fstat(out), os.fstat(src)
    if (got.st_dev, got.st_ino) != (want.st_dev, want.st_ino):
        os.close(out)
        raise Refused(f"{leaf} in the sandbox is not the file the GPU client linked there")
    return out


def _copied(src: int, leaf: str, fd: int, where: str) -> int:
    """A copy of ``src`` created as ``leaf`` (never one that exists: no link, FIFO or file followed)."""
    try:
        out = os.open(leaf, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444, dir_fd=fd)
    except FileExistsError:
        raise Refused(f"{where} appeared in the sandbox while the GPU client shared it") from None
    try:
        left = os.fstat(src).st_size
        offset = 0
        while left > 0:
            sent = os.sendfile(out, src, offset, min(left, 1 << 30))
            if sent == 0:
                break
            offset, left = offset + sent, left - sent
    except BaseException:
        os.close(out)
        raise
    return out
