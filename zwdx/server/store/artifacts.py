"""What every artifact store is (``ArtifactStore``: the bytes of bundles, checkpoints and weights)
and how bytes go in (``copy_hashed``: in chunks, the size limit and the sha256 checked on the
way). The stores: files in the data dir (``zwdx.server.artifacts.FileArtifactStore``), GridFS
(``gridfs.py``)."""
from __future__ import annotations

import abc
import hashlib
import time
from typing import BinaryIO, Iterator

from ... import defaults
from ...errors import IntegrityError, PayloadTooLarge


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
