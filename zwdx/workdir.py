"""A script job's working dir as it travels: one gzipped tar of the files that are not ignored,
the same bytes for the same tree, so that its sha256 names it (``PUT /api/v1/workdirs/<sha256>``:
an unchanged tree is uploaded once).

Which files:

- in a git repository, those git would commit: ``git ls-files --cached --others
  --exclude-standard`` under the dir (tracked and untracked files, not the ignored ones);
- elsewhere, every file that no ``.gitignore`` of the tree ignores (``pathspec``, git's own
  rules; each ``.gitignore`` for its folder and below);
- never ``.git/``, ``__pycache__/``, ``*.pyc``, nor ``zwdx-output/`` (where ``zwdx run`` puts the
  outputs of jobs).

A link to a file inside the tree travels as a link; one that leaves the tree is refused, named
(ignore it or copy its target in). At most ``MAX_WORKDIR_BYTES`` of files (``max_bytes``,
``ZWDX_MAX_WORKDIR_BYTES``): past it, ``BadRequest`` names the biggest files. The same tree
packs to the same bytes: entries sorted, their times set to 1980-01-01, owner root, mode 0644
(0755 when executable), a gzip header without name or time.

Only the SDK packs; a rank unpacks (``gpu_client.script.unpack``, tarfile's ``data`` filter).
"""
from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass

import pathspec

from .errors import BadRequest
from .protocol.script import script_path_error

#: Most bytes of files a working dir may hold (the files', before compression).
MAX_WORKDIR_BYTES = 256 * 1024**2
#: Folders and files that never travel (git's patterns).
ALWAYS_LEFT_OUT = (".git/", "__pycache__/", "*.pyc", "zwdx-output/")
#: The time every entry of the archive carries (1980-01-01: what zip files can hold too).
EPOCH = 315532800
#: How many of the biggest files an over-the-limit error names.
NAMED = 5


