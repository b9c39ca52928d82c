"""A room's datasets as the store keeps them: what ``datasets.py`` (the routes) and ``api.py``
(a job's submit) read.

Every piece is an artifact of the room (``job_id`` None), so it counts against the room's quota
and the sweeper leaves it alone (a dataset stays until ``zwdx data rm``):

    dataset_chunk   a chunk of a file's bytes; its ``sha256`` is its name
    dataset         a version: the manifest's canonical JSON (``zwdx.protocol.dataset.Manifest``);
                    its ``sha256`` is the version, and its record says ``name``, ``data_size``
                    (the files' bytes) and ``files`` (how many)

A dataset's versions are the room's ``dataset`` artifacts of that name, the newest first; a job
pins the newest at submit (``pin``).
"""
from __future__ import annotations

import functools

from ..errors import BadRequest
from ..protocol import ArtifactKind
from ..protocol.dataset import DatasetPin, DatasetUrl, DatasetVersion, Manifest, is_url, url_name, valid_name

CHUNK = ArtifactKind.DATASET_CHUNK.value
VERSION = ArtifactKind.DATASET.value


def versions(store, room_id: str, name: str | None = None) -> list[dict]:
    """The room's dataset versions (of ``name``), the newest first."""
    found = [a for a in store.list_room_artifacts(room_id, VERSION) if name is None or a.get("name") == name]
    return sorted(found, key=lambda a: a["created_at"], reverse=True)


def view(record: dict) -> DatasetVersion:
    return DatasetVersion(name=record["name"], version=record["sha256"], size=int(record.get("data_size") or 0),
                          files=int(record.get("files") or 0), created_at=record["created_at"])


def read(artifacts, record: dict) -> Manifest:
    """The manifest a version's artifact holds (JSON, as the server wrote it); read once per
    artifact (a version never changes, and artifact ids are never reused)."""
    return _read(artifacts, record["id"])


@functools.lru_cache(maxsize=32)
def _read(artifacts, artifact_id: str) -> Manifest:
    return Manifest.model_validate_json(b"".join(artifacts.open(artifact_id)))


def chunks_of(artifacts, record: dict) -> frozenset[str]:
    """The chunks a version names."""
    return _chunks(artifacts, record["id"])


@functools.lru_cache(maxsize=32)
def _chunks(artifacts, artifact_id: str) -> frozenset[str]:
    return frozenset(c for f in _read(artifacts, artifact_id).files for c in f.chunks)


def pin(store, room_id: str, refs: list) -> list[DatasetPin]:
    """What a job's ``datasets`` name, pinned now: a room dataset's newest version, or a URL.
    A name the room has no dataset of is a ``BadRequest`` naming it (and the field), as are two
    datasets that would share a folder in ``data_dir``."""
    pins: list[DatasetPin] = []
    for i, ref in enumerate(refs):
        field = f"datasets.{i}"
        if isinstance(ref, DatasetUrl):
            pins.append(DatasetPin(name=ref.name or url_name(ref.url), url=ref.url, sha256=ref.sha256))
        elif is_url(ref):
            try:
                url = DatasetUrl(url=ref)
            except Exception:
                raise BadRequest(f"field '{field}': {ref[:100]!r} is not an http(s):// or s3:// URL",
                                 field=field) from None
            pins.append(DatasetPin(name=url_name(url.url), url=url.url))
        else:
            found = versions(store, room_id, ref) if valid_name(ref) else []
            if not found:
                raise BadRequest(f"field '{field}': this room has no dataset {ref[:100]!r} (zwdx data push DIR "
                                 f"--name {ref[:100]}; zwdx data list shows the room's)", field=field, dataset=ref[:100])
            latest = found[0]
            pins.append(DatasetPin(name=ref, version=latest["sha256"], size=int(latest.get("data_size") or 0)))
    names = [p.name for p in pins]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise BadRequest(f"field 'datasets': two datasets would share the folder {twice[0]!r} of data_dir (give a "
                         f"URL's dataset another name: {{\"url\": ..., \"name\": ...}})", field="datasets")
    return pins


def describe(manifest: Manifest) -> dict:
    """A version's files as ``zwdx data show`` prints them: path and size (the chunks left out)."""
    return {"chunk_bytes": manifest.chunk_bytes,
            "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in manifest.files]}
