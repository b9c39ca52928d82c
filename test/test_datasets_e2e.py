"""Datasets on donors end to end (issue 16): a real server, one CPU GPU-client process with a
small dataset cache (``--dataset-cache-bytes``), shared by the module's cases in order:

- scikit-learn's digits, split into several files (one in a subfolder), pushed in small chunks;
  a job whose loader reads them from ``data_dir`` trains; the server served the dataset's bytes
  once (``zwdx_dataset_bytes_served`` on ``/metrics``);
- a second job hits the cache: no byte served again; it also names a tar.gz by URL, fetched by
  the GPU client from a local HTTP server with the sha256 the submitter gave (loopback, which the
  donor allows with ``--dataset-allow-net``: refused by default, test/security/test_dataset_fetch.py);
- a cache entry corrupted on the donor's disk is fetched again, never used (the loader checks
  the bytes it reads); the URL's entry is used from the cache (one GET in all);
- a name the room has no dataset of: refused at submit, naming it, nothing stored;
- a URL at an address the donor did not allow (127.0.0.2): the job fails naming it, unfetched;
- a push cut short resumes (only the chunks the room lacks travel); ``zwdx data list|show|rm``;
- a dataset that does not fit beside the others evicts the least recently used (the job runs);
  one larger than the whole cache fails its job with that reason;
- a script job (``zwdx run --dataset``) reads ``$ZWDX_DATA_DIR``.
"""
from __future__ import annotations

import hashlib
import http.server
import io
import os
import re
import subprocess
import sys
import tarfile
import threading

import numpy as np
import pytest
import requests
import torch
import torch.nn as nn
import torch.nn.functional as F

from procs import ROOT, SLACK, GpuClient, Server, wait_until
import zwdx
from zwdx import ZWDX
from zwdx.errors import BadRequest, JobFailed
from zwdx.testing import child_env

pytestmark = pytest.mark.slow

#: The GPU client's dataset cache: digits (about 470 kB) and the URL's few kB fit beside "noise"
#: (900 kB) only once digits is evicted; "huge" never fits.
CACHE_BYTES = 1_300_000
JOB_TIME = 240 + SLACK


def digits_folder(path) -> str:
    """Digits as float32 images in three files, labels in one, a note in a subfolder: the
    sha256 over the images' bytes, in order, is what a loader must find."""
    from sklearn.datasets import load_digits
    digits = load_digits()
    images = digits.images.astype(np.float32) / 16.0
    os.makedirs(path / "meta")
    for i, part in enumerate(np.array_split(images, 3)):
        np.save(path / f"images-{i}.npy", part)
    np.save(path / "labels.npy", digits.target.astype(np.int64))
    (path / "meta" / "README").write_text("scikit-learn's digits, split in three\n")
    return hashlib.sha256(images.tobytes()).hexdigest()


def make_loader(expected: str, url_name: str | None = None):
    """A loader that reads digits from ``data_dir`` and refuses bytes that are not digits' (and,
    with ``url_name``, checks the URL's files are there)."""
    def loader(rank, world_size, data_dir):
        import hashlib
        import os

        import numpy as np
        import torch
        from torch.utils.data import DataLoader, TensorDataset
        root = os.path.join(data_dir, "digits")
        images = np.concatenate([np.load(os.path.join(root, f"images-{i}.npy")) for i in range(3)])
        if hashlib.sha256(images.tobytes()).hexdigest() != expected:
            raise RuntimeError("the digits this job read are not the dataset's")
        assert open(os.path.join(root, "meta", "README")).read().startswith("scikit-learn")
        if url_name:
            assert open(os.path.join(data_dir, url_name, "extra", "hello.txt")).read() == "hello from a URL\n"
        labels = np.load(os.path.join(root, "labels.npy"))
        data = TensorDataset(torch.from_numpy(images).flatten(1), torch.from_numpy(labels))
        return DataLoader(data, batch_size=256)
    return loader


