"""A script job's working dir as it travels: one gzipped tar of the files that are not ignored,
the same bytes for the same tree, so that its sha256 names it (``PUT /api/v1/workdirs/<sha256>``:
an unchanged tree is uploaded once).

Which files:

- in a git repository, those git would commit: ``git ls-files --cached --others
  --exclude-standard`` under the dir (tracked and untracked files, not the ignored ones);
- elsewhere, every file that no ``.gitignore`` of the tree ignores (``pathspec``, git's own
  rules; each ``.gitignore`` for its folder and below);
- never ``.git/``, ``__pycache__/``, ``*.pyc``, nor ``zwdx-output/`` (where ``zwdx run`` puts the
  outputs of jobs);
- what a ``.gitignore`` ignores travels only where an ``include`` pattern (git's syntax: ``zwdx
  run --include '*.bin'``) names it; the rest is said (``Packed.left_out``: how many, the
  biggest, their bytes) and named to the job (``ScriptSpec.left_out``), so that a script that
  fails opening one of them says so.

A link to a file inside the tree travels as a link; one that leaves the tree is refused, named
(ignore it or copy its target in). At most ``MAX_WORKDIR_BYTES`` of files (``max_bytes``,
``ZWDX_MAX_WORKDIR_BYTES``): past it, ``BadRequest`` names the biggest files. The same tree
packs to the same bytes: entries sorted, their times set to 1980-01-01, owner root, mode 0644
(0755 when executable), a gzip header without name or time.

Only the SDK packs; a rank unpacks (``gpu_client.rank.script.unpack``, tarfile's ``data`` filter).
"""
from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass, field

import pathspec

from .errors import BadRequest
from .sizes import human
from .protocol.script import script_path_error

#: Most bytes of files a working dir may hold (the files', before compression).
MAX_WORKDIR_BYTES = 256 * 1024**2
#: Folders and files that never travel (git's patterns).
ALWAYS_LEFT_OUT = (".git/", "__pycache__/", "*.pyc", "zwdx-output/")
_ALWAYS = pathspec.GitIgnoreSpec.from_lines(ALWAYS_LEFT_OUT)
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
    #: What a ``.gitignore`` left out: each file's bytes; the same as git's ``--directory``
    #: names them (what the job is told); the ``include`` patterns that named none of them.
    left_out: dict[str, int] = field(default_factory=dict)
    left_out_entries: list[str] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)

    def left_out_line(self) -> str | None:
        """What was left out, in a line (None: nothing): how many, their bytes, the biggest."""
        if not self.left_out:
            return None
        biggest = sorted(self.left_out.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
        more = len(self.left_out) - len(biggest)
        example = biggest[0][0]
        return (f"left out {len(self.left_out)} file(s), {human(sum(self.left_out.values()))}, that a .gitignore "
                f"ignores: " + ", ".join(f"{name} ({human(size)})" for name, size in biggest)
                + (f" and {more} more" if more > 0 else "")
                + f"; pack them anyway with --include PATTERN (e.g. --include '{example}')")

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


# -- which files ---------------------------------------------------------------------------------
def _git(root: str, *args: str) -> list[str]:
    done = subprocess.run(["git", "-C", root, "ls-files", "-z", *args], capture_output=True, check=True)
    return sorted({name for name in done.stdout.decode("utf-8", "surrogateescape").split("\0") if name})


def _git_files(root: str) -> Selection | None:
    """What git would commit under ``root`` (relative, POSIX) and what its ignore rules leave out,
    or None when ``root`` is in no git work tree (or there is no git)."""
    if shutil.which("git") is None:
        return None
    inside = subprocess.run(["git", "-C", root, "rev-parse", "--is-inside-work-tree"], capture_output=True, text=True)
    if inside.returncode != 0 or inside.stdout.strip() != "true":
        return None
    out = []
    for name in _git(root, "--cached", "--others", "--exclude-standard"):
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path):  # a submodule: all of it
            out += [os.path.join(name, rel).replace(os.sep, "/") for rel in _walk(root=path, specs=[]).files]
        elif os.path.lexists(path):  # deleted but still in the index: gone
            out.append(name)
    ignored = _git(root, "--others", "--ignored", "--exclude-standard")
    entries = _git(root, "--others", "--ignored", "--exclude-standard", "--directory")
    return Selection(out, ignored, entries)


