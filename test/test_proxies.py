"""The documented reverse proxies, as written (issue 34 item 2): docs/deploy-tls.md's nginx
server block and docs/deploy-scale.md's HAProxy config, read from the docs with only their
addresses, port and certificate paths changed, run with Debian's nginx and haproxy in front of
one server, TLS ending at the proxy on a port other than 443 with a certificate of a private CA
made here. A GPU client connects through each proxy, the SDK submits through nginx a job that
ranks on both clients run, and reads it back through HAProxy.

Fast tests (in-process) for what the server says: a refused WebSocket origin names the header
to set; requests with X-Forwarded-For and no ``--proxy-hops`` warn, once.
"""
from __future__ import annotations

import datetime
import hashlib
import ipaddress
import logging
import os
import re
import shutil

import pytest
import requests
import torch

from procs import ROOT, GpuClient, Proc, Server, free_port, wait_until
from workloads import logged_steps
import zwdx
from zwdx import ZWDX, defaults, tls

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"


def _recipe(doc: str, starts: str) -> str:
    """The fenced code block of docs/``doc`` whose first line starts with ``starts``."""
    with open(os.path.join(ROOT, "docs", doc), encoding="utf-8") as fh:
        blocks = re.findall(r"```[a-z]*\n(.*?)```", fh.read(), re.S)
    return next(b for b in blocks if b.startswith(starts))


def nginx_conf(folder: str, port: int, upstream: str, pki: dict) -> str:
    """docs/deploy-tls.md's nginx recipe in an http block of its own, on 127.0.0.1:``port``."""
    recipe = _recipe("deploy-tls.md", "map $http_upgrade")
    for old, new in (("listen 443 ssl;", f"listen 127.0.0.1:{port} ssl;"),
                     ("/etc/letsencrypt/live/zwdx.example.org/fullchain.pem", pki["cert"]),
                     ("/etc/letsencrypt/live/zwdx.example.org/privkey.pem", pki["key"]),
                     ("http://127.0.0.1:4461", upstream)):
        assert old in recipe, f"docs/deploy-tls.md's nginx recipe no longer has {old!r}"
        recipe = recipe.replace(old, new)
    temp = "\n".join(f"    {kind}_temp_path {folder}/{kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi",
                                                                         "scgi"))
    return (f"{'user root;' if os.geteuid() == 0 else ''}\nworker_processes 1;\npid {folder}/nginx.pid;\n"
            f"error_log {folder}/error.log;\nevents {{}}\nhttp {{\n    access_log {folder}/access.log;\n{temp}\n"
            f"{recipe}}}\n")


def haproxy_cfg(port: int, upstream: str, pem: str, forwarded_proto: bool = True) -> str:
    """docs/deploy-scale.md's HAProxy config on 127.0.0.1:``port`` with one server, ``upstream``;
    ``forwarded_proto=False``: without its X-Forwarded-Proto line (as the recipe was)."""
    recipe = _recipe("deploy-scale.md", "defaults")
    lines = [line for line in recipe.splitlines() if not re.match(r"\s+server s[2-9] ", line)
             and (forwarded_proto or "X-Forwarded-Proto" not in line)]
    recipe = "\n".join(lines) + "\n"
    for old, new in (("bind :443 ssl crt /etc/haproxy/zwdx.pem", f"bind 127.0.0.1:{port} ssl crt {pem}"),
                     ("10.0.0.10:4461", upstream.split("://", 1)[1])):
        assert old in recipe, f"docs/deploy-scale.md's HAProxy config no longer has {old!r}"
        recipe = recipe.replace(old, new)
    return recipe


def _certificate(subject: str, key, issuer, issuer_key, ca: bool, names=()):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer or name).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A private CA (``ca``) and the proxies' certificate for 127.0.0.1 (``cert``, ``key``, and
    ``pem``: both in one file, as HAProxy takes them)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    folder = tmp_path_factory.mktemp("pki")
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("zwdx proxies test CA", ca_key, None, None, ca=True)
    cert = _certificate("zwdx proxy", key, ca.subject, ca_key, ca=False,
                        names=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    pem = {"ca": ca.public_bytes(serialization.Encoding.PEM), "cert": cert.public_bytes(serialization.Encoding.PEM),
           "key": key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())}
    pem["pem"] = pem["cert"] + pem["key"]
    paths = {}
    for name, data in pem.items():
        paths[name] = str(folder / f"{name}.pem")
        with open(os.open(paths[name], os.O_WRONLY | os.O_CREAT, 0o600), "wb") as fh:
            fh.write(data)
    return paths


class FromAddress(requests.adapters.HTTPAdapter):
    """Connections from a loopback address of our choosing (127.0.0.2, ...): clients the proxy
    and, told of it, the server tell apart."""

    def __init__(self, source: str):
        self.source = source
        super().__init__()

    def init_poolmanager(self, *args, **kwargs):
        super().init_poolmanager(*args, source_address=(self.source, 0), **kwargs)


