"""A job's dataset URL is fetched by the GPU client's agent (root on the donor's machine, outside
any rank's egress rules): issue 29's H3 and L1, replayed against ``gpu_client.agent.datasets``'s cache
with HTTP servers on loopback (``gpu_client/agent/fetch.py``).

- H3: a URL naming a loopback, private or link-local address (written out, IPv4-mapped, or a
  name that resolves to one), or redirecting there from an allowed server, is refused unless the
  donor allows that network (``--dataset-allow-net``); the refused server sees no request.
  ``s3://`` goes anonymous unless the donor lends their credentials.
- L1: a tar bomb (a 200 MB member of zeros in a gzip of well under 1 MB) is refused against a
  cache of a few MB before a byte of it is written; links and too many entries are refused too.
"""
from __future__ import annotations

import hashlib
import importlib
import http.server
import io
import os
import socket
import tarfile
import threading

import pytest

from gpu_client.agent.datasets import DatasetCache, DatasetTooLarge
from gpu_client.agent.fetch import DatasetRefused, FetchPolicy, parse_nets
from zwdx.protocol.dataset import DatasetPin

MiB = 1024**2
LOOPBACK = FetchPolicy(parse_nets(["127.0.0.1/32"]))


class Site:
    """An HTTP server on ``host`` serving ``routes`` (path -> bytes, or ("redirect", URL)),
    counting the requests it got."""

    def __init__(self, host: str, routes: dict):
        self.routes, self.requests = routes, 0
        site = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, body: bool):
                site.requests += 1
                route = site.routes.get(self.path.split("?")[0])
                if route is None:
                    self.send_error(404)
                elif isinstance(route, tuple):
                    self.send_response(302)
                    self.send_header("Location", route[1])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                else:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(route)))
                    self.send_header("ETag", hashlib.sha256(route).hexdigest()[:16])
                    self.end_headers()
                    if body:
                        self.wfile.write(route)

            def do_GET(self):
                self._answer(True)

            def do_HEAD(self):
                self._answer(False)

            def log_message(self, *args):
                pass

        self.http = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def url(self, path: str, host: str | None = None) -> str:
        return f"http://{host or self.http.server_address[0]}:{self.port}{path}"

    def close(self):
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def sites():
    made = []
    yield lambda host, routes: made.append(Site(host, routes)) or made[-1]
    for site in made:
        site.close()


def fetch(cache: DatasetCache, url: str, sha256: str | None = None):
    return cache.lend([DatasetPin(name="d", url=url, sha256=sha256)], lambda p: None)[0]


def left_in(cache_dir) -> list[str]:
    return sorted(os.listdir(cache_dir))


# -- H3: where a URL may lead ------------------------------------------------------------------------
def test_a_loopback_url_is_refused_by_default_and_fetched_once_the_donor_allows_it(sites, tmp_path):
    site = sites("127.0.0.1", {"/secret.txt": b"the donor's metadata service"})
    default = DatasetCache(str(tmp_path / "default"), 10 * MiB)
    for url in (site.url("/secret.txt"), site.url("/secret.txt", "[::ffff:127.0.0.1]")):
        with pytest.raises(DatasetRefused, match="--dataset-allow-net"):
            fetch(default, url)
    assert site.requests == 0 and left_in(tmp_path / "default") == []
    allowed = DatasetCache(str(tmp_path / "allowed"), 10 * MiB, LOOPBACK)
    got = fetch(allowed, site.url("/secret.txt"))
    assert open(os.path.join(got.path, "secret.txt"), "rb").read() == b"the donor's metadata service"


def test_a_name_that_resolves_to_loopback_is_refused(sites, tmp_path):
    site = sites("127.0.0.1", {"/x.bin": b"x"})
    with pytest.raises(DatasetRefused, match="localhost resolves to .*not a public one"):
        fetch(DatasetCache(str(tmp_path / "c"), MiB), site.url("/x.bin", "localhost"))
    assert site.requests == 0


