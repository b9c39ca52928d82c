"""TLS (the trust issue's TLS paragraph): ``zwdx server --tls-cert/--tls-key`` serves HTTPS and
WSS (gevent's server and Werkzeug's threaded one); the SDK, the GPU client and its ranks verify
the server's certificate, a private CA's with ``ca_file``/``--ca-file``; without it they are
refused with words that say what to do; plain ``http://`` to another machine warns once.

A CA and a server certificate (for 127.0.0.1 and localhost) are made per module with
``cryptography``.
"""
from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket

import psutil
import pytest
import requests
import torch

import needs
from procs import SLACK, GpuClient, Server, free_port, wait_until
from test_donors import Tiny, tiny_loader, whoami
import zwdx
from zwdx import ZWDX
from zwdx.errors import ServerUnreachable


def _certificate(subject: str, key, issuer_name, issuer_key, ca: bool, names=()):
    x509 = needs.module("cryptography.x509")
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID
    now = datetime.datetime.now(datetime.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name or name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """``ca`` (the private CA's certificate), ``cert`` and ``key`` (the server's), as PEM files."""
    needs.module("cryptography")
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    folder = tmp_path_factory.mktemp("pki")
    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("zwdx test CA", ca_key, None, None, ca=True)
    server = _certificate("zwdx test server", server_key, ca.subject, ca_key, ca=False,
                          names=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    paths = {"ca": folder / "ca.pem", "cert": folder / "server.pem", "key": folder / "server-key.pem"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(server_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))
    os.chmod(paths["key"], 0o600)
    return {k: str(v) for k, v in paths.items()}


class HttpsServer(Server):
    """A server process serving HTTPS and WSS only; healthy once ``/health`` answers over TLS."""

    def __init__(self, data_dir: str, pki: dict, mode: str):
        self.ca = pki["ca"]
        super().__init__(data_dir, extra=["--tls-cert", pki["cert"], "--tls-key", pki["key"], "--async-mode", mode])

    def healthy(self) -> bool:
        self.url = f"https://127.0.0.1:{self.port}"
        if not self.alive():
            raise RuntimeError(f"zwdx server exited:\n{self.output()}")
        try:
            return requests.get(f"{self.url}/health", timeout=1, verify=self.ca).status_code == 200
        except requests.RequestException:
            return False


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["gevent", "threading"])
def test_a_job_runs_end_to_end_over_https_and_wss(pki, tmp_path, mode):
    server = HttpsServer(str(tmp_path / "server"), pki, mode)
    clients = []
    try:
        assert f"zwdx server on https://127.0.0.1:{server.port}" in server.output()
        with pytest.raises(requests.ConnectionError):  # no plain HTTP beside it
            requests.get(f"http://127.0.0.1:{server.port}/health", timeout=5)
        sdk = ZWDX(server.url, ca_file=pki["ca"], remember=False)
        room = sdk.create_room("tls")
        sdk.room_token = room["token"]
        clients = [GpuClient(server.url, room["donor_token"], str(tmp_path / name), f"tls-{name}",
                             extra=["--ca-file", pki["ca"]]) for name in ("a", "b")]
        wait_until(lambda: sum(c["status"] == "online" for c in sdk.get_room()["clients"]) == 2, 60,
                   what=f"GPU clients online over WSS\n{clients[0].tail()}")
        result = sdk.submit_job(Tiny(), tiny_loader, whoami, None, torch.optim.SGD(Tiny().parameters(), lr=0.1),
                                "DDP", resources=zwdx.Resources(world_size=2),
                                run=zwdx.Run(progress=False, timeout=180))
        assert result["status"] == "completed"  # the ranks reported over HTTPS, verifying the CA from their sandbox
        assert any(line["text"].startswith("rank 1 runs as uid") for line in sdk.get_job_logs(result["job_id"]))
        weights = sdk.get_trained_model(result["job_id"], Tiny())
        assert isinstance(weights, torch.nn.Module)
    finally:
        for client in clients:
            client.stop()
        server.stop()


@pytest.mark.slow
def test_a_client_without_the_ca_is_refused_saying_why(pki, tmp_path):
    server = HttpsServer(str(tmp_path / "server"), pki, "gevent")
    client = None
    try:
        with pytest.raises(ServerUnreachable) as refused:
            ZWDX(server.url, remember=False).create_room("no-ca")
        assert "certificate is not trusted" in str(refused.value) and "--ca-file" in str(refused.value)
        room = ZWDX(server.url, ca_file=pki["ca"], remember=False).create_room("with-ca")
        client = GpuClient(server.url, room["donor_token"], str(tmp_path / "no-ca"), "no-ca")
        assert client.wait(60) == 2
        assert "certificate is not trusted" in client.output(), client.tail()
        assert room["donor_token"] not in client.output()
    finally:
        if client is not None:
            client.stop()
        server.stop()


def own_address() -> str:
    """An IPv4 address of this machine that is not a loopback one."""
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    needs.missing("a network interface with an IPv4 address that is not loopback", "a machine on a network")


@pytest.fixture
def zwdx_log(caplog):
    """The "zwdx" logger's warnings (it may not pass them on to the root logger)."""
    logger = logging.getLogger("zwdx")
    propagate, logger.propagate = logger.propagate, False  # each record once, through this handler
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING, logger="zwdx")
    yield caplog
    logger.removeHandler(caplog.handler)
    logger.propagate = propagate


def test_plain_http_to_another_machine_warns_once(zwdx_log):
    addr, port = own_address(), free_port()
    ZWDX(f"http://127.0.0.1:{port}", remember=False)
    ZWDX(f"http://localhost:{port}", remember=False)
    assert not zwdx_log.records
    ZWDX(f"http://{addr}:{port}", remember=False)
    ZWDX(f"http://{addr}:{port}", remember=False)
    [record] = zwdx_log.records
    assert f"http://{addr}:{port} is plain HTTP to another machine" in record.getMessage()
    ZWDX(f"https://{addr}:{port}", remember=False)
    assert len(zwdx_log.records) == 1


@pytest.mark.slow
def test_a_gpu_client_warns_of_plain_http_to_another_machine(tmp_path):
    addr = own_address()
    server = Server(str(tmp_path / "server"), host=addr)
    client = None
    try:
        assert "serving plain HTTP on" in server.output()
        room = ZWDX(server.url, remember=False).create_room("plain")
        client = GpuClient(server.url, room["donor_token"], str(tmp_path / "c"), "plain")
        wait_until(lambda: "is plain HTTP to another machine" in client.output(), 30 + SLACK,
                   what=f"the GPU client's warning\n{client.tail()}")
        assert client.output().count("is plain HTTP to another machine") == 1
    finally:
        if client is not None:
            client.stop()
        server.stop()
