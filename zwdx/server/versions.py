"""Protocol versions on the REST API (``zwdx.protocol.base.PROTOCOL``; docs/operations.md,
Upgrades).

Every answer names the server's protocol in its ``Zwdx-Protocol`` header; a request whose own
header names another major is refused (400, ``field`` ``Zwdx-Protocol``) with a message naming
both versions and which side to upgrade, before it touches anything. A request without the
header (a browser, curl, an SDK from before versions were exchanged) speaks 1.0. GPU clients
say theirs as they connect (``events.on_gpu_connect``).
"""
from __future__ import annotations

from flask import request

from .. import __version__
from ..errors import BadRequest
from ..protocol.base import PROTOCOL, PROTOCOL_HEADER, VERSION_HEADER, incompatible


def init_app(app) -> None:
    @app.before_request
    def _same_major():
        theirs = request.headers.get(PROTOCOL_HEADER)
        if theirs is None:
            return
        mismatch = incompatible(theirs, "client", "server", request.headers.get(VERSION_HEADER), __version__)
        if mismatch:
            raise BadRequest(mismatch, field=PROTOCOL_HEADER)

    @app.after_request
    def _say(response):
        response.headers[PROTOCOL_HEADER] = PROTOCOL
        return response
