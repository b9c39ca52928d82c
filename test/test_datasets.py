"""A room's datasets through the REST API, in process (``zwdx/server/datasets.py``): versions,
what a manifest may say, quotas, pins at submit, removal, the sweeper; and the SDK's and the
GPU client's pure parts (``zwdx.datasets.scan``, ``gpu_client.agent.datasets.DatasetCache``).
End to end with processes: ``test_datasets_e2e.py``."""
from __future__ import annotations

import hashlib
import json
import os

import pytest

from zwdx.datasets import scan
from zwdx.protocol.dataset import DatasetPin, url_name


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def push(api, name: str, files: dict[str, bytes], chunk: int = 4) -> object:
    """Upload the chunks the room lacks, then the manifest (what ``zwdx data push`` does)."""
    entries, chunks = [], {}
    for path, data in files.items():
        parts = [data[i:i + chunk] for i in range(0, len(data), chunk)]
        chunks.update({sha(p): p for p in parts})
        entries.append({"path": path, "size": len(data), "sha256": sha(data), "chunks": [sha(p) for p in parts]})
    missing = api.post("/datasets/chunks/missing", json={"chunks": list(chunks)}).json["missing"]
    for digest in missing:
        assert api.put(f"/datasets/chunks/{digest}", data=chunks[digest]).status_code == 201
    return api.post("/datasets", json={"name": name, "chunk_bytes": chunk, "files": entries})


def usage(api) -> int:
    return api.get("/room").json["usage"]["artifact_bytes"]


def test_versions_by_name_and_only_the_missing_chunks_travel(api):
    first = push(api, "digits", {"a.txt": b"hello world", "sub/b.txt": b"hello"})
    assert first.status_code == 201, first.text
    version = first.json["latest"]["version"]
    assert first.json["latest"]["files"] == 2 and first.json["latest"]["size"] == 16
    # the same files again: that version (200), nothing new stored
    before = usage(api)
    again = push(api, "digits", {"a.txt": b"hello world", "sub/b.txt": b"hello"})
    assert (again.status_code, again.json["latest"]["version"], usage(api)) == (200, version, before)
    # chunks the room has are not asked for again: "hell" and "o" of b.txt are a.txt's too
    asked = api.post("/datasets/chunks/missing", json={"chunks": [sha(b"hell"), sha(b"new!")]}).json
    assert asked == {"missing": [sha(b"new!")]}
    second = push(api, "digits", {"a.txt": b"hello world!"})
    assert second.status_code == 201
    shown = api.get("/datasets/digits").json
    assert [v["version"] for v in shown["versions"]] == [second.json["latest"]["version"], version]
    assert [f["path"] for f in shown["manifest"]["files"]] == ["a.txt"]
    assert [d["name"] for d in api.get("/datasets").json["datasets"]] == ["digits"]


@pytest.mark.parametrize("change, field", [
    (lambda m: m["files"][0].update(path="../etc/passwd"), "files.0.path"),
    (lambda m: m["files"][0].update(path="/abs"), "files.0.path"),
    (lambda m: m["files"].append(dict(m["files"][0])), "files"),
    (lambda m: m["files"].append({**m["files"][0], "path": "a.txt/x"}), "files"),
    (lambda m: m["files"][0].update(size=3), "files.0.size"),
    (lambda m: m["files"][0]["chunks"].append("ab" * 32), "files"),
    (lambda m: m.update(name="../x"), "name"),
])
def test_a_wrong_manifest_is_refused_naming_the_field_and_stores_nothing(api, change, field):
    data = b"abcdefgh"
    assert api.put(f"/datasets/chunks/{sha(data)}", data=data).status_code == 201
    manifest = {"name": "d", "chunk_bytes": 8, "files": [{"path": "a.txt", "size": 8, "sha256": sha(data),
                                                          "chunks": [sha(data)]}]}
    change(manifest)
    before = usage(api)
    resp = api.post("/datasets", json=manifest)
    assert resp.status_code == 400, resp.text
    assert resp.json["error"]["field"] == field, resp.json
    assert usage(api) == before and api.get("/datasets").json["datasets"] == []


def test_a_chunk_must_be_its_sha256_and_within_the_quota(make_app):
    from conftest import Api
    api = Api(make_app(ROOM_MAX_ARTIFACT_BYTES=100).test_client()).create_room()
    resp = api.put(f"/datasets/chunks/{sha(b'other')}", data=b"these bytes")
    assert resp.status_code == 422 and usage(api) == 0
    assert api.put(f"/datasets/chunks/{sha(b'x' * 90)}", data=b"x" * 90).status_code == 201
    resp = api.put(f"/datasets/chunks/{sha(b'y' * 20)}", data=b"y" * 20)
    assert resp.status_code == 429 and resp.json["error"]["code"] == "quota_exceeded"
    assert usage(api) == 90


