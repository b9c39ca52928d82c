"""Artifact bytes: job bundles, checkpoints and trained weights.

Bytes never sit in database documents or Socket.IO events: they stream over HTTP into an
``ArtifactStore`` (files in the data dir by default, GridFS with MongoDB), with a sha256
computed on the way in and checked against the one the sender announced. Metadata lives in
the ``Store``.
"""
from __future__ import annotations

import abc
import hashlib
import os
import tempfile
import time
from typing import BinaryIO, Iterator

from .. import defaults
from ..errors import IntegrityError, PayloadTooLarge


class ArtifactStore(abc.ABC):
    """Where artifact bytes live."""

    @abc.abstractmethod
    def save(self, artifact_id: str, stream: BinaryIO, max_bytes: int,
             expected_sha256: str | None = None) -> tuple[int, str]:
        """Copy ``stream`` in chunks; return ``(size, sha256)``. Raises PayloadTooLarge past
        ``max_bytes`` and IntegrityError on a sha256 mismatch; nothing is kept then."""

    @abc.abstractmethod
    def open(self, artifact_id: str) -> Iterator[bytes]:
        """The artifact's bytes, in chunks."""

    @abc.abstractmethod
    def delete(self, artifact_id: str) -> None:
        """Remove the bytes (no error if already gone)."""

    @abc.abstractmethod
    def stored(self, before: float) -> list[str]:
        """The ids of the complete artifacts written before then (unix time)."""

    @abc.abstractmethod
    def discard_partial(self, before: float) -> int:
        """Remove what uploads cut short before then left (a server killed mid-upload): how many."""


def copy_hashed(stream: BinaryIO, sink: BinaryIO, max_bytes: int, expected_sha256: str | None,
                chunk: int = defaults.CHUNK_BYTES) -> tuple[int, str]:
    """Copy ``stream`` to ``sink`` chunk by chunk, enforcing the size limit and the sha256."""
    digest, size = hashlib.sha256(), 0
    while True:
        block = stream.read(chunk)
        if not block:
            break
        size += len(block)
        if size > max_bytes:
            raise PayloadTooLarge(f"artifact larger than the limit of {max_bytes} bytes",
                                  limit=max_bytes)
        digest.update(block)
        sink.write(block)
        time.sleep(0)  # under gevent: the server's other requests (heartbeats) run between two chunks
    sha = digest.hexdigest()
    if expected_sha256 and sha != expected_sha256.lower():
        raise IntegrityError(f"artifact sha256 mismatch: announced {expected_sha256}, received {sha}",
                             expected=expected_sha256, received=sha)
    return size, sha


class FileArtifactStore(ArtifactStore):
    """One file per artifact under ``<data_dir>/artifacts``; written to a temporary file and
    renamed into place, so a half-received upload never looks complete."""

    #: What a file being received is called until it is complete.
    PARTIAL = ".upload-"

    def __init__(self, root: str):
        self.root = root
        os.makedirs(root, mode=0o700, exist_ok=True)

    def _path(self, artifact_id: str) -> str:
        if not artifact_id.replace("-", "").isalnum():
            raise ValueError(f"bad artifact id {artifact_id!r}")
        return os.path.join(self.root, artifact_id)

    def save(self, artifact_id, stream, max_bytes, expected_sha256=None):
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=self.PARTIAL)
        try:
            with os.fdopen(fd, "wb") as sink:
                result = copy_hashed(stream, sink, max_bytes, expected_sha256)
            os.replace(tmp, self._path(artifact_id))
            return result
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def open(self, artifact_id):
        path = self._path(artifact_id)
        fh = open(path, "rb")  # raises FileNotFoundError before the response starts

        def chunks():
            with fh:
                while True:
                    block = fh.read(defaults.CHUNK_BYTES)
                    if not block:
                        return
                    yield block
                    time.sleep(0)  # as in copy_hashed
        return chunks()

    def delete(self, artifact_id):
        try:
            os.unlink(self._path(artifact_id))
        except FileNotFoundError:
            pass

    def _files(self, before: float, partial: bool) -> list[str]:
        out = []
        with os.scandir(self.root) as entries:
            for entry in entries:
                try:
                    if entry.name.startswith(self.PARTIAL) == partial and entry.is_file() and \
                            entry.stat().st_mtime < before:
                        out.append(entry.name)
                except FileNotFoundError:
                    pass  # deleted meanwhile
        return out

    def stored(self, before):
        return self._files(before, partial=False)

    def discard_partial(self, before):
        gone = 0
        for name in self._files(before, partial=True):
            try:
                os.unlink(os.path.join(self.root, name))
                gone += 1
            except FileNotFoundError:
                pass
        return gone