@dataclass
class Packed:
    """A packed working dir: the archive (a temporary file: ``discard()`` it), its sha256 and
    size, and the files it holds (how many, and their bytes before compression)."""
    path: str
    sha256: str
    size: int
    files: int
    tree_bytes: int
    #: The script, relative to the working dir (None: none was asked for).
    script: str | None

    def discard(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def max_bytes_default() -> int:
    """``ZWDX_MAX_WORKDIR_BYTES`` if set, else ``MAX_WORKDIR_BYTES``."""
    value = os.environ.get("ZWDX_MAX_WORKDIR_BYTES")
    try:
        return int(value) if value else MAX_WORKDIR_BYTES
    except ValueError:
        raise BadRequest(f"ZWDX_MAX_WORKDIR_BYTES must be a number of bytes, got {value!r}",
                         field="max_workdir_bytes") from None


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


# -- which files ---------------------------------------------------------------------------------
def _git_files(root: str) -> list[str] | None:
    """The files git would commit under ``root`` (relative, POSIX), or None when ``root`` is in
    no git work tree (or there is no git)."""
    if shutil.which("git") is None:
        return None
    inside = subprocess.run(["git", "-C", root, "rev-parse", "--is-inside-work-tree"], capture_output=True, text=True)
    if inside.returncode != 0 or inside.stdout.strip() != "true":
        return None
    listed = subprocess.run(["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True)
    names = sorted({name for name in listed.stdout.decode("utf-8", "surrogateescape").split("\0") if name})
    out = []
    for name in names:
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path):  # a submodule: all of it
            out += [os.path.join(name, rel).replace(os.sep, "/") for rel in _walk(path, [])]
        elif os.path.lexists(path):  # deleted but still in the index: gone
            out.append(name)
    return out


def _ignores(folder: str) -> pathspec.GitIgnoreSpec | None:
    try:
        with open(os.path.join(folder, ".gitignore"), encoding="utf-8", errors="replace") as fh:
            return pathspec.GitIgnoreSpec.from_lines(fh)
    except FileNotFoundError:
        return None


def _walk(root: str, specs: list[tuple[str, pathspec.GitIgnoreSpec]]) -> list[str]:
    """Every file under ``root`` (relative, POSIX) that no ``.gitignore`` on its way ignores."""
    out = []
    for base, dirs, files in os.walk(root):
        rel_base = os.path.relpath(base, root).replace(os.sep, "/")
        rel_base = "" if rel_base == "." else rel_base + "/"
        own = _ignores(base)
        if own is not None:
            specs = [*[(p, s) for p, s in specs if rel_base.startswith(p)], (rel_base, own)]

        def ignored(rel: str, is_dir: bool) -> bool:
            """git's rule: the last pattern that matches decides, deeper .gitignore files last."""
            name, verdict = rel + ("/" if is_dir else ""), False
            for prefix, spec in specs:
                if name.startswith(prefix):
                    match = spec.check_file(name[len(prefix):])
                    verdict = verdict if match.include is None else match.include
            return verdict
        dirs[:] = sorted(d for d in dirs if not ignored(rel_base + d, not os.path.islink(os.path.join(base, d))))
        for d in list(dirs):
            if os.path.islink(os.path.join(base, d)):  # a link to a folder travels as a link, like a file
                dirs.remove(d)
                files.append(d)
        out += [rel_base + f for f in sorted(files) if not ignored(rel_base + f, False)]
    return out


def list_files(root: str) -> list[str]:
    """The files of the working dir that travel (relative POSIX paths, sorted)."""
    always = [("", pathspec.GitIgnoreSpec.from_lines(ALWAYS_LEFT_OUT))]
    names = _git_files(root)
    if names is None:
        return sorted(_walk(root, always))
    spec = always[0][1]
    return sorted(n for n in names if not any(spec.match_file("/".join(n.split("/")[:i + 1]) + "/")
                                              for i in range(n.count("/"))) and not spec.match_file(n))


# -- checks ---------------------------------------------------------------------------------------
def script_in(root: str, script: str, files: list[str]) -> str:
    """The script as a path relative to the working dir, if it is one of the files that travel;
    ``BadRequest`` naming ``script`` otherwise."""
    full = os.path.abspath(script if os.path.isabs(script) else os.path.join(root, script))
    rel = os.path.relpath(full, root).replace(os.sep, "/")
    error = script_path_error(rel)
    if error or rel.startswith("../"):
        raise BadRequest(f"script {script!r} must be inside the working dir {root}"
                         + (f" ({error})" if error and not rel.startswith("../") else ""), field="script")
    if rel not in files:
        if os.path.isfile(full):
            raise BadRequest(f"script {rel} is left out of the working dir {root} (a .gitignore, or one of "
                             f"{', '.join(ALWAYS_LEFT_OUT)}): it would not travel", field="script")
        raise BadRequest(f"no script {rel} in the working dir {root}", field="script")
    return rel


def _sizes(root: str, files: list[str]) -> dict[str, int]:
    sizes = {}
    for name in files:
        path = os.path.join(root, name)
        if os.path.islink(path):
            target = os.path.realpath(path)
            if not (target == os.path.realpath(root) or target.startswith(os.path.realpath(root) + os.sep)):
                raise BadRequest(f"the working dir {root} holds {name}, a link out of it (to {target}): ignore it "
                                 f"(.gitignore) or copy what it points to into the working dir", field="working_dir")
            sizes[name] = 0
        else:
            sizes[name] = os.path.getsize(path)
    return sizes


def check_size(root: str, sizes: dict[str, int], max_bytes: int) -> int:
    """The files' bytes, added up; ``BadRequest`` naming the biggest files past ``max_bytes``."""
    total = sum(sizes.values())
    if total > max_bytes:
        biggest = sorted(sizes.items(), key=lambda kv: -kv[1])[:NAMED]
        raise BadRequest(f"the working dir {root} holds {human(total)} in {len(sizes)} file(s) to upload, more than "
                         f"the limit of {human(max_bytes)}; the biggest: "
                         + ", ".join(f"{name} ({human(size)})" for name, size in biggest)
                         + ". Leave them out with a .gitignore, or raise the limit (max_workdir_bytes=..., "
                           "zwdx run --max-workdir-bytes, ZWDX_MAX_WORKDIR_BYTES)",
                         field="working_dir", limit=max_bytes, size=total)
    return total


# -- the archive ----------------------------------------------------------------------------------
def _entry(tar: tarfile.TarFile, root: str, name: str) -> tuple[tarfile.TarInfo, str]:
    path = os.path.join(root, name)
    info = tar.gettarinfo(path, arcname=name)
    info.mtime, info.uid, info.gid, info.uname, info.gname = EPOCH, 0, 0, "", ""
    if info.issym():  # inside the tree (_sizes checked): as a path from the link's own folder
        here = os.path.join(os.path.realpath(root), os.path.dirname(name))
        info.linkname, info.mode = os.path.relpath(os.path.realpath(path), here), 0o777
    else:
        info.mode = 0o755 if info.mode & 0o111 else 0o644
    return info, path


def pack(working_dir: str, script: str | None, max_bytes: int | None = None) -> Packed:
    """The working dir packed into a temporary file, with the script (if given) checked to be
    one of its files; ``BadRequest`` (naming ``working_dir`` or ``script``) before anything is
    written when it cannot travel."""
    root = os.path.abspath(working_dir)
    if not os.path.isdir(root):
        raise BadRequest(f"working dir {working_dir!r} is not a folder", field="working_dir")
    files = list_files(root)
    rel = script_in(root, script, files) if script is not None else None
    total = check_size(root, _sizes(root, files), max_bytes_default() if max_bytes is None else max_bytes)
    fd, path = tempfile.mkstemp(prefix="zwdx-workdir-", suffix=".tar.gz")
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as gz, \
                tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for name in files:
                info, full = _entry(tar, root, name)
                if info.isreg():
                    with open(full, "rb") as fh:
                        tar.addfile(info, fh)
                else:
                    tar.addfile(info)
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    except BaseException:
        os.unlink(path)
        raise
    return Packed(path=path, sha256=digest.hexdigest(), size=os.path.getsize(path), files=len(files),
                  tree_bytes=total, script=rel)
