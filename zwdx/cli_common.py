"""What the ``zwdx`` command's parts share: the server and token arguments, sizes, ``--version``."""
from __future__ import annotations

import os

from . import defaults, sizes

DEFAULT_SERVER = os.environ.get("ZWDX_SERVER_URL", f"http://localhost:{defaults.PORT}")

#: argparse's type for sizes (``8GiB`` -> 8589934592).
byte_size = sizes.argument


def version_line() -> str:
    """What ``--version`` prints: zwdx's version, its protocol (docs/operations.md, Upgrades), its Python."""
    import platform

    from . import __version__
    from .protocol.base import PROTOCOL
    return f"zwdx {__version__} (protocol {PROTOCOL}, Python {platform.python_version()})"


def server_arguments(parser) -> None:
    parser.add_argument("--server", default=DEFAULT_SERVER, help="server URL (default: $ZWDX_SERVER_URL or %(default)s)")
    parser.add_argument("--ca-file", default=None, metavar="FILE",
                        help="the CA certificate (PEM) that signed the server's, for a private CA (default: "
                             "$ZWDX_CA_FILE, else the system's CAs)")


def token_arguments(parser, what: str) -> None:
    parser.add_argument("--room-token-file", default=None, metavar="FILE",
                        help=f"a file holding {what} (default: $ZWDX_ROOM_TOKEN, else the file $ZWDX_ROOM_TOKEN_FILE "
                             f"names)")
    parser.add_argument("--room-token", "-rt", default=None,
                        help="the token itself: every user of the machine can read a command line, so this warns; "
                             "prefer --room-token-file or $ZWDX_ROOM_TOKEN")
