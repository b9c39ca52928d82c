"""Datasets a room keeps for its jobs (``zwdx data push``), and those a job names by URL.

A pushed dataset is a folder cut into content-addressed chunks (each stored once per room, by
its sha256) and a ``Manifest``: the folder's files by relative path, each with its size, its
sha256 and the chunks it is made of, in order. The manifest travels and is stored as JSON (never
pickled); its own sha256, over its canonical JSON (``Manifest.canonical``), is the version of the
dataset: pushing the same name again with other files makes a new version, and a job pins the
version its name had at submit (``DatasetPin``).

A job names its datasets at submit (``SubmitJob.datasets``): a room dataset's name, or a URL
(``https://``, ``http://``, ``s3://``, fetched by the GPU clients themselves through fsspec),
given as a string or as ``DatasetUrl`` with the sha256 its bytes must have. Each GPU client
fetches them into its dataset cache before the job's code runs; the job reads them under one
directory, one folder per dataset, named after it (``data_dir``, ``$ZWDX_DATA_DIR``).
"""
from __future__ import annotations

import hashlib
import json
import posixpath
import re
from typing import Annotated, Any

from pydantic import Field, StringConstraints, field_validator

from .. import defaults
from .base import Answer, Bytes, Count, Message

#: A dataset's name in its room (and its folder in a job's ``data_dir``).
DatasetName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
#: A sha256, as 64 lowercase hex digits.
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
#: A URL a GPU client fetches a dataset from.
Url = Annotated[str, StringConstraints(min_length=8, max_length=2048, pattern=r"^(https?|s3)://\S+$")]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def is_url(ref: str) -> bool:
    """Whether a job's dataset reference is a URL rather than a room dataset's name."""
    return "://" in ref


def url_name(url: str) -> str:
    """The folder a URL's dataset gets in ``data_dir``: its file's name without an archive's
    extension (``.../digits.tar.gz`` -> ``digits``), made a valid ``DatasetName``."""
    base = posixpath.basename(url.split("?", 1)[0].split("#", 1)[0].rstrip("/")) or "data"
    for ext in (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar"):
        if base.lower().endswith(ext) and len(base) > len(ext):
            base = base[:-len(ext)]
            break
    base = re.sub(r"[^A-Za-z0-9._-]", "_", base).lstrip("._-")[:64] or "data"
    return base


class ManifestFile(Message):
    """One file of a dataset: where it lies in the folder, and its bytes."""
    #: Relative, with ``/`` between parts; no ``..``, no empty or absolute part.
    path: Annotated[str, StringConstraints(min_length=1, max_length=1024)]
    size: Bytes
    sha256: Sha256
    #: The sha256 of each chunk of its bytes, in order (none for an empty file).
    chunks: Annotated[list[Sha256], Field(max_length=1_000_000)]

    @field_validator("path")
    @classmethod
    def _relative(cls, value: str) -> str:
        parts = value.split("/")
        if value.startswith("/") or "\\" in value or "\x00" in value or \
                any(part in ("", ".", "..") for part in parts):
            raise ValueError("must be a relative path with '/' between its parts, none of them '', '.' or '..'")
        return value


class Manifest(Message):
    """``POST /api/v1/datasets``: a version of a room dataset, once the room has its chunks."""
    name: DatasetName
    #: The size the files were cut at (every chunk but a file's last has it).
    chunk_bytes: Annotated[int, Field(ge=1, le=defaults.MAX_DATASET_CHUNK_BYTES)]
    files: Annotated[list[ManifestFile], Field(max_length=defaults.MAX_DATASET_FILES)]

    @field_validator("files")
    @classmethod
    def _distinct(cls, files: list[ManifestFile]) -> list[ManifestFile]:
        seen: set[str] = set()
        dirs: set[str] = set()
        for f in files:
            if f.path in seen:
                raise ValueError(f"{f.path!r} is there twice")
            seen.add(f.path)
            parts = f.path.split("/")
            dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
        both = seen & dirs
        if both:
            raise ValueError(f"{sorted(both)[0]!r} is both a file and a folder")
        return files

    def canonical(self) -> bytes:
        """The JSON this version is stored as (sorted keys, no spaces): its sha256 is its version."""
        doc = {"name": self.name, "chunk_bytes": self.chunk_bytes,
               "files": sorted((f.model_dump() for f in self.files), key=lambda f: f["path"])}
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    def version(self) -> str:
        return hashlib.sha256(self.canonical()).hexdigest()

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


class ChunkQuery(Message):
    """``POST /api/v1/datasets/chunks/missing``: which of these chunks the room lacks."""
    chunks: Annotated[list[Sha256], Field(max_length=defaults.MAX_DATASET_CHUNK_QUERY)]


class MissingChunks(Answer):
    missing: list[str]


class DatasetVersion(Answer):
    """One version of a room dataset."""
    name: str
    #: The sha256 of its manifest.
    version: str
    size: int
    files: int
    created_at: float


class DatasetView(Answer):
    """A room dataset: its newest version first among ``versions``; ``manifest`` (its files) in
    ``GET /api/v1/datasets/<name>`` only."""
    name: str
    latest: DatasetVersion
    versions: list[DatasetVersion]
    manifest: dict[str, Any] | None = None


class DatasetList(Answer):
    datasets: list[DatasetView]


class DatasetRemoved(Answer):
    name: str
    versions: int
    #: Bytes the room keeps no more (chunks no other version names, and the manifests).
    bytes_freed: int


class DatasetUrl(Message):
    """A dataset a job names by URL: the GPU clients fetch it themselves (fsspec). A tar archive
    (``.tar``, ``.tar.gz``, ``.tgz``, ``.tar.bz2``, ``.tar.xz``) is unpacked; any other file is
    kept as it is, under its own name. ``sha256``: what the fetched bytes must hash to."""
    url: Url
    sha256: Sha256 | None = None
    #: Its folder in ``data_dir``; default: the URL's file name without the archive's extension.
    name: DatasetName | None = None


#: What ``SubmitJob.datasets`` holds: room datasets' names, URLs, or ``DatasetUrl``.
DatasetRef = Annotated[str, StringConstraints(min_length=1, max_length=2048)] | DatasetUrl


class DatasetPin(Answer):
    """A dataset as a job's record pins it at submit, and as its GPU clients fetch it: a room
    dataset's ``version`` (its manifest's sha256), or a ``url``."""
    #: Its folder in the job's ``data_dir``.
    name: str
    version: str | None = None
    size: Count | None = None
    url: str | None = None
    sha256: str | None = None


def valid_name(name: str) -> bool:
    return bool(_NAME.match(name))


__all__ = ["DatasetName", "Sha256", "Url", "ManifestFile", "Manifest", "ChunkQuery", "MissingChunks",
           "DatasetVersion", "DatasetView", "DatasetList", "DatasetRemoved", "DatasetUrl", "DatasetRef", "DatasetPin",
           "is_url", "url_name", "valid_name"]
