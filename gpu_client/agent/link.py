"""This GPU client's link to the server, measured as it registers (``Link`` in its ``Register``).

Over the HTTP session it already has, with its donor token (``/api/v1/link``, ``zwdx/server/links.py``):
three empty requests (the shortest is the round trip), then ``LINK_PROBE_BYTES`` down and the
same up, each timed; bytes per second = bytes / (time - round trip). One measurement is five
requests and 2 MiB; the figures are kept ``LINK_REFRESH`` seconds (reconnects reuse them). A
transfer this short underestimates a link still in TCP slow start (a long fat one): the figures
are a floor, good for telling a home uplink from a datacenter one.
"""
from __future__ import annotations

import logging
import time

import requests

from zwdx import defaults
from zwdx.protocol.gpu import Link

log = logging.getLogger("gpu_client.agent.link")

#: Empty requests whose shortest round trip is the RTT.
ROUND_TRIPS = 3


def measure(session: requests.Session, server: str, token: str, size: int = defaults.LINK_PROBE_BYTES,
            timeout: float = 30.0) -> Link | None:
    """The link's figures, or None (logged) when the server does not answer them (an older one,
    a rate limit): registering goes on without."""
    url = f"{server}{defaults.API_PREFIX}/link"
    headers = {defaults.TOKEN_HEADER: token}
    try:
        trips = []
        for _ in range(ROUND_TRIPS):
            started = time.perf_counter()
            resp = session.get(url, params={"bytes": 0}, headers=headers, timeout=timeout)
            resp.raise_for_status()
            trips.append(time.perf_counter() - started)
        rtt = min(trips)
        started = time.perf_counter()
        resp = session.get(url, params={"bytes": size}, headers=headers, timeout=timeout)
        resp.raise_for_status()
        got = len(resp.content)
        down = got / max(time.perf_counter() - started - rtt, 1e-6)
        body = b"\0" * size
        started = time.perf_counter()
        resp = session.post(url, data=body, headers={**headers, "Content-Type": "application/octet-stream"},
                            timeout=timeout)
        resp.raise_for_status()
        up = int(resp.json()["bytes"]) / max(time.perf_counter() - started - rtt, 1e-6)
    except (requests.RequestException, ValueError, KeyError) as exc:
        log.warning("gpu-client: link to %s not measured: %s", server, exc)
        return None
    return Link(rtt=rtt, up=min(up, 1e13), down=min(down, 1e13), measured_at=time.time())