def noise_loader(data_dir):
    import os

    import torch
    from torch.utils.data import DataLoader, TensorDataset
    raw = open(os.path.join(data_dir, "noise", "noise.bin"), "rb").read()
    x = torch.frombuffer(bytearray(raw[:64 * 100]), dtype=torch.uint8).float().reshape(100, 64) / 255
    return DataLoader(TensorDataset(x, torch.zeros(100, dtype=torch.long)), batch_size=50)


def train(model, loader, optimizer):
    loss = torch.tensor(0.0)
    for x, y in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    return loss.item()


def count(model, loader):
    return {"samples": float(sum(len(y) for _, y in loader))}


class Counting(http.server.SimpleHTTPRequestHandler):
    gets = 0

    def do_GET(self):
        type(self).gets += 1
        super().do_GET()

    def log_message(self, *args):
        pass


class World:
    def __init__(self, base):
        self.base = base
        self.server = Server(str(base / "server"))
        self.sdk = ZWDX(self.server.url, remember=False)
        room = self.sdk.create_room("datasets")
        self.sdk.room_token = room["submitter_token"]
        self.token_file = base / "token"
        self.token_file.write_text(room["submitter_token"] + "\n")
        self.client = GpuClient(self.server.url, room["donor_token"], str(base / "donor"), client_id="donor",
                                # the URL's server is on loopback, which a donor must allow (refused by default)
                                extra=["--dataset-cache-bytes", str(CACHE_BYTES), "--dataset-allow-net", "127.0.0.1"])
        self.cache = base / "donor" / "agents" / "donor" / "datasets"
        wait_until(lambda: any(c["status"] == "online" for c in self.sdk.get_room()["clients"]), 30 + SLACK,
                   what=f"the gpu client online\n{self.client.tail()}")
        # a URL's dataset: a tar.gz on a local HTTP server that counts its GETs
        www = base / "www"
        os.makedirs(www)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            body = b"hello from a URL\n"
            info = tarfile.TarInfo("extra/hello.txt")
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
        (www / "extra.tar.gz").write_bytes(buf.getvalue())
        self.url_sha = hashlib.sha256(buf.getvalue()).hexdigest()
        handler = lambda *a, **k: Counting(*a, directory=str(www), **k)  # noqa: E731
        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/extra.tar.gz"

    def served(self) -> float:
        text = requests.get(f"{self.server.url}/metrics", timeout=10).text
        return sum(float(v) for v in re.findall(r'^zwdx_dataset_bytes_served_total\{[^}]*\} (\S+)$', text, re.M))

    def submit(self, loader, datasets, **kwargs):
        model = nn.Sequential(nn.Linear(64, 10))
        wait_until(lambda: all(s["job_id"] is None for c in self.sdk.get_room()["clients"] for s in c["slots"]),
                   30 + SLACK, what="the slot free")
        return self.sdk.submit_job(model, loader, train, eval_func=count,
                                   optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                   resources=zwdx.Resources(world_size=1),
                                   run=zwdx.Run(progress=False, timeout=JOB_TIME, datasets=datasets), **kwargs)

    def stop(self):
        self.http.shutdown()
        self.client.stop()
        self.server.stop()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = World(tmp_path_factory.mktemp("datasets"))
    yield w
    w.stop()


@pytest.fixture(scope="module")
def digits(world, tmp_path_factory):
    folder = tmp_path_factory.mktemp("digits")
    expected = digits_folder(folder)
    pushed = world.sdk.push_dataset(str(folder), "digits", progress=False, chunk_bytes=64 * 1024)
    return pushed, expected, folder


