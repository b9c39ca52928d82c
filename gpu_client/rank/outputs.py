"""A script job's outputs on the GPU client (``gpu_client.rank.script``): what rank 0 packs, and what
it says when there is nothing to pack or when its script failed on a file that did not travel.

The folders packed are the job's (``$ZWDX_OUTPUT_DIR``, and the working dir's folders
``zwdx run --outputs-from`` names) and job code wrote them, so they are read as if it had
planted links to the donor's files there: each folder is entered one path component at a time
from a directory descriptor, following no link (``O_NOFOLLOW``: a folder that is a link is
refused, named); files are opened the same way and packed only when they are regular files;
a link is packed as a link only when it points inside its folder; FIFOs, devices and sockets
are left out. Whatever is left out is said in the rank's log.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import stat
import tarfile

from zwdx.sizes import human

log = logging.getLogger("gpu_client.rank.outputs")

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: What a rank's note names of the files its script wrote (the biggest first).
NAMED = 5
#: Never worth naming as something the script wrote: Python's own caches.
_CACHES = ("__pycache__",)


class Refused(PermissionError):
    """A folder to collect is a link or no folder: it is not read through."""


def open_root(path: str) -> int:
    """A descriptor of the rank's own folder, taken before job code runs: later opens start from
    it, so a folder above swapped for a link is not followed."""
    return os.open(path, _DIR)


def open_folder(root: int, rel: str) -> int | None:
    """A descriptor of ``rel`` below the folder ``root`` (a descriptor), entered one component at
    a time following no link; None when it does not exist. ``Refused`` when a component is a
    link or not a folder."""
    fd = os.dup(root)
    try:
        for part in [p for p in rel.split("/") if p]:
            if part in (".", ".."):
                raise Refused(f"{rel!r} is not a folder inside the working dir")
            try:
                sub = os.open(part, _DIR, dir_fd=fd)
            except FileNotFoundError:
                return None
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise Refused(f"{rel} is a link or not a folder: not read through") from None
                raise
            os.close(fd)
            fd = sub
        opened, fd = fd, None
        return opened
    finally:
        if fd is not None:
            os.close(fd)


def walk(fd: int, prefix: str = ""):
    """``(rel, kind, stat, dir_fd, name)`` for every entry under the folder ``fd``, following no
    link; ``kind`` is ``file``, ``dir``, ``link`` or ``other``. Closes nothing it was given."""
    with os.scandir(fd) as entries:
        found = sorted(entries, key=lambda e: e.name)
    for entry in found:
        rel = prefix + entry.name
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            yield rel, "link", st, fd, entry.name
        elif stat.S_ISDIR(st.st_mode):
            yield rel, "dir", st, fd, entry.name
            try:
                sub = os.open(entry.name, _DIR, dir_fd=fd)
            except OSError:  # swapped for a link since: left out
                continue
            try:
                yield from walk(sub, rel + "/")
            finally:
                os.close(sub)
        elif stat.S_ISREG(st.st_mode):
            yield rel, "file", st, fd, entry.name
        else:
            yield rel, "other", st, fd, entry.name


def _add(tar: tarfile.TarFile, arcname: str, dir_fd: int, name: str) -> bool:
    """A regular file into the tar from what ``name`` is when opened (no link followed)."""
    try:
        fd = os.open(name, _FILE, dir_fd=dir_fd)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        info = tarfile.TarInfo(arcname)
        info.size, info.mtime, info.mode = st.st_size, int(st.st_mtime), 0o644
        tar.addfile(info, fh)
    return True


def pack(root: int, folders: list[tuple[str, str]], archive: str) -> int:
    """The files of each ``(folder, prefix)`` (folders relative to the folder ``root``) as one tar at
    ``archive``, each under its prefix: how many entries it holds (0: none, and no archive)."""
    count = 0
    with tarfile.open(archive, "w") as tar:
        for folder, prefix in folders:
            try:
                fd = open_folder(root, folder)
            except Refused as exc:
                log.warning("outputs: %s: left out", exc)
                continue
            if fd is None:
                continue
            try:
                for rel, kind, st, dir_fd, name in walk(fd):
                    arcname = prefix + rel
                    if kind == "dir":
                        info = tarfile.TarInfo(arcname)
                        info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, int(st.st_mtime)
                        tar.addfile(info)
                    elif kind == "file":
                        if not _add(tar, arcname, dir_fd, name):
                            log.warning("outputs: %s changed as it was read: left out", arcname)
                            continue
                    elif kind == "link":
                        target = os.readlink(name, dir_fd=dir_fd)
                        inside = os.path.normpath(os.path.join(os.path.dirname(rel), target))
                        if os.path.isabs(target) or inside == ".." or inside.startswith("../"):
                            log.warning("outputs: %s links out of its folder (%s): left out", arcname, target)
                            continue
                        info = tarfile.TarInfo(arcname)
                        info.type, info.linkname, info.mode = tarfile.SYMTYPE, target, 0o777
                        tar.addfile(info)
                    else:
                        log.warning("outputs: %s is not a file: left out", arcname)
                        continue
                    count += 1
            finally:
                os.close(fd)
    if count == 0:
        os.unlink(archive)
    return count


# -- what a rank says ---------------------------------------------------------------------------------
def written(root: int, tree: str, unpacked: set[str]) -> dict[str, int]:
    """The files the script made in its working dir ``tree`` (below the folder ``root``; those
    not unpacked there), with their bytes; Python's caches not counted."""
    try:
        fd = open_folder(root, tree)
    except Refused:
        return {}
    if fd is None:
        return {}
    try:
        return {rel: st.st_size for rel, kind, st, _, _ in walk(fd)
                if kind == "file" and rel not in unpacked and not any(c in rel.split("/") for c in _CACHES)}
    finally:
        os.close(fd)


