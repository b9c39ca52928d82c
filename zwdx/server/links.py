"""``/api/v1/link``: what a GPU client times to measure its link to the server as it registers.

    GET  /api/v1/link?bytes=N   N bytes (0: nothing, a round trip), streamed
    POST /api/v1/link           up to LINK_PROBE_MAX_BYTES, read and dropped: how many

A donor token only (the GPU clients' own); at most ``LINK_PROBE_MAX_BYTES`` either way, and
``RATE_LIMIT_LINK`` requests per address (``limits.py``): a measurement is five requests and a
GPU client measures again only every ``LINK_REFRESH`` seconds (``gpu_client/agent/link.py``). The
figures come back in its ``Register`` (``events.py`` stores them with the client).
"""
from __future__ import annotations

import os

from flask import Blueprint, Response, current_app, request

from .. import defaults
from ..errors import PayloadTooLarge
from ..protocol.rest import LinkQuery, LinkReceived
from .http import OCTET, Auth, operation

bp = Blueprint("links", __name__)

#: The bytes a download is cut from (random: a compressing proxy on the way cannot shrink them).
_BLOCK = os.urandom(64 * 1024)


def _limit() -> int:
    return current_app.extensions["zwdx"].settings.link_probe_max_bytes or defaults.LINK_PROBE_MAX_BYTES


@operation(bp, "GET", "/link", "Bytes for a GPU client to time its download", auth=Auth.DONOR, query=LinkQuery,
           answer=OCTET, errors=(429,), tag="gpu clients")
def link_down(query: LinkQuery):
    """``bytes`` bytes (at most the server's ``LINK_PROBE_MAX_BYTES``; 0 for a round trip)."""
    size = min(query.bytes, _limit())

    def chunks():
        left = size
        while left > 0:
            piece = _BLOCK[:min(left, len(_BLOCK))]
            left -= len(piece)
            yield piece
    return Response(chunks(), mimetype=OCTET, headers={"Content-Length": str(size)})


@operation(bp, "POST", "/link", "Bytes from a GPU client to time its upload", auth=Auth.DONOR, body=OCTET,
           answer=LinkReceived, errors=(413, 429), tag="gpu clients")
def link_up() -> LinkReceived:
    """Reads the body (at most ``LINK_PROBE_MAX_BYTES``) and drops it: how many bytes came."""
    limit = _limit()
    if (request.content_length or 0) > limit:
        raise PayloadTooLarge(f"a link measurement sends at most {limit} bytes", limit=limit)
    got = 0
    while chunk := request.stream.read(min(defaults.CHUNK_BYTES, limit + 1 - got)):
        got += len(chunk)
        if got > limit:
            raise PayloadTooLarge(f"a link measurement sends at most {limit} bytes", limit=limit)
    return LinkReceived(bytes=got)
