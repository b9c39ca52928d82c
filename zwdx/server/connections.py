"""The connections one server process takes (gevent's WSGI server), and for how long.

- A connection must send its request line and headers within ``HEADER_TIMEOUT`` seconds (the
  first request from its accept, its TLS handshake included; later ones from their first
  byte), and a kept-alive one must
  start its next request within ``IDLE_TIMEOUT``: a client that trickles bytes (slowloris) or
  sends nothing is cut off (408, or closed), whatever it sends. A websocket, once upgraded, is
  no longer timed here (Engine.IO pings it).
- A JSON body must arrive within ``BODY_TIMEOUT`` seconds of its first read (``body_deadline``,
  ``http._json_body``): one trickled in is a 400 and its connection closes. (An artifact's
  bytes, which need a token, stream on at their own pace.)
- One address holds at most ``MAX_CONNECTIONS_PER_ADDRESS`` connections at once (0: no cap; an
  IPv6 address counts with its /64): the next one is answered 429 and closed. Behind
  ``PROXY_HOPS`` proxies every connection comes from a proxy, so the cap is not applied (the
  proxy keeps its own; ``socket_edge`` caps Engine.IO sessions per client address still).
- The process holds at most ``capacity()`` connections: half its open-files limit, less a
  reserve (a websocket takes two descriptors under gevent); past it, new connections wait in
  the listen backlog instead of failing for want of descriptors.

    handler_class(settings) -> the gevent handler class ``serve`` runs
    body_deadline(seconds, environ) -> a context: ``BadRequest`` if the body is not read in time
    capacity(open_files)   -> connections one process holds
"""
from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
import sys
import time

from ..errors import BadRequest

log = logging.getLogger(__name__)

#: Most bytes of a request's body left unread by the app that are read (and dropped) to keep its
#: connection for the next request; past it the connection closes instead. As large as a JSON body
#: may be: a refused upload of a bundle that size (a wrong token) reads its 401, not a reset
#: (reading and dropping bytes costs the hub little; parsing them was what held it).
DISCARD_BYTES = 8 * 1024 * 1024
#: Descriptors kept for what is not a connection: the store, artifacts being written, logs.
RESERVED_FILES = 256
_TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
_TOO_MANY = (b"HTTP/1.1 429 Too Many Requests\r\nConnection: close\r\nContent-Type: application/json\r\n"
             b"Content-Length: %d\r\n\r\n%s")
_TOO_MANY_BODY = (b'{"error": {"code": "too_many_requests", "message": "too many connections from this address '
                  b'at once; close some and retry"}}')


def capacity(open_files: int) -> int:
    """How many connections one process holds with ``open_files`` descriptors."""
    return max(1, (open_files - RESERVED_FILES) // 2)


def address_key(address: str) -> str:
    """What a cap counts by: the address, an IPv6 one by its /64 (one host is given a whole /64)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if ip.version == 6:
        if ip.ipv4_mapped:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class _TooSlow(socket.timeout):
    """A request line or headers not in within their time: to gevent a socket error (closed)."""


@contextlib.contextmanager
def body_deadline(seconds: float, environ: dict):
    """``BadRequest`` if the block (a body's reads) takes more than ``seconds`` (0: no limit), and
    the connection closes after the answer. Under gevent only (``zwdx server``'s): Werkzeug's
    threaded server, for tests, has nothing to interrupt a read with."""
    monkey = sys.modules.get("gevent.monkey")
    if not seconds or not (monkey and monkey.is_module_patched("socket")):
        yield
        return
    import gevent
    timer = gevent.Timeout(seconds)
    timer.start()
    try:
        yield
    except gevent.Timeout as exc:
        if exc is not timer:
            raise
        body = environ.get("wsgi.input")
        if hasattr(body, "_chunked_input_error"):  # gevent's: its rest is not read, the connection closes
            body._chunked_input_error = True
        raise BadRequest(f"the body did not arrive within {seconds:g} s", field="body") from None
    finally:
        timer.close()


def handler_class(settings):
    """gevent's request handler as zwdx serves with it (the module's docstring), and two fixes:

    - Nagle's algorithm off: the handler sends a response's headers and body in two writes,
      and on a kept-alive connection the body would wait for the client's delayed ACK of the
      headers (40 ms on Linux) before leaving.
    - A connection that was a websocket is closed when the websocket ends, instead of being
      read for one more HTTP request (which found the client's close frame and logged
      "Invalid HTTP method")."""
    import gevent
    from gevent import pywsgi

    header_timeout = settings.header_timeout or None
    idle_timeout = settings.idle_timeout or None
    cap = 0 if settings.proxy_hops else settings.max_connections_per_address
    held: dict[str, int] = {}  # address key -> connections open now
    refused = {"at": 0.0, "n": 0}

    class Handler(pywsgi.WSGIHandler):
        _deadline = None
        _requests = 0

        def __init__(self, sock, address, server, *args, **kwargs):
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            super().__init__(sock, address, server, *args, **kwargs)

        def handle(self):
            key = address_key(self.client_address[0]) if isinstance(self.client_address, tuple) else "?"
            if cap and held.get(key, 0) >= cap:
                _note_refused(refused, key, cap)
                if not hasattr(self.socket, "do_handshake"):  # over TLS, not even a handshake: closed
                    try:
                        self.socket.sendall(_TOO_MANY % (len(_TOO_MANY_BODY), _TOO_MANY_BODY))
                    except OSError:
                        pass
                self.socket.close()
                return
            held[key] = held.get(key, 0) + 1
            try:
                super().handle()
            finally:
                held[key] -= 1
                if not held[key]:
                    del held[key]

        def read_requestline(self):
            # Until the first byte: the header time for a new connection, the idle time after a request.
            wait = idle_timeout if self._requests else header_timeout
            if wait:
                with gevent.Timeout(wait, _TooSlow("idle" if self._requests else "no request")):
                    if not self.rfile.peek(1):
                        return ""
            if header_timeout:
                self._deadline = gevent.Timeout.start_new(header_timeout, _TooSlow("headers too slow"))
            return super().read_requestline()

        def read_request(self, raw_requestline):
            try:
                return super().read_request(raw_requestline)
            finally:
                self._stop_deadline()

        def handle_one_request(self):
            try:
                return super().handle_one_request()
            finally:
                self._stop_deadline()
                self._requests += 1

        def _stop_deadline(self):
            if self._deadline is not None:
                self._deadline.close()
                self._deadline = None

        def _handle_client_error(self, ex):
            if isinstance(ex, _TooSlow):
                return "408", _TIMED_OUT
            return super()._handle_client_error(ex)

        def run_application(self):
            super().run_application()
            body = self.wsgi_input
            if body is not None and (body.chunked_input or body._chunked_input_error
                                     or (body.content_length or 0) - body.position > DISCARD_BYTES):
                # A body the app refused unread (8 MiB of '[', an upload without a token): the
                # connection closes rather than read the rest to keep it alive.
                self.close_connection = True
                body.content_length, body._chunked_input_error = body.position, True

        def handle_one_response(self):
            super().handle_one_response()
            if self.headers.get("Upgrade", "").lower() == "websocket":
                self.close_connection = True

    Handler.held = held  # for tests and /health's figures
    return Handler


def _note_refused(refused: dict, key: str, cap: int) -> None:
    """One warning a minute at most, with how many were refused since the last."""
    refused["n"] += 1
    now = time.monotonic()
    if now - refused["at"] >= 60:
        log.warning("server: refused %d connection(s) over the cap of %d per address (the last from %s)",
                    refused["n"], cap, key)
        refused["at"], refused["n"] = now, 0
