"""A GPU client's dataset cache: the datasets its jobs name, fetched once, kept across jobs.

    <agent dir>/datasets/                  (0700; ``workspace.py``)
        <key>/manifest.json                what the files must be: path, size, sha256 of each
        <key>/files/<path>                 the files (0444)
        .<key>.<random>.part/              an entry being fetched (never used; dropped on failure)

An entry's key is a room dataset's version (the sha256 of its manifest, which the cached
``manifest.json`` must hash to) or, for a URL, the sha256 of the URL with its ETag (or
Last-Modified), size and the sha256 the submitter gave: the same URL with new bytes is another
entry. Every use hashes every file again against the manifest; an entry that is not what it
says (a file changed, cut short, gone) is deleted and fetched again, never used.

The cache holds at most ``limit`` bytes (``zwdx gpu-client --dataset-cache-bytes``) and never
fills the disk: to make room, the least recently used entries go first; a dataset larger than
the limit, or than the disk can hold once every other entry went, fails the job with that
reason (``DatasetTooLarge``) before a byte is fetched.

A job's datasets reach its ranks as ``<sandbox>/data/<name>/...`` (``share``): each file a hard
link to the cache's (a read-only copy across file systems, ``isolation.share``), in folders the
ranks may read and not change.

A room dataset is fetched with one of the job's rank keys (``zwdx/server/datasets.py``), chunk
by chunk, each checked against its sha256; a URL through fsspec (``https://``, ``http://``,
``s3://`` with s3fs installed) within what the donor allows it to reach (``fetch.py``: no
private or local address unless ``--dataset-allow-net`` names it, redirects checked, S3
anonymous), checked against the submitter's sha256 when given, its bytes bounded by the cache
as they arrive; a tar archive's entries are checked (files and folders inside the entry,
tarfile's ``data`` filter) and added up against the cache's bound before one is written.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tarfile
import threading
import time
import uuid
from dataclasses import dataclass

from zwdx import defaults
from zwdx.protocol.dataset import DatasetPin, Manifest

from .fetch import DatasetRefused, DatasetTooLarge, Fetcher, FetchPolicy, unpack

log = logging.getLogger("gpu_client.agent.datasets")

_READ_BYTES = 8 << 20
#: What a tar archive's name ends with (it is unpacked; any other file is kept as it is).
ARCHIVES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")
#: Bytes of the disk left free, whatever the cache's limit.
DISK_RESERVE = 256 * 1024**2


class DatasetCorrupted(Exception):
    """What arrived is not what the manifest (or the submitter's sha256) says."""


@dataclass
class Provided:
    """A dataset ready in the cache: its files' folder, and whether it was fetched for this job."""
    name: str
    path: str
    files: list[str]
    fetched: bool
    size: int


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_READ_BYTES), b""):
            digest.update(block)
    return digest.hexdigest()


def _listing(files: list[dict]) -> bytes:
    return json.dumps({"files": sorted(files, key=lambda f: f["path"])}, sort_keys=True,
                      separators=(",", ":")).encode()


