"""How zwdx's clients (the SDK, the GPU client, its ranks) reach the server: over HTTPS with the
server's certificate verified, and a word when they do not.

    verify(ca_file)          what ``requests`` verifies with: the CA file given (``ca_file=``,
                             ``--ca-file``), else ``$ZWDX_CA_FILE``, else the system's CAs
    session(verify)          a ``requests`` session that verifies with it (even where
                             ``$REQUESTS_CA_BUNDLE`` is set, which would otherwise win)
    warn_if_plain(url, who)  once per process and address: plain ``http://`` to another machine
    untrusted(exc)           the words for a certificate that failed verification, or None
    distrusted(url, verify)  the same, asked of the server at ``url`` (``GET /health``)
    server_context(cert, key)  the server's TLS context (``zwdx server --tls-cert/--tls-key``)

Behind a reverse proxy that ends TLS (docs/deploy-tls.md) the clients see HTTPS all the same.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
import ssl
import threading
from urllib.parse import urlparse

import requests

log = logging.getLogger("zwdx")

#: The variable naming a CA file (PEM) that signed the server's certificate: a private CA.
CA_FILE_VARIABLE = "ZWDX_CA_FILE"
_warned: set[str] = set()
_lock = threading.Lock()


def ca_file(given: str | None = None) -> str | None:
    """The CA file to verify the server with: ``given``, else ``$ZWDX_CA_FILE``; None: the system's."""
    path = given or os.environ.get(CA_FILE_VARIABLE) or None
    if path and not os.path.isfile(path):
        from .errors import BadRequest
        raise BadRequest(f"the CA file {path} does not exist", field="ca_file")
    return path


def verify(given: str | None = None) -> str | bool:
    """``requests``' ``verify``: the CA file's path, or True (the system's CAs)."""
    return ca_file(given) or True


class _Session(requests.Session):
    """A session whose own CA file wins over ``$REQUESTS_CA_BUNDLE``/``$CURL_CA_BUNDLE``
    (``requests`` lets those replace a session's ``verify``)."""

    def merge_environment_settings(self, url, proxies, stream, verify, cert):
        settings = super().merge_environment_settings(url, proxies, stream, verify, cert)
        if isinstance(self.verify, str) and verify in (None, True):
            settings["verify"] = self.verify
        return settings


def session(verify: str | bool = True) -> requests.Session:
    """A ``requests`` session that checks the server's certificate with ``verify`` (``verify()``)."""
    made = _Session()
    made.verify = verify
    return made


def loopback(host: str | None) -> bool:
    """Whether ``host`` is this machine (a loopback address, or a name that only resolves to one)."""
    if not host or host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def warn_if_plain(url: str, who: str) -> None:
    """Warn, once per process and address, that ``url`` is plain HTTP to another machine."""
    parsed = urlparse(url)
    if parsed.scheme != "http" or loopback(parsed.hostname):
        return
    with _lock:
        if parsed.netloc in _warned:
            return
        _warned.add(parsed.netloc)
    log.warning("%s: %s is plain HTTP to another machine: room tokens, rank keys, bundles and weights cross the "
                "network readable and alterable by anyone on the way. Serve zwdx over HTTPS (zwdx server "
                "--tls-cert/--tls-key, or a reverse proxy: docs/deploy-tls.md) and use an https:// URL", who,
                f"{parsed.scheme}://{parsed.netloc}")


def untrusted(exc: BaseException) -> str | None:
    """What to say when ``exc`` (or what caused it) is a certificate that failed verification."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc)
        if isinstance(exc, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in text:
            return ("the server's TLS certificate is not trusted (certificate verify failed): if a private CA "
                    "signed it, pass its certificate with --ca-file, ca_file= or $ZWDX_CA_FILE")
        if "hostname" in text and "match" in text:
            return f"the server's TLS certificate is not for this address ({text})"
        exc = exc.__cause__ or exc.__context__ or (exc.args[0] if exc.args and isinstance(exc.args[0], BaseException)
                                                   else None)
    return None


def distrusted(url: str, verify: str | bool = True) -> str | None:
    """Why the server at ``url`` cannot be trusted (its certificate fails verification), or None:
    trusted, plain HTTP, or not reachable just now."""
    try:
        with session(verify) as probe:
            probe.get(f"{url.rstrip('/')}/health", timeout=10)
    except requests.RequestException as exc:
        return untrusted(exc)
    return None


def server_context(cert: str, key: str) -> ssl.SSLContext:
    """TLS 1.2 or newer with the certificate chain in ``cert`` and its private key in ``key``."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context
