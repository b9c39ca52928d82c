"""What the server believes of a reverse proxy in front (docs/deploy-tls.md, docs/deploy-scale.md).

- ``PROXY_HOPS`` (``zwdx server --proxy-hops``): the proxies whose ``X-Forwarded-For`` and
  ``X-Forwarded-Proto`` to believe (werkzeug's ProxyFix), so that rate limits, connection caps
  and ``/metrics`` see the client's address, not the proxy's. Without it, the first request that
  carries ``X-Forwarded-For`` logs a warning, once.
- Socket.IO's origin check (a browser's or a GPU client's ``Origin`` must be the address it
  connected to): a refused origin is logged with what the server saw instead and the header a
  proxy must set, once per origin and reason.
"""
from __future__ import annotations

import logging
from urllib.parse import urlsplit

log = logging.getLogger(__name__)


def install(app) -> None:
    """Wrap ``app.wsgi_app`` (outside Socket.IO's middleware, so that both see the result)."""
    hops = app.extensions["zwdx"].settings.proxy_hops
    if hops:
        from werkzeug.middleware.proxy_fix import ProxyFix
        app.wsgi_app = ProxyFix(app.wsgi_app, x_for=hops, x_proto=hops)
    else:
        app.wsgi_app = _WarnForwarded(app.wsgi_app)


class _WarnForwarded:
    """Logs once that requests come through a proxy this server was not told of."""

    def __init__(self, wsgi_app):
        self.wsgi_app = wsgi_app
        self.warned = False

    def __call__(self, environ, start_response):
        if not self.warned and environ.get("HTTP_X_FORWARDED_FOR"):
            self.warned = True
            log.warning("server: requests arrive with X-Forwarded-For (from %s) and no proxy hops are configured: "
                        "every client looks like the proxy's address to rate limits, connection caps and /metrics "
                        "(one client's wrong tokens lock out everyone). Start the server with --proxy-hops 1 "
                        "(ZWDX_PROXY_HOPS=1) per proxy in front", environ.get("REMOTE_ADDR", "?"))
        return self.wsgi_app(environ, start_response)


def _default_ports(scheme: str, netloc: str) -> str:
    """``netloc`` without the scheme's default port (a browser's Origin leaves it out)."""
    default = {"http": ":80", "https": ":443"}.get(scheme)
    return netloc[:-len(default)] if default and netloc.endswith(default) else netloc


class OriginCheck:
    """Socket.IO's ``cors_allowed_origins``: the same origin only (python-engineio's default:
    the scheme and Host the request came with, or its ``X-Forwarded-Proto``/``-Host``), and a
    refusal that says which part differed."""

    def __init__(self):
        self.told: set[tuple[str, str]] = set()

    def __call__(self, origin: str, environ: dict) -> bool:
        scheme = environ.get("wsgi.url_scheme", "http")
        host = environ.get("HTTP_HOST", "")
        seen = {f"{scheme}://{host}"}
        forwarded_proto = environ.get("HTTP_X_FORWARDED_PROTO", "").split(",")[0].strip()
        forwarded_host = environ.get("HTTP_X_FORWARDED_HOST", "").split(",")[0].strip()
        if forwarded_proto or forwarded_host:
            seen.add(f"{forwarded_proto or scheme}://{forwarded_host or host}")
        if origin in seen or not origin:
            return True
        self._explain(origin, forwarded_proto or scheme, forwarded_host or host)
        return False

    def _explain(self, origin: str, scheme: str, host: str) -> None:
        parts = urlsplit(origin)
        problems = []
        if parts.scheme and parts.scheme != scheme:
            problems.append(f"it sees the request as {scheme}:// while the origin is {parts.scheme}://: a proxy that "
                            f"ends TLS must send X-Forwarded-Proto (nginx: proxy_set_header X-Forwarded-Proto $scheme; "
                            f"HAProxy: http-request set-header X-Forwarded-Proto https if {{ ssl_fc }})")
        if _default_ports(parts.scheme, parts.netloc) != _default_ports(scheme, host):
            problems.append(f"it came for Host '{host}' while the origin names '{parts.netloc}': a proxy must pass the "
                            f"Host header the client sent, port included (nginx: proxy_set_header Host $http_host)")
        reason = "; ".join(problems) or f"the server sees {scheme}://{host}"
        if (origin, reason) not in self.told:
            self.told.add((origin, reason))
            log.warning("server: refused a Socket.IO connection from origin %s: %s", origin, reason)
