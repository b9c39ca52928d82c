"""Artifact bytes in MongoDB's GridFS, for the MongoDB store (``zwdx server --mongo-uri``)."""
from __future__ import annotations

import logging
from datetime import datetime, timezone

from bson import Binary, Int64
from pymongo import ASCENDING, MongoClient
from pymongo.errors import PyMongoError

from ... import defaults
from ...errors import StoreError
from .artifacts import ArtifactStore, copy_hashed
from .mongo_db import connect, describe

log = logging.getLogger(__name__)


class GridFSArtifactStore(ArtifactStore):
    """Artifact bytes in the GridFS bucket ``artifacts``: the GridFS layout (a ``files``
    document, ``chunks`` numbered from 0), so mongofiles and GridFSBucket read them too.

    Written and read ``WINDOW`` chunks (1 MiB) at a time, whatever the artifact's size:
    pymongo's GridIn holds up to 48 MB of an upload before it writes, and a reading cursor
    a whole batch. The ``files`` document is written last, so a file is visible only once
    complete; a failed upload removes its chunks."""

    BUCKET = "artifacts"
    CHUNK = 256 * 1024
    WINDOW = defaults.CHUNK_BYTES // CHUNK

    def __init__(self, uri: str, client: MongoClient | None = None):
        self.where = describe(uri)
        self._client, self.db = connect(uri, client)
        self._files, self._chunks = self.db[f"{self.BUCKET}.files"], self.db[f"{self.BUCKET}.chunks"]
        try:
            self._chunks.create_index([("files_id", ASCENDING), ("n", ASCENDING)], unique=True)
            self._files.create_index([("filename", ASCENDING), ("uploadDate", ASCENDING)])
        except PyMongoError as exc:
            raise StoreError(f"cannot prepare GridFS at {self.where}: {exc}") from exc

    def save(self, artifact_id, stream, max_bytes, expected_sha256=None):
        sink = _ChunkWriter(self._chunks, artifact_id, self.CHUNK)
        try:
            size, sha = copy_hashed(stream, sink, max_bytes, expected_sha256)
            sink.finish()
            self._files.insert_one({"_id": artifact_id, "filename": artifact_id, "length": Int64(size),
                                    "chunkSize": self.CHUNK, "uploadDate": datetime.now(timezone.utc),
                                    "metadata": {"sha256": sha}})
            return size, sha
        except BaseException as exc:
            self._discard(artifact_id)
            if isinstance(exc, PyMongoError):
                raise StoreError(f"cannot store artifact {artifact_id} in GridFS: {exc}") from exc
            raise

    def _discard(self, artifact_id: str) -> None:
        try:
            self._remove(artifact_id)
        except PyMongoError as exc:
            log.warning("artifacts: chunks of failed upload %s could not be removed: %s", artifact_id, exc)

    def _remove(self, artifact_id: str) -> None:
        if self._files.find_one({"_id": artifact_id}, {"_id": 1}) is not None:
            self._files.delete_one({"_id": artifact_id})  # invisible first, then the bytes
        self._chunks.delete_many({"files_id": artifact_id})

    def open(self, artifact_id):
        try:
            meta = self._files.find_one({"_id": artifact_id})
        except PyMongoError as exc:
            raise StoreError(f"cannot read artifact {artifact_id} from GridFS: {exc}") from exc
        if meta is None:
            raise FileNotFoundError(f"no artifact {artifact_id} in GridFS")
        count = -(-int(meta["length"]) // int(meta["chunkSize"]))

        def chunks():
            n = 0
            while n < count:
                window = self._chunks.find({"files_id": artifact_id, "n": {"$gte": n, "$lt": n + self.WINDOW}},
                                           sort=[("n", ASCENDING)])
                blocks = []
                for doc in window:
                    if doc["n"] != n:
                        break
                    blocks.append(bytes(doc["data"]))
                    n += 1
                if not blocks:
                    raise StoreError(f"artifact {artifact_id} in GridFS lacks chunk {n} of {count}",
                                     artifact_id=artifact_id)
                yield b"".join(blocks)
        return chunks()

    def delete(self, artifact_id):
        try:
            self._remove(artifact_id)
        except PyMongoError as exc:
            raise StoreError(f"cannot delete artifact {artifact_id} from GridFS: {exc}") from exc

    def stored(self, before):
        when = datetime.fromtimestamp(before, timezone.utc)
        try:
            return [d["_id"] for d in self._files.find({"uploadDate": {"$lt": when}}, {"_id": 1})]
        except PyMongoError as exc:
            raise StoreError(f"cannot list GridFS at {self.where}: {exc}") from exc

    def discard_partial(self, before):
        """Chunks whose ``files`` document never came, the last written before then (a chunk's
        ObjectId says when it was made)."""
        try:
            started = {d["files_id"] for d in self._chunks.find({"n": 0}, {"files_id": 1})}
            complete = {d["_id"] for d in self._files.find({"_id": {"$in": list(started)}}, {"_id": 1})}
            gone = 0
            for file_id in started - complete:
                last = self._chunks.find_one({"files_id": file_id}, {"_id": 1}, sort=[("n", -1)])
                made = getattr(last and last["_id"], "generation_time", None)
                if last is not None and (made is None or made.timestamp() < before):
                    self._chunks.delete_many({"files_id": file_id})
                    gone += 1
            return gone
        except PyMongoError as exc:
            raise StoreError(f"cannot clean GridFS at {self.where}: {exc}") from exc

    def close(self) -> None:
        self._client.close()


class _ChunkWriter:
    """A file-like sink that writes GridFS chunks as soon as they are full."""

    def __init__(self, chunks, file_id: str, chunk_size: int):
        self.chunks, self.file_id, self.chunk_size = chunks, file_id, chunk_size
        self.buffer, self.n = bytearray(), 0

    def write(self, data: bytes) -> None:
        self.buffer += data
        self._flush(len(self.buffer) - len(self.buffer) % self.chunk_size)

    def finish(self) -> None:
        self._flush(len(self.buffer))

    def _flush(self, upto: int) -> None:
        if upto <= 0:
            return
        docs = [{"files_id": self.file_id, "n": self.n + i, "data": Binary(bytes(self.buffer[o:o + self.chunk_size]))}
                for i, o in enumerate(range(0, upto, self.chunk_size))]
        self.chunks.insert_many(docs)
        self.n += len(docs)
        del self.buffer[:upto]
