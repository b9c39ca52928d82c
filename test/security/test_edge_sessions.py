"""Issue 29, L5, in-process: the cap on Engine.IO sessions per address counts the client's
address as the rate limits do (``PROXY_HOPS``, test_proxy_hops.py): behind a proxy each client
has its own cap; without ``PROXY_HOPS`` an ``X-Forwarded-For`` a client sends is not believed.
(test_edge_flood.py: the same against a real server, with the auth timeout and bad packets.)"""
from __future__ import annotations


def _handshakes(client, forwarded_for: str, n: int) -> list[int]:
    return [client.get("/socket.io/?EIO=4&transport=polling", headers={"X-Forwarded-For": forwarded_for}).status_code
            for _ in range(n)]


def test_behind_one_proxy_each_client_has_its_own_cap_of_sessions(make_app):
    app = make_app(PROXY_HOPS=1, SOCKET_SESSIONS_PER_ADDRESS=2)
    proxy = app.test_client()
    proxy.environ_base["REMOTE_ADDR"] = "172.18.0.5"  # every request comes from the proxy
    assert _handshakes(proxy, "203.0.113.7", 3) == [200, 200, 429]
    assert _handshakes(proxy, "198.51.100.2", 1) == [200]  # another client behind it is not refused
    resp = proxy.get("/socket.io/?EIO=4&transport=polling", headers={"X-Forwarded-For": "203.0.113.7"})
    assert resp.status_code == 429 and resp.json["error"]["code"] == "too_many_requests", resp.text


def test_without_proxy_hops_a_forwarded_for_header_opens_no_more_sessions(make_app):
    app = make_app(SOCKET_SESSIONS_PER_ADDRESS=2)
    client = app.test_client()
    assert [_handshakes(client, f"203.0.113.{i}", 1)[0] for i in range(3)] == [200, 200, 429]


def test_an_ipv6_client_counts_by_its_64():
    from zwdx.server.connections import address_key
    assert address_key("2001:db8:1:2:aaaa::1") == address_key("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"
    assert address_key("::ffff:192.0.2.7") == "192.0.2.7" and address_key("192.0.2.7") == "192.0.2.7"
