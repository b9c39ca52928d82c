"""Where a GPU client keeps its files: a folder of its own that no other agent uses.

    <work dir>/                      --work-dir, default ~/.zwdx/gpu_client (0700 when made here);
                                     agents of one user may share it
        client_ids                   the ids agents started here without --client-id took (0600), one
                                     a line: each start takes the first that no running agent holds,
                                     so a restarted agent is the same GPU client to the server
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
runs is what the server stored, whatever happened to the file in between.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import socket
import threading
import uuid
from typing import Iterable

from zwdx.hashing import Behind

log = logging.getLogger("gpu_client.agent.workspace")

_READ_BYTES = 8 << 20


def private_dir(path: str) -> str:
    """``path``, made if need be, readable by its owner only (0700)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def default_root() -> str:
    """The work dir of an agent started without ``--work-dir``."""
    return os.path.join(os.path.expanduser("~"), ".zwdx", "gpu_client")


def running_agents(root: str) -> dict[str, int]:
    """The agents running on the work dir ``root``: folder name -> pid (read from the lock file
    of each folder whose lock is held: a pid written by the agent holding it, never a stale one)."""
    found = {}
    agents = os.path.join(root, "agents")
    for name in sorted(os.listdir(agents)) if os.path.isdir(agents) else []:
        try:
            fd = os.open(os.path.join(agents, name, ".lock"), os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # taken: no agent there
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            if text.isdigit():
                found[name] = int(text)
        finally:
            os.close(fd)
    return found


def made_up_id() -> str:
    return f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


class Workspace:
    """The agent's own folder under ``root``, locked while it runs; ``client_id`` None: the
    first id of ``client_ids`` that no running agent holds, else a new one (``.client_id``)."""

    def __init__(self, root: str, client_id: str | None = None):
        if not os.path.isdir(root):
            private_dir(root)
        self.root = root
        agents = private_dir(os.path.join(root, "agents"))
        if client_id is None:
            self.client_id, self.dir, self._lock = self._claim(agents)
        else:
            self.client_id, self.dir, self._lock = client_id, *self._take(agents, client_id)
        self.bundles = private_dir(os.path.join(self.dir, "bundles"))
        self.datasets = os.path.join(self.dir, "datasets")  # the dataset cache's (``datasets.py``)

    @property
    def _ids_path(self) -> str:
        return os.path.join(self.root, "client_ids")

    def _claim(self, agents: str) -> tuple[str, str, int]:
        """An id of this work dir that no running agent holds (its folder's lock taken), else a
        new one, remembered; under a lock of the list, so two agents starting at once differ."""
        fd = os.open(self._ids_path, os.O_RDWR | os.O_CREAT, 0o600)
        with os.fdopen(fd, "r+", encoding="ascii") as ids:
            fcntl.flock(ids, fcntl.LOCK_EX)
            known = ids.read().split()
            for client_id in known:
                folder, lock = self._try(agents, client_id)
                if lock is not None:
                    return client_id, folder, lock
            client_id = made_up_id()
            ids.write(client_id + "\n")
            ids.flush()
            folder, lock = self._try(agents, client_id)
            return client_id, folder, lock

    def renamed(self, old: str, new: str) -> None:
        """The server holds another secret for ``old`` (``Identity.renew``): remember ``new`` in its
        place, so that the next start registers as ``new``, with the secret kept for it."""
        try:
            fd = os.open(self._ids_path, os.O_RDWR)
        except FileNotFoundError:
            return
        with os.fdopen(fd, "r+", encoding="ascii") as ids:
            fcntl.flock(ids, fcntl.LOCK_EX)
            known = ids.read().split()
            if old in known:
                ids.seek(0)
                ids.truncate()
                ids.write("".join(f"{new if c == old else c}\n" for c in known))

    @staticmethod
    def _try(agents: str, name: str) -> tuple[str, int | None]:
        """The folder of ``name`` and its lock, or None when another agent holds it. The lock file
        holds the pid of the agent that holds it (``running_agents``)."""
        folder = private_dir(os.path.join(agents, name))
        lock = os.open(os.path.join(folder, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock)
            return folder, None
        os.ftruncate(lock, 0)
        os.pwrite(lock, f"{os.getpid()}\n".encode(), 0)
        return folder, lock

    def _take(self, agents: str, client_id: str) -> tuple[str, int]:
        """The folder of a given id; another agent of it running here: one beside it."""
        name = client_id
        while True:
            folder, lock = self._try(agents, name)
            if lock is not None:
                break
            name = f"{client_id}-{uuid.uuid4().hex[:6]}"  # another agent of this id runs on this work dir
        if name != client_id:
            log.warning("gpu-client %s: another agent of this id uses %s; this one keeps its files in %s",
                        client_id, os.path.join(agents, client_id), folder)
        return folder, lock

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
                raise OSError(f"{what} arrived corrupted (sha256 mismatch)")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path

    def close(self) -> None:
        """The agent stops: let the folder go (its caches stay for its next start)."""
        try:
            os.close(self._lock)
        except OSError:
            pass
