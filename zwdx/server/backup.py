"""``zwdx server backup DEST`` and ``zwdx server restore SRC``: the embedded store (SQLite's
online backup API: one read transaction, so a copy of one moment, taken while the server runs)
and the artifact files it names, each checked against the sha256 its record holds.

A backup is a folder: ``zwdx.sqlite3``, ``artifacts/<id>`` and ``MANIFEST.json`` (zwdx's
version, when, and each artifact's size and sha256). It is written as ``DEST.partial`` and
renamed when complete, so a folder named DEST is a whole backup. Artifacts are immutable once
stored (written aside, then renamed into place); one the sweeper deletes between the store's
copy and the file's copy makes the backup start again from a new copy of the store.

MongoDB (``--mongo-uri``) is backed up with MongoDB's own tools: docs/store.md.
"""
from __future__ import annotations

import datetime
import fcntl
import hashlib
import json
import os
import shutil
import sqlite3

from .. import __version__, defaults

STORE = "zwdx.sqlite3"
ARTIFACTS = "artifacts"
MANIFEST = "MANIFEST.json"
#: Held shared by every server process serving the data dir (``serve``), exclusively by a restore.
SERVING_LOCK = ".serving.lock"
#: New copies of the store taken when artifacts it names vanish meanwhile, before giving up.
TRIES = 5


class BackupError(Exception):
    """A backup or restore that cannot be made; its message says why and what to do."""