def _ignores(folder: str) -> pathspec.GitIgnoreSpec | None:
    try:
        with open(os.path.join(folder, ".gitignore"), encoding="utf-8", errors="replace") as fh:
            return pathspec.GitIgnoreSpec.from_lines(fh)
    except FileNotFoundError:
        return None


@dataclass
class Selection:
    """Files that travel, files a ``.gitignore`` leaves out, and those as git's ``--directory``
    names them (an ignored folder once, as ``name/``)."""
    files: list[str]
    ignored: list[str]
    entries: list[str]
    #: The ignored files an ``include`` pattern took back.
    included: list[str] = field(default_factory=list)


def _walk(root: str, specs: list[tuple[str, pathspec.GitIgnoreSpec]]) -> Selection:
    """Every file under ``root`` (relative, POSIX), and those a ``.gitignore`` on its way ignores."""
    out, ignored_files, entries = [], [], []
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
        for d in sorted(dirs):
            if _ALWAYS.match_file(rel_base + d + "/"):
                dirs.remove(d)
            elif os.path.islink(os.path.join(base, d)):  # a link to a folder travels as a link, like a file
                dirs.remove(d)
                files.append(d)
            elif ignored(rel_base + d, True):
                dirs.remove(d)
                entries.append(rel_base + d + "/")
                ignored_files += [f"{rel_base}{d}/{rel}" for rel in _every_file(os.path.join(base, d))]
        dirs.sort()
        for f in sorted(files):
            if ignored(rel_base + f, False):
                ignored_files.append(rel_base + f)
                entries.append(rel_base + f)
            else:
                out.append(rel_base + f)
    return Selection(out, ignored_files, entries)


def _every_file(folder: str) -> list[str]:
    """The files (and links) under ``folder``, relative, following no link."""
    found = []
    for base, dirs, files in os.walk(folder):
        rel = os.path.relpath(base, folder).replace(os.sep, "/")
        prefix = "" if rel == "." else rel + "/"
        found += [prefix + name for name in files + [d for d in dirs if os.path.islink(os.path.join(base, d))]]
    return found


def select(root: str, include=()) -> Selection:
    """The working dir's files that travel (relative POSIX paths, sorted): what git would commit,
    or what no ``.gitignore`` ignores, and those of the ignored ones an ``include`` pattern
    names; never ``ALWAYS_LEFT_OUT``. ``ignored`` and ``entries``: what is left out."""
    always = _ALWAYS

    def kept(name: str) -> bool:
        parts = name.rstrip("/").split("/")
        return not any(always.match_file("/".join(parts[:i + 1]) + "/") for i in range(len(parts) - 1)) \
            and not always.match_file(name)
    found = _git_files(root)
    if found is None:
        found = _walk(root, [])
    wanted = pathspec.GitIgnoreSpec.from_lines(include) if include else None
    picked = [n for n in found.ignored if wanted is not None and wanted.match_file(n)]
    chosen = set(picked)
    return Selection(sorted(n for n in {*found.files, *picked} if kept(n)),
                     [n for n in found.ignored if n not in chosen and kept(n)],
                     [n for n in found.entries if kept(n) and n not in chosen], sorted(n for n in picked if kept(n)))


def list_files(root: str, include=()) -> list[str]:
    """The files of the working dir that travel (relative POSIX paths, sorted)."""
    return select(root, include).files


def unmatched(include, ignored: list[str]) -> list[str]:
    """The ``include`` patterns that name none of the files the ``.gitignore`` files ignore."""
    return [p for p in include if not any(pathspec.GitIgnoreSpec.from_lines([p]).match_file(n) for n in ignored)]


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


def pack(working_dir: str, script: str | None, max_bytes: int | None = None, include=()) -> Packed:
    """The working dir packed into a temporary file, with the script (if given) checked to be
    one of its files; ``include``: patterns (git's) of ignored files to pack anyway.
    ``BadRequest`` (naming ``working_dir`` or ``script``) before anything is written when it
    cannot travel."""
    root = os.path.abspath(working_dir)
    if not os.path.isdir(root):
        raise BadRequest(f"working dir {working_dir!r} is not a folder", field="working_dir")
    chosen = select(root, include)
    files = chosen.files
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
                  tree_bytes=total, script=rel, left_out={n: _lsize(os.path.join(root, n)) for n in chosen.ignored},
                  left_out_entries=chosen.entries,
                  unmatched=unmatched(include, chosen.ignored + chosen.included))


def _lsize(path: str) -> int:
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0