def no_outputs_note(made: dict[str, int], outputs_from: list[str]) -> str:
    """Rank 0's words when no outputs come back: where its script wrote, and how to collect it."""
    where = "$ZWDX_OUTPUT_DIR" + "".join(f" or {f}/" for f in outputs_from)
    if not made:
        return f"zwdx: no outputs: rank 0 wrote nothing under {where}, nor anywhere in its working dir"
    biggest = sorted(made.items(), key=lambda kv: (-kv[1], kv[0]))[:NAMED]
    more = len(made) - len(biggest)
    folder = next((name.split("/")[0] for name, _ in biggest if "/" in name), None)
    how = f"collect that folder with zwdx run --outputs-from {folder}, or " if folder else ""
    return (f"zwdx: no outputs: rank 0 wrote nothing under {where}; in its working dir it wrote "
            + ", ".join(f"{name} ({human(size)})" for name, size in biggest)
            + (f" and {more} more file(s)" if more > 0 else "")
            + (f" ({human(sum(made.values()))} in all)" if len(made) > 1 else "")
            + f", dropped with it: {how}write under $ZWDX_OUTPUT_DIR")


#: A path in the error of a failed open (``[Errno 2] No such file or directory: 'data/x.bin'``).
_MISSING = re.compile(r"No such file or directory: (?P<q>['\"])(?P<path>.+?)(?P=q)")


def left_out_hint(lines, left_out: list[str], tree: str) -> str | None:
    """When the script's stderr says it could not open a path that the submitter's .gitignore
    left out of the working dir (``left_out``: files, and folders as ``name/``), what to say."""
    if not left_out:
        return None
    root = os.path.realpath(tree)
    for line in reversed(list(lines)):
        for match in _MISSING.finditer(line):
            path = match.group("path")
            if os.path.isabs(path):
                real = os.path.normpath(path)
                if not real.startswith(root + os.sep):
                    continue
                path = os.path.relpath(real, root)
            rel = os.path.normpath(path).replace(os.sep, "/")
            if rel.startswith("../") or rel == "..":
                continue
            for entry in left_out:
                if entry == rel or entry == rel + "/" or (entry.endswith("/") and rel.startswith(entry)) \
                        or entry.startswith(rel + "/"):
                    return (f"{rel} is not in the job's working dir: the submitter's .gitignore ignores "
                            f"{entry}, so zwdx run left it out; pack it with zwdx run --include '{entry}'")
    return None
