"""Behind a reverse proxy (docker-compose's tls profile: Caddy), every request reaches the server
from the proxy's address: rate limits per address would make one bucket of every client, and
one guesser would lock everyone out. ``PROXY_HOPS`` (``ZWDX_PROXY_HOPS``) names how many proxies
in front to believe; without it, an ``X-Forwarded-For`` a client sends is not believed."""
from __future__ import annotations

from zwdx import defaults

WRONG = {defaults.TOKEN_HEADER: "zs_guessed"}


def _failures(client, forwarded_for: str, n: int) -> list[int]:
    return [client.get("/api/v1/jobs", headers={**WRONG, "X-Forwarded-For": forwarded_for}).status_code
            for _ in range(n)]


def test_behind_one_proxy_each_client_has_its_own_rate_limit(make_app):
    app = make_app(RATE_LIMIT_AUTH_FAILURES="3 per minute", PROXY_HOPS=1)
    proxy = app.test_client()
    proxy.environ_base["REMOTE_ADDR"] = "172.18.0.5"  # every request comes from the proxy
    assert _failures(proxy, "203.0.113.7", 4) == [401, 401, 401, 429]
    assert _failures(proxy, "198.51.100.2", 1) == [401]  # another client behind it is not locked out


def test_without_proxy_hops_a_forwarded_for_header_is_not_believed(make_app):
    app = make_app(RATE_LIMIT_AUTH_FAILURES="3 per minute")
    client = app.test_client()
    codes = [_failures(client, f"203.0.113.{i}", 1)[0] for i in range(4)]  # a fresh "address" each time
    assert codes == [401, 401, 401, 429]