def cli(world, tmp_path, *args: str) -> str:
    """``zwdx ARGS`` as a user types it, with the room's token file: its stdout."""
    env = child_env({"PYTHONPATH": ROOT, "ZWDX_CONFIG_DIR": str(tmp_path / "config")})
    done = subprocess.run([sys.executable, "-m", "zwdx.cli", *args, "--server", world.server.url,
                           "--room-token-file", str(world.token_file)], env=env, capture_output=True, text=True,
                          timeout=60 + SLACK)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_pushed_dataset_is_read_by_a_job_and_then_served_from_the_cache(world, digits, tmp_path):
    pushed, expected, folder = digits
    assert pushed["files"] == 5 and pushed["new_version"] and pushed["chunks"] > 5  # files of several chunks
    assert pushed["uploaded_bytes"] == pushed["size"]
    again = world.sdk.push_dataset(str(folder), "digits", progress=False, chunk_bytes=64 * 1024)
    assert (again["new_version"], again["uploaded_bytes"], again["version"]) == (False, 0, pushed["version"])

    before = world.served()
    first = world.submit(make_loader(expected), ["digits"])
    assert first["status"] == "completed" and first["results"]["samples"] == 1797.0
    assert world.served() - before == pushed["size"]  # every file's bytes, once
    assert world.sdk.get_job(first["job_id"])["spec"]["datasets"][0]["version"] == pushed["version"]

    # the second job: digits from the cache (nothing served), the URL fetched by the GPU client itself
    second = world.submit(make_loader(expected, "extra"), ["digits", {"url": world.url, "sha256": world.url_sha}])
    assert second["status"] == "completed", second
    assert world.served() - before == pushed["size"]
    assert Counting.gets == 1
    shown = cli(world, tmp_path, "jobs", "show", second["job_id"])
    assert f"digits ({pushed['version'][:12]}), extra ({world.url})" in shown


def test_a_corrupted_cache_entry_is_fetched_again_never_used(world, digits):
    pushed, expected, _ = digits
    victim = world.cache / pushed["version"] / "files" / "images-1.npy"
    os.chmod(victim, 0o644)
    raw = bytearray(victim.read_bytes())
    raw[-100:] = bytes(100)  # same size, other bytes
    victim.write_bytes(bytes(raw))
    before = world.served()
    result = world.submit(make_loader(expected, "extra"), ["digits", {"url": world.url, "sha256": world.url_sha}])
    assert result["status"] == "completed", result  # the loader refuses bytes that are not digits'
    assert world.served() - before == pushed["size"]  # fetched again
    assert Counting.gets == 1  # the URL's entry was sound: from the cache
    assert "is corrupted" in world.client.output()


def test_an_unknown_dataset_is_refused_at_submit(world):
    jobs = len(world.sdk.list_jobs())
    with pytest.raises(BadRequest) as err:
        world.submit(make_loader("x"), ["digits", "nope"])
    assert "nope" in err.value.message and err.value.context["field"] == "datasets.1"
    bundle = world.sdk._json("POST", "/artifacts", world.sdk.room_token, data=b"a bundle")
    with pytest.raises(BadRequest) as err:  # the server's own check, for a client that skips the SDK's
        world.sdk._json("POST", "/jobs", world.sdk.room_token, json={
            "bundle_artifact": bundle["id"], "versions": {"python": "3.11.7"}, "datasets": ["nope"]})
    assert "'nope'" in err.value.message and err.value.context["field"] == "datasets.0"
    assert len(world.sdk.list_jobs()) == jobs


def test_a_url_at_an_address_the_donor_did_not_allow_fails_the_job_unfetched(world, tmp_path):
    """Issue 29 H3 through the agent: the donor allows 127.0.0.1 only; a job names a server on
    127.0.0.2 (standing in for a cloud's metadata service or a LAN's admin page)."""
    class Secret(Counting):
        gets = 0
    (tmp_path / "meta-data.txt").write_text("the donor's instance credentials\n")
    site = http.server.ThreadingHTTPServer(("127.0.0.2", 0), lambda *a, **k: Secret(*a, directory=str(tmp_path), **k))
    threading.Thread(target=site.serve_forever, daemon=True).start()
    try:
        with pytest.raises(JobFailed) as err:
            world.submit(make_loader("x"), [{"url": f"http://127.0.0.2:{site.server_address[1]}/meta-data.txt"}])
    finally:
        site.shutdown()
        site.server_close()
    assert "127.0.0.2" in str(err.value) and "--dataset-allow-net" in str(err.value), str(err.value)
    assert Secret.gets == 0