def session_from(source: str, ca: str) -> requests.Session:
    session = tls.session(ca)  # requests.Session would let $REQUESTS_CA_BUNDLE win over its verify
    session.mount("https://", FromAddress(source))
    return session


def _up(url: str, ca: str, proc: Proc) -> bool:
    if not proc.alive():
        raise RuntimeError(f"{proc.args[0]} exited:\n{proc.output()}")
    try:
        return requests.get(f"{url}/health", verify=ca, timeout=2).status_code == 200
    except requests.RequestException:
        return False


def pairs(rank, world_size):
    from torch.utils.data import DataLoader, TensorDataset
    g = torch.Generator().manual_seed(rank)
    return DataLoader(TensorDataset(torch.randn(8, 2, generator=g), torch.randint(0, 2, (8,), generator=g)),
                      batch_size=4)


@pytest.fixture(scope="module")
def stack(pki, tmp_path_factory):
    """One server (as docs/deploy-tls.md starts it; five wrong tokens an address a minute), nginx and HAProxy
    in front of it as the docs say, a GPU client through each, and one two-rank job submitted
    through nginx."""
    folder = tmp_path_factory.mktemp("proxies")
    procs = []
    try:
        command = _recipe("deploy-tls.md", "zwdx server --host 127.0.0.1 --port 4461").split()
        server = Server(str(folder / "server"), extra=[*command[6:], "--rate-limit-auth-failures", "5 per minute"])
        procs.append(server)
        nginx_port, haproxy_port = free_port(), free_port()
        with open(folder / "nginx.conf", "w") as fh:
            fh.write(nginx_conf(str(folder), nginx_port, server.url, pki))
        with open(folder / "haproxy.cfg", "w") as fh:
            fh.write(haproxy_cfg(haproxy_port, server.url, pki["pem"]))
        procs.append(Proc([NGINX, "-e", str(folder / "error.log"), "-p", str(folder), "-c", str(folder / "nginx.conf"),
                           "-g", "daemon off;"], str(folder / "nginx.log")))
        procs.append(Proc([HAPROXY, "-db", "-f", str(folder / "haproxy.cfg")], str(folder / "haproxy.log")))
        urls = {"nginx": f"https://127.0.0.1:{nginx_port}", "haproxy": f"https://127.0.0.1:{haproxy_port}"}
        for proc, url in zip(procs[1:], urls.values()):
            wait_until(lambda: _up(url, pki["ca"], proc), 30, what=f"{url}\n{proc.output()}")
        sdk = ZWDX(urls["nginx"], ca_file=pki["ca"], remember=False)
        room = sdk.create_room("proxies")
        sdk.room_token = room["token"]
        clients = {name: GpuClient(url, room["donor_token"], str(folder / name), f"via-{name}",
                                   extra=["--ca-file", pki["ca"]]) for name, url in urls.items()}
        procs += clients.values()
        try:
            wait_until(lambda: {c["id"] for c in sdk.get_room()["clients"] if c["status"] == "online"}
                       >= {"via-nginx", "via-haproxy"}, 60, what="GPU clients online through nginx and HAProxy")
        except TimeoutError as exc:  # what they and the server said by then
            raise TimeoutError("\n".join([str(exc), *(c.tail() for c in clients.values()), server.tail()])) from None
        model = torch.nn.Linear(2, 2)
        result = sdk.submit_job(model, pairs, logged_steps, None, torch.optim.SGD(model.parameters(), lr=0.1), "DDP",
                                resources=zwdx.Resources(world_size=2),
                                run=zwdx.Run(progress=False, raise_on_failure=False, timeout=180))
        yield {"server": server, "urls": urls, "room": room, "result": result, "clients": clients, "sdk": sdk,
               "folder": folder}
    finally:
        Proc.stop_all(reversed(procs))


@pytest.mark.slow
def test_nginx_recipe_as_written(stack, pki):
    """Through nginx (TLS on a port not 443): a GPU client connects (its origin carries the port,
    which `Host $host` dropped), the SDK submits a job that completes; the server tells clients
    apart (--proxy-hops), so one address's wrong tokens lock out that address only; /metrics is
    not served through the proxy; a GPU client given http:// for it says it speaks HTTPS."""
    assert stack["result"]["status"] == "completed", stack["result"]
    url = stack["urls"]["nginx"]
    room = stack["room"]
    wrong, right = session_from("127.0.0.2", pki["ca"]), session_from("127.0.0.3", pki["ca"])
    answers = [wrong.get(f"{url}/api/v1/room", headers={defaults.TOKEN_HEADER: "not-a-token"}, timeout=10).status_code
               for _ in range(7)]
    assert answers[-1] == 429, answers
    mine = right.get(f"{url}/api/v1/room", headers={defaults.TOKEN_HEADER: room["token"]}, timeout=10)
    assert mine.status_code == 200  # another address, through the same proxy: not locked out
    assert right.get(f"{url}/metrics", timeout=10).status_code == 403
    assert "X-Forwarded-For" not in stack["server"].output()  # told of the proxy: no warning

    plain = GpuClient(url.replace("https://", "http://"), room["donor_token"], str(stack["folder"] / "plain"), "plain")
    try:  # http:// to the HTTPS port: it says so and stops, rather than retrying for ever
        assert plain.wait(60) == 2, plain.tail()
        assert f"{url.replace('https://', 'http://')} speaks HTTPS, not plain HTTP: use {url}" in plain.output()
    finally:
        plain.stop()


