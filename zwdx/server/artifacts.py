"""Artifact bytes: job bundles, checkpoints and trained weights.

Bytes never sit in database documents or Socket.IO events: they stream over HTTP into an
``ArtifactStore`` (files in the data dir by default, GridFS with MongoDB), with a sha256
computed on the way in and checked against the one the sender announced. Metadata lives in
the ``Store``.
"""
from __future__ import annotations

import os
import tempfile
import time

from .. import defaults
from .store.artifacts import ArtifactStore, copy_hashed


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