def _copy_hashed(src: str, dst: str) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    with open(src, "rb") as fin, open(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as fout:
        while block := fin.read(defaults.CHUNK_BYTES):
            digest.update(block)
            fout.write(block)
            size += len(block)
        fout.flush()
        os.fsync(fout.fileno())
    return size, digest.hexdigest()


def _snapshot_store(data_dir: str, dest: str) -> dict[str, str]:
    """The store copied to ``dest`` as of one moment; returns {artifact id: its recorded sha256}."""
    path = os.path.join(data_dir, STORE)
    if not os.path.exists(path):
        raise BackupError(f"no embedded store in {data_dir} ({STORE} is missing): is --data-dir the server's? "
                          f"(a server on MongoDB is backed up with mongodump: docs/store.md)")
    if os.path.exists(dest):
        os.unlink(dest)
    source = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    target = sqlite3.connect(dest)
    try:
        source.backup(target)  # every page in one step: one read transaction, one moment
        rows = target.execute("SELECT id, doc FROM artifacts").fetchall()
    finally:
        target.close()
        source.close()
    os.chmod(dest, 0o600)
    return {artifact_id: json.loads(doc).get("sha256", "") for artifact_id, doc in rows}


def _copy(data_dir: str, work: str) -> dict:
    """The store and the artifacts it names copied into ``work``: {artifact id: bytes, sha256}."""
    source = os.path.join(data_dir, ARTIFACTS)
    for _ in range(TRIES):
        wanted = _snapshot_store(data_dir, os.path.join(work, STORE))
        files, vanished, changed = {}, [], []
        for artifact_id, sha in sorted(wanted.items()):
            target = os.path.join(work, ARTIFACTS, artifact_id)
            if os.path.exists(target):
                os.unlink(target)
            try:
                size, got = _copy_hashed(os.path.join(source, artifact_id), target)
            except FileNotFoundError:  # swept since the store's copy: copy the store again
                vanished.append(artifact_id)
                continue
            if sha and got != sha:
                changed.append(artifact_id)
            files[artifact_id] = {"bytes": size, "sha256": got}
        if not vanished:
            break
    else:
        raise BackupError(f"artifacts kept vanishing while they were copied ({', '.join(vanished[:5])}): "
                          f"try again when the sweeper is quieter")
    if changed:
        raise BackupError(f"artifact(s) {', '.join(changed[:5])} in {source} no longer match the sha256 their "
                          f"record holds: the data dir was altered; nothing was backed up")
    return files


def backup(data_dir: str, dest: str) -> dict:
    """Back the server's ``data_dir`` up into the new folder ``dest``; returns the manifest."""
    if os.path.exists(dest):
        raise BackupError(f"{dest} exists already: a backup goes into a new folder")
    work = f"{dest.rstrip(os.sep)}.partial"
    shutil.rmtree(work, ignore_errors=True)  # what an interrupted backup left
    os.makedirs(os.path.join(work, ARTIFACTS), mode=0o700)
    os.chmod(work, 0o700)
    try:
        files = _copy(data_dir, work)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    manifest = {"zwdx": __version__, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "store": STORE, "artifacts": files}
    with open(os.path.join(work, MANIFEST), "w", encoding="utf-8") as fh:
        json.dump(manifest, fh, indent=1)
    os.rename(work, dest)
    return manifest


def serving(data_dir: str) -> int:
    """A shared lock on ``data_dir`` for as long as this process lives (its descriptor): several
    server processes may share one data dir; a restore may not run beside any of them."""
    fd = os.open(os.path.join(data_dir, SERVING_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)  # waits while a restore runs
    return fd


def restore(src: str, data_dir: str, force: bool = False) -> dict:
    """Make ``data_dir`` the backup ``src`` (every file checked against its manifest first).
    A data dir that holds a store already is refused, or with ``force`` moved aside into
    ``data_dir/before-restore-<time>``. The server must be stopped meanwhile."""
    try:
        with open(os.path.join(src, MANIFEST), encoding="utf-8") as fh:
            manifest = json.load(fh)
    except FileNotFoundError:
        raise BackupError(f"{src} is not a zwdx backup ({MANIFEST} is missing)") from None
    for artifact_id, want in manifest["artifacts"].items():
        if not isinstance(artifact_id, str) or artifact_id in ("", ".", "..") or \
                os.path.basename(artifact_id) != artifact_id or "\x00" in artifact_id:
            raise BackupError(f"the backup {src} names an artifact {artifact_id!r} that is no file name: "
                              f"nothing was restored")
        path = os.path.join(src, ARTIFACTS, artifact_id)
        digest = hashlib.sha256()
        try:
            with open(path, "rb") as fh:
                while block := fh.read(defaults.CHUNK_BYTES):
                    digest.update(block)
        except FileNotFoundError:
            raise BackupError(f"the backup {src} lacks artifact {artifact_id}: nothing was restored") from None
        if digest.hexdigest() != want["sha256"]:
            raise BackupError(f"artifact {artifact_id} of the backup {src} does not match its sha256 in {MANIFEST}: "
                              f"nothing was restored")
    os.makedirs(data_dir, mode=0o700, exist_ok=True)
    lock = os.open(os.path.join(data_dir, SERVING_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        raise BackupError(f"a zwdx server is serving {data_dir}: stop it (every process on that data dir), then "
                          f"restore") from None
    try:
        return _restore(src, data_dir, force, manifest)
    finally:
        os.close(lock)  # a server waiting to start goes on now


def _restore(src: str, data_dir: str, force: bool, manifest: dict) -> dict:
    present = [n for n in (STORE, f"{STORE}-wal", f"{STORE}-shm", ARTIFACTS)
               if os.path.exists(os.path.join(data_dir, n))]
    if present and not force:
        raise BackupError(f"{data_dir} holds a store already ({', '.join(present)}): stop its server and pass --force "
                          f"to move it aside, or restore into an empty data dir")
    if present:
        aside = os.path.join(data_dir, f"before-restore-{datetime.datetime.now():%Y%m%d-%H%M%S}")
        os.makedirs(aside, mode=0o700)
        for name in present:
            os.rename(os.path.join(data_dir, name), os.path.join(aside, name))
        manifest["moved_aside"] = aside
    os.makedirs(os.path.join(data_dir, ARTIFACTS), mode=0o700)
    for artifact_id in manifest["artifacts"]:
        shutil.copyfile(os.path.join(src, ARTIFACTS, artifact_id), os.path.join(data_dir, ARTIFACTS, artifact_id))
    partial = os.path.join(data_dir, f".{STORE}.restoring")
    shutil.copyfile(os.path.join(src, STORE), partial)
    os.chmod(partial, 0o600)
    os.replace(partial, os.path.join(data_dir, STORE))  # last: a data dir with a store is a whole restore
    return manifest


def command(args) -> int:
    """``zwdx server backup DEST`` / ``zwdx server restore SRC`` (``args.server_action``)."""
    import sys
    data_dir = os.path.abspath(args.backup_data_dir or args.data_dir)
    if args.mongo_uri:
        print("zwdx server: a server on MongoDB (--mongo-uri) is backed up with mongodump and restored with "
              "mongorestore, artifacts included (GridFS): docs/store.md", file=sys.stderr)
        return 2
    try:
        if args.server_action == "backup":
            manifest = backup(data_dir, args.path)
            total = sum(a["bytes"] for a in manifest["artifacts"].values())
            print(f"zwdx server: {data_dir} backed up into {args.path}: the store and "
                  f"{len(manifest['artifacts'])} artifact(s), {total} bytes, each checked against its sha256")
        else:
            manifest = restore(args.path, data_dir, args.force)
            aside = f"; what was there is in {manifest['moved_aside']}" if manifest.get("moved_aside") else ""
            print(f"zwdx server: {data_dir} restored from {args.path} (backed up {manifest['created']}, "
                  f"{len(manifest['artifacts'])} artifact(s) checked){aside}")
    except (BackupError, OSError, sqlite3.Error) as err:
        print(f"zwdx server: {args.server_action} failed: {err}", file=sys.stderr)
        return 1
    return 0
