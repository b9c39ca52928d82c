"""Where a command gets its room token: a file, the environment, or (warned) its command line.

A command line is public on a machine: every user reads it with ``ps`` or from
``/proc/PID/cmdline``. So the commands take a token from a file (``--room-token-file F``, or the
file ``$ZWDX_ROOM_TOKEN_FILE`` names) or from ``$ZWDX_ROOM_TOKEN``; ``--room-token``/``-rt``
still works, and warns (never showing the token).

    token_from(flag, file, prog)   the token (None: none given), ZwdxError for a file that cannot be read
"""
from __future__ import annotations

import logging
import os
import stat

from .errors import BadRequest

log = logging.getLogger("zwdx")

#: The variables a token may come from.
TOKEN_VARIABLE, FILE_VARIABLE = "ZWDX_ROOM_TOKEN", "ZWDX_ROOM_TOKEN_FILE"


def read_token_file(path: str) -> str:
    """The token in ``path`` (its first line, trimmed); warns when other users may read the file."""
    try:
        with open(path, encoding="utf-8") as fh:
            mode = os.fstat(fh.fileno()).st_mode
            token = fh.readline().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise BadRequest(f"cannot read the room token file {path}: {getattr(exc, 'strerror', None) or exc}",
                         field="room_token_file") from None
    if not token:
        raise BadRequest(f"the room token file {path} is empty", field="room_token_file")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("the room token file %s may be read by other users (mode %04o): chmod 600 %s", path,
                    stat.S_IMODE(mode), path)
    return token


def warn_command_line(prog: str) -> None:
    """Say that a token on the command line is public (the token itself is never shown)."""
    log.warning("%s: a room token given on the command line (--room-token/-rt) can be read by every user of this "
                "machine (ps, /proc/PID/cmdline): pass it with --room-token-file FILE or $%s instead", prog,
                TOKEN_VARIABLE)


def token_from(flag: str | None, file: str | None, prog: str) -> str | None:
    """The token a command was given, first found first: ``--room-token`` (warned),
    ``--room-token-file``, ``$ZWDX_ROOM_TOKEN``, the file ``$ZWDX_ROOM_TOKEN_FILE`` names. None
    when none is."""
    if flag and file:
        raise BadRequest("give the room token once: --room-token or --room-token-file, not both",
                         field="room_token")
    if flag:
        warn_command_line(prog)
        return flag
    if file:
        return read_token_file(file)
    if os.environ.get(TOKEN_VARIABLE):
        return os.environ[TOKEN_VARIABLE]
    if os.environ.get(FILE_VARIABLE):
        return read_token_file(os.environ[FILE_VARIABLE])
    return None