class DatasetCache:
    """The cache under ``root``, at most ``limit`` bytes; one fetch at a time (a lock); URLs
    fetched within ``policy`` (``fetch.py``)."""

    def __init__(self, root: str, limit: int = defaults.DATASET_CACHE_BYTES, policy: FetchPolicy | None = None):
        self.root, self.limit = root, int(limit)
        self.policy = policy or FetchPolicy()
        os.makedirs(root, mode=0o700, exist_ok=True)
        os.chmod(root, 0o700)
        self._lock = threading.Lock()
        for name in os.listdir(root):  # what a killed agent was fetching
            if name.startswith("."):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)

    # -- entries -----------------------------------------------------------------------------------
    def _entry(self, key: str) -> str:
        return os.path.join(self.root, key)

    def entries(self) -> dict[str, tuple[float, int]]:
        """key -> (last used, bytes) of every complete entry."""
        out = {}
        for name in os.listdir(self.root):
            path = self._entry(name)
            if name.startswith(".") or not os.path.isdir(path):
                continue
            try:
                listed = json.loads(open(os.path.join(path, "manifest.json"), "rb").read())
                out[name] = (os.stat(path).st_mtime, sum(int(f["size"]) for f in listed["files"]))
            except (OSError, ValueError, KeyError, TypeError):
                out[name] = (0.0, 0)  # unreadable: the first to go
        return out

    def _drop(self, key: str, why: str) -> None:
        log.warning("gpu-client dataset cache: %s %s: deleted", key[:12], why)
        shutil.rmtree(self._entry(key), ignore_errors=True)

    def _verified(self, key: str, pinned: bool) -> list[dict] | None:
        """The entry's files, each hashed now against its manifest (which a room dataset's key is
        the sha256 of); None when there is no such entry or it is not what it says (deleted)."""
        entry = self._entry(key)
        try:
            raw = open(os.path.join(entry, "manifest.json"), "rb").read()
        except FileNotFoundError:
            if os.path.isdir(entry):
                self._drop(key, "has no manifest")
            return None
        try:
            if pinned and hashlib.sha256(raw).hexdigest() != key:
                raise ValueError("its manifest is not the version it is named after")
            files = json.loads(raw)["files"]
            for f in files:
                path = os.path.join(entry, "files", f["path"])
                if os.path.islink(path) or os.path.getsize(path) != f["size"] or sha256_of(path) != f["sha256"]:
                    raise ValueError(f"file {f['path']!r} is not the one its manifest names")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self._drop(key, f"is corrupted ({exc}), fetched again")
            return None
        os.utime(entry)  # used now: the last to be evicted
        return files

    def _make_room(self, need: int, what: str) -> None:
        """Evict the least recently used entries until ``need`` more bytes fit the limit and
        the disk; ``DatasetTooLarge`` (and nothing evicted) when they never would."""
        if need > self.limit:
            raise DatasetTooLarge(f"{what} is {need} bytes: more than this GPU client's dataset cache holds "
                                  f"({self.limit} bytes, zwdx gpu-client --dataset-cache-bytes)")
        entries = sorted(self.entries().items(), key=lambda kv: kv[1][0])
        used = sum(size for _, (_, size) in entries)
        free = shutil.disk_usage(self.root).free
        if need > free + used - DISK_RESERVE:
            raise DatasetTooLarge(f"{what} is {need} bytes: the disk of this GPU client's dataset cache has "
                                  f"{max(0, free + used - DISK_RESERVE)} bytes for it, even with every other "
                                  f"dataset evicted")
        for key, (_, size) in entries:
            if used + need <= self.limit and need <= free - DISK_RESERVE:
                break
            log.info("gpu-client dataset cache: %s evicted (%d bytes, least recently used) for %s", key[:12], size,
                     what)
            shutil.rmtree(self._entry(key), ignore_errors=True)
            used -= size
            free = shutil.disk_usage(self.root).free

    def _room(self) -> int:
        """Bytes an entry could take with every other one evicted (the disk's reserve kept)."""
        used = sum(size for _, size in self.entries().values())
        return max(0, shutil.disk_usage(self.root).free + used - DISK_RESERVE)

    def _commit(self, key: str, part: str, manifest: bytes) -> None:
        """The fetched entry in place, its files read-only; what was there under its key goes."""
        with open(os.path.join(part, "manifest.json"), "wb") as fh:
            fh.write(manifest)
        for folder, _, names in os.walk(os.path.join(part, "files")):
            for name in names:
                os.chmod(os.path.join(folder, name), 0o444)
        shutil.rmtree(self._entry(key), ignore_errors=True)
        os.replace(part, self._entry(key))

    # -- a job's datasets --------------------------------------------------------------------------
    def lend(self, pins: list[DatasetPin], place, session=None, api: str = "") -> list[Provided]:
        """Each dataset in the cache, verified now (fetched if it is not there or not sound: a
        room dataset with ``session``, holding a rank key of the job, from ``api``, the job's
        URL under the API), and handed to ``place`` at once, before another dataset's room is
        made: what ``place`` linked stays the job's even if it is evicted later."""
        out = []
        with self._lock:
            for pin in pins:
                out.append(self._provide(pin, session, api))
                place(out[-1])
        return out

    def _provide(self, pin: DatasetPin, session, api: str) -> Provided:
        if pin.version:
            key, source = pin.version, None
        else:
            key, source = self._url_key(pin)
        files = self._verified(key, pinned=bool(pin.version))
        fetched = files is None
        if fetched:
            started = time.time()
            files = self._fetch_room(pin, session, api) if pin.version else self._fetch_url(pin, key, source)
            log.info("gpu-client dataset cache: %s (%s) fetched, %d files, %d bytes in %.1fs", pin.name, key[:12],
                     len(files), sum(f["size"] for f in files), time.time() - started)
        return Provided(name=pin.name, path=os.path.join(self._entry(key), "files"),
                        files=[f["path"] for f in files], fetched=fetched, size=sum(f["size"] for f in files))

    def _part(self, key: str) -> str:
        part = os.path.join(self.root, f".{key[:16]}.{uuid.uuid4().hex[:8]}.part")
        os.makedirs(os.path.join(part, "files"), mode=0o700)
        return part

    def _fetch_room(self, pin: DatasetPin, session, api: str) -> list[dict]:
        base = f"{api}/datasets/{pin.version}"
        resp = session.get(base, timeout=60)
        resp.raise_for_status()
        manifest = Manifest.model_validate(resp.json())
        if manifest.version() != pin.version:
            raise DatasetCorrupted(f"dataset {pin.name}: the manifest that arrived is not version {pin.version}")
        self._make_room(manifest.size, f"dataset {pin.name!r}")
        part = self._part(pin.version)
        try:
            for f in manifest.files:
                path = os.path.join(part, "files", f.path)
                os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
                whole = hashlib.sha256()
                with open(path, "wb") as out:
                    for chunk in f.chunks:
                        with session.get(f"{base}/chunks/{chunk}", stream=True, timeout=120) as got:
                            got.raise_for_status()
                            digest = hashlib.sha256()
                            for block in got.iter_content(defaults.CHUNK_BYTES):
                                digest.update(block)
                                whole.update(block)
                                out.write(block)
                        if digest.hexdigest() != chunk:
                            raise DatasetCorrupted(f"dataset {pin.name}: chunk {chunk[:12]} of {f.path!r} arrived "
                                                   f"corrupted (sha256 mismatch)")
                if whole.hexdigest() != f.sha256:
                    raise DatasetCorrupted(f"dataset {pin.name}: file {f.path!r} is not its manifest's (sha256)")
            files = [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in manifest.files]
            self._commit(pin.version, part, manifest.canonical())
        finally:
            shutil.rmtree(part, ignore_errors=True)
        return files

    # -- URLs --------------------------------------------------------------------------------------
    def _url_key(self, pin: DatasetPin) -> tuple[str, dict]:
        """The URL's entry: its ETag (or Last-Modified) and size as the server says them now."""
        fetcher = Fetcher(self.policy)
        with _refusals(fetcher):
            fs, path = fetcher.filesystem(pin.url)  # asked afresh: no listing cached
            info = fs.info(path)
        tag = info.get("ETag") or info.get("etag") or info.get("Last-Modified") or info.get("LastModified") or ""
        size = info.get("size")
        key = hashlib.sha256(f"{pin.url}\n{tag}\n{size}\n{pin.sha256 or ''}".encode()).hexdigest()
        return key, {"fs": fs, "path": path, "size": size, "fetcher": fetcher}

    def _fetch_url(self, pin: DatasetPin, key: str, source: dict) -> list[dict]:
        size, what = source["size"], f"dataset {pin.name!r} ({pin.url})"
        if size is not None:
            self._make_room(int(size), what)
        # what may arrive: the size the server gave, else what the cache could hold
        bound = int(size) if size is not None else min(self.limit, self._room())
        part = self._part(key)
        try:
            download = os.path.join(part, "download")
            digest, got = hashlib.sha256(), 0
            with _refusals(source["fetcher"]), source["fs"].open(source["path"], "rb") as src, \
                    open(download, "wb") as out:
                for block in iter(lambda: src.read(defaults.CHUNK_BYTES), b""):
                    got += len(block)
                    if got > bound:
                        raise DatasetTooLarge(f"{what} sent more than {bound} bytes (the size it gave, or what this "
                                              f"GPU client's dataset cache has room for)")
                    digest.update(block)
                    out.write(block)
            if pin.sha256 and digest.hexdigest() != pin.sha256:
                raise DatasetCorrupted(f"dataset {pin.name} ({pin.url}) arrived with sha256 {digest.hexdigest()}, "
                                       f"not the {pin.sha256} the job names")
            files_dir = os.path.join(part, "files")
            base = pin.url.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1] or "data"
            if base.lower().endswith(ARCHIVES):
                unpack(download, files_dir, self.limit, lambda total: self._make_room(total, f"{what}, unpacked"),
                       what)
                os.unlink(download)
            else:
                os.replace(download, os.path.join(files_dir, base))
            files = []
            for folder, _, names in os.walk(files_dir):
                for name in names:
                    path = os.path.join(folder, name)
                    if os.path.islink(path) or not os.path.isfile(path):
                        continue
                    files.append({"path": os.path.relpath(path, files_dir).replace(os.sep, "/"),
                                  "size": os.path.getsize(path), "sha256": sha256_of(path)})
            if size is None and not base.lower().endswith(ARCHIVES):  # room for what came (unpack made its own)
                self._make_room(sum(f["size"] for f in files), what)
            self._commit(key, part, _listing(files))
        except tarfile.TarError as exc:
            raise DatasetCorrupted(f"dataset {pin.name} ({pin.url}) is not a tar archive it can unpack: {exc}") \
                from None
        finally:
            shutil.rmtree(part, ignore_errors=True)
        return files


@contextlib.contextmanager
def _refusals(fetcher: Fetcher):
    """A request the fetch policy refused, as that refusal (fsspec reports it as a missing file)."""
    try:
        yield
    except DatasetRefused:
        raise
    except Exception as exc:
        if fetcher.refused:
            raise DatasetRefused(fetcher.refused[0]) from None
        raise exc


def share(isolation, box, p: Provided) -> str:
    """A dataset in the job's sandbox, ``<sandbox>/data/<name>/<path>``, read-only to its ranks
    (``data_dir`` names ``<sandbox>/data``): its folder. Written through ``isolation.share``,
    which follows nothing the job's code may have made there (``sandbox.py``)."""
    for rel in p.files:
        isolation.share(os.path.join(p.path, rel), box, f"data/{p.name}/{rel}")
    return isolation.folder(box, f"data/{p.name}")  # an empty dataset, too
