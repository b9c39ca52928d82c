"""A room's datasets from the SDK: ``ZWDX.push_dataset`` (what ``zwdx data push`` calls),
``list_datasets``, ``get_dataset``, ``remove_dataset``; and the check a submit makes of the
datasets a job names (``check_datasets``).

    zwdx = ZWDX("http://server:4461", room_token=SUBMITTER_TOKEN)
    zwdx.push_dataset("./data", "digits")              # chunks the room lacks, then the manifest
    zwdx.submit_job(model, loader, train, datasets=["digits"])   # loader(data_dir): data_dir/digits/...

A push reads the folder's regular files (symbolic links are left out), cuts each into chunks of
``chunk_bytes``, hashes them (sha256), asks the room which chunks it lacks and uploads only
those, with a progress bar; then it sends the manifest (``zwdx.protocol.dataset.Manifest``),
which makes the version. A push cut short resumes where it stopped: the chunks the room has
are not sent again. The same files again make no new version.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

from . import defaults
from .errors import BadRequest
from .protocol.base import parse
from .protocol.dataset import DatasetUrl, Manifest, is_url, valid_name


@dataclass
class Scanned:
    """A folder as a push reads it: the manifest, and where each chunk's bytes lie."""
    manifest: Manifest
    #: chunk sha256 -> (file, offset, length): one place each
    places: dict[str, tuple[str, int, int]] = field(default_factory=dict)


def scan(folder: str, name: str, chunk_bytes: int = defaults.DATASET_CHUNK_BYTES, bar=None) -> Scanned:
    """Every regular file under ``folder``, hashed whole and chunk by chunk."""
    if not valid_name(name):
        raise BadRequest(f"name must be letters, digits, '.', '_' or '-' (64 at most, a letter or digit first), got "
                         f"{name!r}", field="name")
    if not os.path.isdir(folder):
        raise BadRequest(f"{folder!r} is not a folder: zwdx data push takes a folder", field="path")
    if not 1 <= chunk_bytes <= defaults.MAX_DATASET_CHUNK_BYTES:
        raise BadRequest(f"chunk_bytes must be from 1 to {defaults.MAX_DATASET_CHUNK_BYTES}", field="chunk_bytes")
    files, places = [], {}
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        for fname in sorted(names):
            path = os.path.join(root, fname)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            rel = os.path.relpath(path, folder).replace(os.sep, "/")
            whole, chunks, offset = hashlib.sha256(), [], 0
            with open(path, "rb") as fh:
                for block in iter(lambda: fh.read(chunk_bytes), b""):
                    whole.update(block)
                    sha = hashlib.sha256(block).hexdigest()
                    chunks.append(sha)
                    places.setdefault(sha, (path, offset, len(block)))
                    offset += len(block)
                    if bar is not None:
                        bar.update(len(block))
            files.append({"path": rel, "size": offset, "sha256": whole.hexdigest(), "chunks": chunks})
    manifest = parse(Manifest, {"name": name, "chunk_bytes": chunk_bytes, "files": files}, "dataset")
    return Scanned(manifest, places)


def _folder_bytes(folder: str) -> int:
    total = 0
    for root, _, names in os.walk(folder):
        for fname in names:
            path = os.path.join(root, fname)
            if not os.path.islink(path) and os.path.isfile(path):
                total += os.path.getsize(path)
    return total


