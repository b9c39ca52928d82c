"""Where a GPU client keeps its files: a folder of its own that no other agent uses.

    <work dir>/                      --work-dir, default ~/.zwdx/gpu_client (0700 when made here);
                                     agents of one user may share it
        secrets/<client id>.secret   the client secret (``identity.py``)
        agents/<client id>/          this agent's own (0700), locked while it runs: a second agent
                                     that finds it locked takes ``<client id>-<random>`` instead
            bundles/<sha256>.zwdx    the bundle cache (0700, files 0600): a cached file is hashed
                                     again on every use, and one whose bytes are not the sha256 it
                                     is named after is fetched again, never run
            datasets/<key>/          the dataset cache (0700; ``datasets.py``): by version or URL,
                                     size-bounded, least recently used first out, each file
                                     hashed again on every use
            jobs/<job id>/           one job's files (0700): its ranks' logs
            standby/                 the standby rank processes' logs (0700)

A rank checks the bundle it loads once more, in its own memory (``zwdx.bundle.load``): what it
runs is what the server stored, whatever happened to the file in between. An agent whose
client id was made up at its start (no ``--client-id``) will never be that agent again: it
deletes its bundle and dataset caches when it stops.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import threading
import uuid
from typing import Iterable

from zwdx.hashing import Behind

log = logging.getLogger("gpu_client.workspace")

_READ_BYTES = 8 << 20


def private_dir(path: str) -> str:
    """``path``, made if need be, readable by its owner only (0700)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


class Workspace:
    """The agent's own folder under ``root``; ``ephemeral``: its client id was made up."""

    def __init__(self, root: str, client_id: str, ephemeral: bool = False):
        if not os.path.isdir(root):
            private_dir(root)
        self.root, self.ephemeral = root, ephemeral
        agents = private_dir(os.path.join(root, "agents"))
        name = client_id
        while True:
            self.dir = private_dir(os.path.join(agents, name))
            self._lock = os.open(os.path.join(self.dir, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:  # another agent of this id runs on this work dir
                os.close(self._lock)
                name = f"{client_id}-{uuid.uuid4().hex[:6]}"
        if name != client_id:
            log.warning("gpu-client %s: another agent of this id uses %s; this one keeps its files in %s",
                        client_id, os.path.join(agents, client_id), self.dir)
        self.bundles = private_dir(os.path.join(self.dir, "bundles"))
        self.datasets = os.path.join(self.dir, "datasets")  # the dataset cache's (``datasets.py``)

    def folder(self, *parts: str) -> str:
        """A folder of this agent's (``jobs/<job id>``, ``standby``), 0700."""
        path = self.dir
        for part in parts:
            path = private_dir(os.path.join(path, part))
        return path

    def job_dir(self, job_id: str) -> str:
        return self.folder("jobs", job_id)

    # -- the bundle cache --------------------------------------------------------------------------
    def bundle_path(self, sha256: str) -> str:
        return os.path.join(self.bundles, f"{sha256}.zwdx")

    def cached(self, sha256: str) -> bool:
        """Whether the cache holds the bundle of this sha256: its file's bytes hashed now. A file
        that is not (poisoned, cut short) is deleted, to be fetched again."""
        path = self.bundle_path(sha256)
        try:
            digest = hashlib.sha256()
            with open(path, "rb") as fh:
                for block in iter(lambda: fh.read(_READ_BYTES), b""):
                    digest.update(block)
        except FileNotFoundError:
            return False
        if digest.hexdigest() == sha256:
            return True
        log.warning("gpu-client cache: %s is not the bundle it is named after (sha256 %s): deleted, fetched again",
                    path, digest.hexdigest())
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return False

    def keep_bundle(self, sha256: str, blocks: Iterable[bytes], what: str, shared=None) -> str:
        """Write the bundle's bytes (as they arrive) into the cache, if they are the sha256's;
        ``IOError`` and nothing cached otherwise. Its path. ``shared(path)``, if given, is called
        with the file being written before its first byte (the agent links it into a sandbox,
        where the ranks read it as it grows; what they read they hash themselves)."""
        path = self.bundle_path(sha256)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.part"
        digest = hashlib.sha256()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if shared is not None:
                shared(tmp)
            with os.fdopen(fd, "wb") as fh:
                with Behind(digest.update, fh.write) as behind:  # hashed and written while the next block arrives
                    for block in blocks:
                        behind.put(bytes(block))
            if digest.hexdigest() != sha256:
                raise IOError(f"{what} arrived corrupted (sha256 mismatch)")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path

    def close(self) -> None:
        """The agent stops: let the folder go (an agent whose id was made up takes its cache along)."""
        if self.ephemeral:
            shutil.rmtree(self.bundles, ignore_errors=True)
            shutil.rmtree(self.datasets, ignore_errors=True)
        try:
            os.close(self._lock)
        except OSError:
            pass