@pytest.mark.slow
def test_haproxy_recipe_as_written(stack, pki, tmp_path):
    """Through HAProxy (TLS on a port not 443): a GPU client connects (X-Forwarded-Proto) and ran a
    rank of the job; the SDK reads the job, its metrics and its weights there; /metrics is not
    served. Without the X-Forwarded-Proto line, a GPU client says the server refused its origin,
    and the server's log names the header."""
    url = stack["urls"]["haproxy"]
    sdk = ZWDX(url, ca_file=pki["ca"], remember=False, room_token=stack["room"]["token"])
    job_id = stack["result"]["job_id"]
    job = sdk.get_job(job_id)
    assert job["status"] == "completed"
    assert {"via-nginx", "via-haproxy"} <= {p["client_id"] for p in job["placement"]}, job["placement"]
    assert sdk.get_job_metrics(job_id)["loss"]
    weights = sdk.download_weights(job_id, str(tmp_path / "weights.pt"))
    assert weights["sha256"] == hashlib.sha256((tmp_path / "weights.pt").read_bytes()).hexdigest()
    assert requests.get(f"{url}/metrics", verify=pki["ca"], timeout=10).status_code == 403

    port = free_port()
    cfg = tmp_path / "old-haproxy.cfg"
    cfg.write_text(haproxy_cfg(port, stack["server"].url, pki["pem"], forwarded_proto=False))
    old = Proc([HAPROXY, "-db", "-f", str(cfg)], str(tmp_path / "old-haproxy.log"))
    client = None
    try:
        wait_until(lambda: _up(f"https://127.0.0.1:{port}", pki["ca"], old), 30, what=f"HAProxy\n{old.output()}")
        client = GpuClient(f"https://127.0.0.1:{port}", stack["room"]["donor_token"], str(tmp_path / "refused"),
                           "refused", extra=["--ca-file", pki["ca"]])
        wait_until(lambda: "refused by the server: origin https://127.0.0.1:" in client.output(), 60,
                   what=f"the GPU client saying why it was refused\n{client.tail()}")
        wait_until(lambda: "X-Forwarded-Proto" in stack["server"].output(), 10, what="the server naming the header")
    finally:
        Proc.stop_all([p for p in (client, old) if p is not None])


# -- in process --------------------------------------------------------------------------------------------
@pytest.fixture()
def app(tmp_path):
    from zwdx.server import create_app
    return create_app({"DATA_DIR": str(tmp_path), "ASYNC_MODE": "threading", "TESTING": True})


POLL = "/socket.io/?EIO=4&transport=polling"


def test_a_refused_origin_names_the_header_to_set(app, caplog):
    client = app.test_client()
    with caplog.at_level(logging.WARNING, logger="zwdx.server.proxies"):
        refused = client.get(POLL, headers={"Origin": "https://zwdx.example.org:8443", "Host": "zwdx.example.org:8443"})
        assert refused.status_code == 400
        assert "X-Forwarded-Proto" in caplog.text and "https://zwdx.example.org:8443" in caplog.text
        caplog.clear()
        refused = client.get(POLL, headers={"Origin": "https://zwdx.example.org:8443", "Host": "zwdx.example.org",
                                            "X-Forwarded-Proto": "https"})
        assert refused.status_code == 400
        assert "$http_host" in caplog.text and "X-Forwarded-Proto" not in caplog.text
        accepted = client.get(POLL, headers={"Origin": "https://zwdx.example.org:8443", "Host": "zwdx.example.org:8443",
                                             "X-Forwarded-Proto": "https"})
        assert accepted.status_code == 200


def test_x_forwarded_for_without_proxy_hops_warns_once(app, caplog):
    client = app.test_client()
    with caplog.at_level(logging.WARNING, logger="zwdx.server.proxies"):
        client.get("/health")
        assert "--proxy-hops" not in caplog.text
        for _ in range(3):
            client.get("/health", headers={"X-Forwarded-For": "203.0.113.9"})
    assert caplog.text.count("--proxy-hops 1") == 1


def test_proxy_hops_flag_believes_the_forwarded_address(tmp_path):
    from zwdx.cli import build_parser
    from zwdx.server import create_app
    args = build_parser().parse_args(["server", "--proxy-hops", "1"])
    assert args.proxy_hops == 1
    app = create_app({"DATA_DIR": str(tmp_path), "ASYNC_MODE": "threading", "PROXY_HOPS": args.proxy_hops})
    seen = app.test_client().get("/metrics", headers={"X-Forwarded-For": "203.0.113.9"},
                                 environ_base={"REMOTE_ADDR": "127.0.0.1"})
    assert seen.status_code == 403  # the client's address, not the proxy's loopback one