def test_a_job_pins_the_newest_version_and_an_unknown_name_is_refused(api):
    version = push(api, "digits", {"a": b"1234"}).json["latest"]["version"]
    jobs = len(api.jobs())
    resp = api.submit(datasets=["digits", "nope"])
    assert resp.status_code == 400 and resp.json["error"]["field"] == "datasets.1"
    assert "'nope'" in resp.json["error"]["message"] and len(api.jobs()) == jobs
    resp = api.submit(datasets=["digits", "digits"])
    assert resp.status_code == 400 and resp.json["error"]["field"] == "datasets"
    resp = api.submit(datasets=["digits", "https://example.org/data/imagenet.tar.gz",
                                {"url": "s3://bucket/x.bin", "sha256": "ab" * 32, "name": "x"}])
    assert resp.status_code == 201, resp.text
    pins = [DatasetPin.model_validate(p) for p in resp.json["spec"]["datasets"]]
    assert [(p.name, p.version, p.url) for p in pins] == [
        ("digits", version, None), ("imagenet", None, "https://example.org/data/imagenet.tar.gz"),
        ("x", None, "s3://bucket/x.bin")]
    # a newer version does not change what the job pinned
    push(api, "digits", {"a": b"5678"})
    job = api.get(f"/jobs/{resp.json['id']}").json
    assert job["spec"]["datasets"][0]["version"] == version


def test_removal_waits_for_the_jobs_that_use_it_and_keeps_shared_chunks(api):
    push(api, "one", {"a": b"shared!!only-one"}, chunk=8)
    push(api, "two", {"b": b"shared!!"}, chunk=8)
    job = api.submit(datasets=["one"]).json
    resp = api.request("DELETE", "/datasets/one")
    assert resp.status_code == 409 and job["id"] in resp.json["error"]["message"]
    assert api.post(f"/jobs/{job['id']}/cancel").status_code == 200
    before = usage(api)
    resp = api.request("DELETE", "/datasets/one")
    assert resp.status_code == 200 and resp.json["versions"] == 1
    assert usage(api) == before - resp.json["bytes_freed"]
    assert api.get("/datasets/one").status_code == 404
    missing = api.post("/datasets/chunks/missing", json={"chunks": [sha(b"shared!!"), sha(b"only-one")]}).json
    assert missing == {"missing": [sha(b"only-one")]}  # "two" still names the shared chunk


def test_the_sweeper_leaves_datasets_alone(app, api):
    push(api, "digits", {"a": b"1234"})
    before = usage(api)
    app.extensions["zwdx"].sweeper.sweep(now=1e12)
    assert usage(api) == before and api.get("/datasets/digits").status_code == 200


def test_a_job_reads_only_what_it_pins(app):
    from conftest import placed_job
    room, rank, job = placed_job(app, "pins")
    version = push(room, "digits", {"a": b"1234"}).json["latest"]["version"]
    resp = rank.get(f"/jobs/{job['id']}/datasets/{version}")
    assert resp.status_code == 404  # the job names no dataset
    resp = rank.get(f"/jobs/{job['id']}/datasets/{version}/chunks/{sha(b'1234')}")
    assert resp.status_code == 404


# -- the SDK's and the GPU client's pure parts --------------------------------------------------------
def test_scan_cuts_files_into_chunks_and_names_them_relatively(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.bin").write_bytes(b"x" * 10)
    (tmp_path / "a.txt").write_bytes(b"")
    os.symlink("/etc/passwd", tmp_path / "link")
    scanned = scan(str(tmp_path), "d", chunk_bytes=4)
    files = {f.path: f for f in scanned.manifest.files}
    assert sorted(files) == ["a.txt", "sub/b.bin"]  # no symbolic link
    assert files["sub/b.bin"].chunks == [sha(b"xxxx"), sha(b"xxxx"), sha(b"xx")] and files["a.txt"].chunks == []
    with pytest.raises(Exception, match="name"):
        scan(str(tmp_path), "../d")


def test_url_names():
    assert url_name("https://x.org/a/digits.tar.gz?token=1") == "digits"
    assert url_name("s3://bucket/train.bin") == "train.bin"
    assert url_name("https://x.org/") == "x.org"


def test_the_cache_evicts_the_least_recently_used_and_refuses_what_never_fits(tmp_path):
    from gpu_client.agent.datasets import DatasetCache, DatasetTooLarge
    cache = DatasetCache(str(tmp_path / "cache"), limit=100)
    for key, age in (("old", 10), ("new", 20)):
        entry = tmp_path / "cache" / key
        (entry / "files").mkdir(parents=True)
        (entry / "files" / "f").write_bytes(b"x" * 40)
        (entry / "manifest.json").write_text(json.dumps({"files": [{"path": "f", "size": 40, "sha256": sha(b"x" * 40)}]}))
        os.utime(entry, (age, age))
    with pytest.raises(DatasetTooLarge, match="dataset-cache-bytes"):
        cache._make_room(101, "dataset 'big'")
    assert sorted(cache.entries()) == ["new", "old"]  # nothing evicted for what never fits
    cache._make_room(50, "dataset 'mid'")
    assert sorted(cache.entries()) == ["new"]
    # an entry whose file changed is deleted on use, never returned
    (tmp_path / "cache" / "new" / "files" / "f").write_bytes(b"y" * 40)
    assert cache._verified("new", pinned=False) is None and cache.entries() == {}