def test_an_interrupted_push_resumes_and_zwdx_data_lists_shows_removes(world, tmp_path):
    from zwdx.datasets import Datasets, scan
    folder = tmp_path / "parts"
    folder.mkdir()
    for i in range(4):
        (folder / f"part-{i}.bin").write_bytes(os.urandom(3000))
    scanned = scan(str(folder), "parts", chunk_bytes=1000)
    chunks = [c for f in scanned.manifest.files for c in f.chunks]
    Datasets(world.sdk)._upload(world.sdk.room_token, scanned, chunks[:5])  # a push cut short after 5 chunks
    pushed = world.sdk.push_dataset(str(folder), "parts", progress=False, chunk_bytes=1000)
    assert (pushed["chunks"], pushed["uploaded_chunks"], pushed["uploaded_bytes"]) == (12, 7, 7000)

    def zwdx(*args: str) -> str:
        return cli(world, tmp_path, *args)
    import json
    listed = {d["name"]: d for d in json.loads(zwdx("data", "list", "--json"))}
    assert listed["parts"]["latest"]["version"] == pushed["version"] and listed["parts"]["latest"]["files"] == 4
    assert "part-3.bin" in zwdx("data", "show", "parts")
    assert json.loads(zwdx("data", "rm", "parts", "--json"))["versions"] == 1
    assert "parts" not in zwdx("data", "list")


def test_a_full_cache_evicts_the_least_recently_used_and_refuses_what_never_fits(world, digits, tmp_path):
    pushed, _, _ = digits
    (tmp_path / "noise").mkdir()
    (tmp_path / "noise" / "noise.bin").write_bytes(os.urandom(900_000))
    (tmp_path / "huge").mkdir()
    (tmp_path / "huge" / "noise.bin").write_bytes(os.urandom(CACHE_BYTES + 1))
    world.sdk.push_dataset(str(tmp_path / "noise"), "noise", progress=False)
    world.sdk.push_dataset(str(tmp_path / "huge"), "huge", progress=False)

    result = world.submit(noise_loader, ["noise"])
    assert result["status"] == "completed", result
    assert not (world.cache / pushed["version"]).exists()  # digits went: the least recently used
    assert sum(f.stat().st_size for f in world.cache.rglob("*") if f.is_file()) <= CACHE_BYTES

    with pytest.raises(JobFailed) as err:
        world.submit(noise_loader, ["huge"])
    assert "dataset cache" in str(err.value) and "--dataset-cache-bytes" in str(err.value), str(err.value)


def test_a_script_job_reads_zwdx_data_dir(world, digits, tmp_path):
    (tmp_path / "read.py").write_text(
        "import os\n"
        "root = os.path.join(os.environ['ZWDX_DATA_DIR'], 'digits')\n"
        "print('files:', sorted(os.listdir(root)))\n")
    wait_until(lambda: all(s["job_id"] is None for c in world.sdk.get_room()["clients"] for s in c["slots"]),
               30 + SLACK, what="the slot free")
    env = child_env({"PYTHONPATH": ROOT, "ZWDX_CONFIG_DIR": str(tmp_path / "config")})
    done = subprocess.run([sys.executable, "-m", "zwdx.cli", "run", "--server", world.server.url, "--room-token-file",
                           str(world.token_file), "--nproc", "1", "--dataset", "digits", "--outputs", "", "read.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=JOB_TIME)
    assert done.returncode == 0, done.stderr
    assert "files: ['images-0.npy', 'images-1.npy', 'images-2.npy', 'labels.npy', 'meta']" in done.stdout