def test_a_redirect_from_an_allowed_server_to_a_refused_address_is_not_followed(sites, tmp_path):
    inner = sites("127.0.0.2", {"/admin": b"a LAN admin page"})
    outer = sites("127.0.0.1", {"/data.bin": ("redirect", inner.url("/admin")),
                                "/named.bin": ("redirect", inner.url("/admin", "localhost"))})
    cache = DatasetCache(str(tmp_path / "c"), MiB, LOOPBACK)  # 127.0.0.1 only, not 127.0.0.2
    with pytest.raises(DatasetRefused, match="127.0.0.2"):
        fetch(cache, outer.url("/data.bin"))
    assert outer.requests >= 1 and inner.requests == 0 and left_in(tmp_path / "c") == []
    # the donor allows the whole loopback network: the same redirect is followed
    wide = DatasetCache(str(tmp_path / "w"), MiB, FetchPolicy(parse_nets("127.0.0.0/8")))
    assert open(os.path.join(fetch(wide, outer.url("/data.bin")).path, "data.bin"), "rb").read() == b"a LAN admin page"


def test_the_resolver_hands_aiohttp_only_the_addresses_it_checked():
    """A name resolving to a public and a private address: aiohttp connects only to the public
    one it was given (no second lookup a rebinding name could answer differently)."""
    import asyncio

    from gpu_client.agent.fetch import Fetcher, _Resolver

    class Inner:
        async def resolve(self, host, port, family):
            return [{"hostname": host, "host": addr, "port": port, "family": socket.AF_INET, "proto": 0, "flags": 0}
                    for addr in ("169.254.169.254", "93.184.216.34", "10.0.0.1")]

    resolver = _Resolver(Fetcher(FetchPolicy()), Inner())
    assert [r["host"] for r in asyncio.run(resolver.resolve("rebind.example", 80))] == ["93.184.216.34"]


@pytest.mark.parametrize("allowed", ["", "10.0.0.0/8", "not-a-net"])
def test_the_donors_setting_parses_or_names_what_is_wrong(allowed):
    if allowed == "not-a-net":
        with pytest.raises(ValueError, match="'not-a-net' is not a network"):
            parse_nets(allowed)
        return
    policy = FetchPolicy(parse_nets(allowed))
    assert (policy.refusal("10.1.2.3") is None) == bool(allowed)
    assert policy.refusal("169.254.169.254") and policy.refusal("::1") and policy.refusal("64:ff9b::a9fe:a9fe")
    assert policy.refusal("8.8.8.8") is None and policy.refusal("2001:4860:4860::8888") is None


def test_s3_is_anonymous_unless_the_donor_lends_their_credentials(tmp_path, monkeypatch):
    from fsspec.spec import AbstractFileSystem

    class FakeS3(AbstractFileSystem):
        protocol = "s3"
        made: list[dict] = []

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            FakeS3.made.append(kwargs)

        def info(self, path, **kwargs):
            return {"name": path, "size": 4, "type": "file", "ETag": "e"}

        def _open(self, path, mode="rb", **kwargs):
            return io.BytesIO(b"data")

    monkeypatch.setitem(importlib.import_module("fsspec.registry")._registry, "s3", FakeS3)
    fetch(DatasetCache(str(tmp_path / "anon"), MiB), "s3://bucket/train.bin")
    fetch(DatasetCache(str(tmp_path / "lent"), MiB, FetchPolicy(s3_credentials=True)), "s3://bucket/train.bin")
    assert [m.get("anon") for m in FakeS3.made] == [True, False]


# -- L1: what an archive may unpack to -------------------------------------------------------------------
class Zeros(io.RawIOBase):
    def __init__(self, n: int):
        self.left = n

    def readable(self):
        return True

    def readinto(self, buf):
        n = min(len(buf), self.left)
        buf[:n] = bytes(n)
        self.left -= n
        return n


