"""Why a GPU client's Socket.IO connection failed, when the server (or a proxy in front) answered
at all: python-engineio reports every failed websocket handshake as "Connection error", which
tells a donor nothing. Asked only after a connect failed."""
from __future__ import annotations

import warnings
from urllib.parse import urlsplit

import requests

from zwdx import tls


def _origin(url: str) -> str:
    """The Origin header websocket-client sends for ``url`` (no port where it is the scheme's default)."""
    parts = urlsplit(url)
    default = {"http": ":80", "https": ":443"}.get(parts.scheme, "")
    netloc = parts.netloc[:-len(default)] if default and parts.netloc.endswith(default) else parts.netloc
    return f"{parts.scheme}://{netloc}"


def _speaks_https(url: str) -> bool:
    parts = urlsplit(url)
    try:  # only which protocol answers: the certificate is checked when the client connects over https
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # urllib3's InsecureRequestWarning
            requests.get(f"https://{parts.netloc}/health", timeout=5, verify=False)
        return True
    except requests.RequestException:
        return False


def why_refused(url: str, verify: str | bool = True) -> tuple[str, bool] | None:
    """(what to say, whether retrying can help) when the server at ``url`` refused the
    connection for a reason a person must mend; None when it did not answer, or not that way."""
    base = url.rstrip("/")
    try:
        with tls.session(verify) as probe:
            answer = probe.get(f"{base}/socket.io/", params={"EIO": "4", "transport": "polling"},
                               headers={"Origin": _origin(base)}, timeout=10)
    except requests.RequestException:
        answer = None
    if answer is not None and answer.status_code == 400 and "origin" in answer.text.lower():
        return (f"origin {_origin(base)} is not accepted ({answer.text.strip()}): a reverse proxy in front must send "
                f"X-Forwarded-Proto and the Host header with its port (docs/deploy-tls.md); the server's log says "
                f"which", True)
    if urlsplit(base).scheme == "http" and (answer is None or answer.status_code >= 400) and _speaks_https(base):
        return (f"{base} speaks HTTPS, not plain HTTP: use https://{urlsplit(base).netloc} (and --ca-file for a "
                f"private CA's certificate)", False)
    return None
