"""The zwdx server with a change bench/README.md proposes, applied at start-up, so that
bench/control_plane.py --patched measures it before anyone edits the server.

    python bench/patched_server.py server --port 4461 --data-dir D      # same arguments as `zwdx server`

With ZWDX_BENCH_ASYNC_MODE=gevent: Socket.IO and HTTP are served from greenlets (gevent, with
simple-websocket) instead of one OS thread per connection. The other proposals measured this
way (coalesced client pushes, SQLite connections closed with their thread, a linear plan())
have landed in the server itself.
"""
from __future__ import annotations

import os

if os.environ.get("ZWDX_BENCH_ASYNC_MODE") == "gevent":  # before anything imports socket or threading
    from gevent import monkey
    monkey.patch_all()

import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def async_mode(mode: str) -> None:
    """Override the async_mode that create_app passes to Flask-SocketIO."""
    from flask_socketio import SocketIO
    init_app = SocketIO.init_app

    def patched(self, app, **kwargs):
        kwargs["async_mode"] = mode
        return init_app(self, app, **kwargs)
    SocketIO.init_app = patched


def main() -> int:
    from zwdx import cli
    if os.environ.get("ZWDX_BENCH_ASYNC_MODE"):
        async_mode(os.environ["ZWDX_BENCH_ASYNC_MODE"])
    return cli.main()


if __name__ == "__main__":
    sys.exit(main())