def tar_gz(entries) -> bytes:
    """A tar.gz of ``entries``: (TarInfo, file object or None)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
        for info, data in entries:
            tar.addfile(info, data)
    return buf.getvalue()


@pytest.fixture
def written(monkeypatch):
    """Bytes the unpacking wrote into regular files (tarfile writes each one's in ``makefile``)."""
    count = {"bytes": 0}
    real = tarfile.TarFile.makefile

    def makefile(self, tarinfo, targetpath):
        count["bytes"] += tarinfo.size
        return real(self, tarinfo, targetpath)
    monkeypatch.setattr(tarfile.TarFile, "makefile", makefile)
    return count


def test_a_tar_bomb_is_refused_before_it_is_written(sites, tmp_path, written):
    big = tarfile.TarInfo("bomb/zeros.bin")
    big.size = 200 * MiB
    small = tarfile.TarInfo("bomb/readme.txt")
    small.size = 5
    bomb = tar_gz([(small, io.BytesIO(b"hello")), (big, Zeros(big.size))])
    assert len(bomb) < MiB
    site = sites("127.0.0.1", {"/bomb.tar.gz": bomb})
    cache = DatasetCache(str(tmp_path / "c"), 4 * MiB, LOOPBACK)
    with pytest.raises(DatasetTooLarge) as refused:
        fetch(cache, site.url("/bomb.tar.gz"))
    assert written["bytes"] <= 4 * MiB, f"{written['bytes']} bytes unpacked into a cache of 4 MiB"
    assert "unpacks to more than 4194304 bytes" in str(refused.value) and left_in(tmp_path / "c") == []


def test_links_devices_and_too_many_entries_are_refused_naming_the_entry(sites, tmp_path, monkeypatch, written):
    link = tarfile.TarInfo("d/passwd")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    hard = tarfile.TarInfo("d/hard")
    hard.type, hard.linkname = tarfile.LNKTYPE, "d/a"
    fifo = tarfile.TarInfo("d/fifo")
    fifo.type = tarfile.FIFOTYPE
    plain = tarfile.TarInfo("d/a")
    plain.size = 1
    site = sites("127.0.0.1", {
        "/link.tar.gz": tar_gz([(plain, io.BytesIO(b"a")), (link, None)]),
        "/hard.tar.gz": tar_gz([(plain, io.BytesIO(b"a")), (hard, None)]),
        "/fifo.tar.gz": tar_gz([(fifo, None)]),
        "/many.tar.gz": tar_gz([(tarfile.TarInfo(f"d/{i}"), None) for i in range(12)])})
    cache = DatasetCache(str(tmp_path / "c"), MiB, LOOPBACK)
    for name, entry in (("link", "d/passwd"), ("hard", "d/hard"), ("fifo", "d/fifo")):
        with pytest.raises(DatasetRefused, match=f"entry '{entry}' is not a file or a folder"):
            fetch(cache, site.url(f"/{name}.tar.gz"))
    monkeypatch.setattr("gpu_client.agent.fetch.MAX_MEMBERS", 10)
    with pytest.raises(DatasetTooLarge, match="more than 10 entries"):
        fetch(cache, site.url("/many.tar.gz"))
    assert written["bytes"] == 0 and left_in(tmp_path / "c") == []


def test_a_download_longer_than_it_said_or_than_the_cache_stops_at_the_bound(tmp_path):
    """No Content-Length: the bytes are counted as they arrive, and the fetch stops past the cache."""
    class Endless(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def do_HEAD(self):
            self.send_response(200)
            self.end_headers()

        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            try:
                for _ in range(64):
                    self.wfile.write(bytes(MiB))
            except OSError:
                pass

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Endless)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cache = DatasetCache(str(tmp_path / "c"), 2 * MiB, LOOPBACK)
        with pytest.raises(DatasetTooLarge, match="sent more than"):
            fetch(cache, f"http://127.0.0.1:{server.server_address[1]}/stream.bin")
    finally:
        server.shutdown()
        server.server_close()
    assert left_in(tmp_path / "c") == []


@pytest.mark.parametrize("how", ["flag", "env"])
def test_the_gpu_client_refuses_to_start_with_a_network_it_cannot_read(how, monkeypatch, capsys):
    from zwdx import cli
    monkeypatch.setenv("ZWDX_ROOM_TOKEN", "zd_not-used")
    args = ["gpu-client", "--server", "http://127.0.0.1:9", "--cpu"]
    if how == "flag":
        args += ["--dataset-allow-net", "10.0.0.0/8", "--dataset-allow-net", "10.0.0.300"]
    else:
        monkeypatch.setenv("ZWDX_DATASET_ALLOW_NETS", "10.0.0.0/8,10.0.0.300")
    assert cli.main(args) == 2
    assert "--dataset-allow-net: '10.0.0.300' is not a network" in capsys.readouterr().err