class Datasets:
    """The dataset calls of one ``ZWDX`` (which exposes them as its own methods)."""

    def __init__(self, sdk):
        self.sdk = sdk

    def _missing(self, token: str, chunks: list[str]) -> list[str]:
        missing = []
        step = defaults.MAX_DATASET_CHUNK_QUERY
        for start in range(0, len(chunks), step):
            missing += self.sdk._json("POST", "/datasets/chunks/missing", token,
                                      json={"chunks": chunks[start:start + step]})["missing"]
        return missing

    def _upload(self, token: str, scanned: Scanned, missing: list[str], bar=None) -> int:
        sent = 0
        for sha in missing:
            path, offset, length = scanned.places[sha]
            with open(path, "rb") as fh:
                fh.seek(offset)
                block = fh.read(length)
            if hashlib.sha256(block).hexdigest() != sha:
                raise BadRequest(f"{path} changed while it was pushed: push again", field="path")
            self.sdk._json("PUT", f"/datasets/chunks/{sha}", token, data=block,
                           headers={defaults.SHA256_HEADER: sha, "Content-Type": "application/octet-stream"},
                           timeout=max(self.sdk.timeout, 600))
            sent += length
            if bar is not None:
                bar.update(length)
        return sent

    def push(self, folder: str, name: str, room_token: str | None = None, progress: bool = True,
             chunk_bytes: int = defaults.DATASET_CHUNK_BYTES) -> dict:
        from tqdm.auto import tqdm
        token = self.sdk._token(room_token)
        with tqdm(total=_folder_bytes(folder) if os.path.isdir(folder) else 0, desc=f"{name}: hashing", unit="B",
                  unit_scale=True, disable=not progress) as bar:
            scanned = scan(folder, name, chunk_bytes, bar)
        chunks = list(dict.fromkeys(c for f in scanned.manifest.files for c in f.chunks))
        missing = self._missing(token, chunks)
        sent = 0
        with tqdm(total=sum(scanned.places[c][2] for c in missing), desc=f"{name}: uploading", unit="B",
                  unit_scale=True, disable=not progress) as bar:
            sent += self._upload(token, scanned, missing, bar)
        body, path = scanned.manifest.model_dump(mode="json"), f"{defaults.API_PREFIX}/datasets"
        try:
            resp = self.sdk._request("POST", path, token, json=body)
        except BadRequest as err:  # chunks removed meanwhile (zwdx data rm of another dataset): send them
            again = [c for c in err.context.get("missing") or [] if c in scanned.places]
            if not again:
                raise
            sent += self._upload(token, scanned, again)
            resp = self.sdk._request("POST", path, token, json=body)
        view = resp.json()
        return {"name": name, "version": scanned.manifest.version(), "files": len(scanned.manifest.files),
                "size": scanned.manifest.size, "chunks": len(chunks), "uploaded_chunks": len(missing),
                "uploaded_bytes": sent, "new_version": resp.status_code == 201, "versions": len(view["versions"])}

    def list(self, room_token: str | None = None) -> list[dict]:
        return self.sdk._json("GET", "/datasets", self.sdk._token(room_token))["datasets"]

    def get(self, name: str, room_token: str | None = None) -> dict:
        return self.sdk._json("GET", f"/datasets/{name}", self.sdk._token(room_token))

    def remove(self, name: str, room_token: str | None = None) -> dict:
        return self.sdk._json("DELETE", f"/datasets/{name}", self.sdk._token(room_token))


def check_datasets(sdk, token: str, datasets) -> list:
    """A job's ``datasets`` as they travel (names, URLs, ``{"url", "sha256", "name"}``), each name
    one the room has: a ``BadRequest`` naming the first it has not, before anything is uploaded."""
    if datasets is None:
        return []
    if isinstance(datasets, (str, dict)):
        datasets = [datasets]
    out, names = [], []
    for i, ref in enumerate(datasets):
        if isinstance(ref, dict):
            out.append(parse(DatasetUrl, ref, f"datasets.{i}").model_dump(exclude_none=True))
        elif isinstance(ref, str) and ref:
            out.append(ref)
            if not is_url(ref):
                names.append((i, ref))
        else:
            raise BadRequest(f"datasets.{i} must be a dataset's name, a URL or {{'url': ..., 'sha256': ...}}, got "
                             f"{ref!r}", field=f"datasets.{i}")
    if names:
        have = {d["name"] for d in Datasets(sdk).list(token)}
        for i, name in names:
            if name not in have:
                raise BadRequest(f"field 'datasets.{i}': this room has no dataset {name!r} (zwdx data push DIR --name "
                                 f"{name}; zwdx data list shows the room's)", field=f"datasets.{i}", dataset=name)
    return out
