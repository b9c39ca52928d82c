"""Whether a GPU client is well, for a container's healthcheck.

The agent touches ``<work dir>/alive`` when it registers and at every heartbeat the server
acknowledges (``beat``); ``python -m gpu_client.agent.health [WORK_DIR]`` exits 0 when that happened
within ``STALE`` seconds, 1 otherwise (not registered, refused, or the server unreachable).
"""
from __future__ import annotations

import os
import sys
import time

from zwdx import defaults

#: Seconds without an acknowledged heartbeat after which the client counts as unwell: three
#: times the server's own patience with a silent client.
STALE = 3 * defaults.CLIENT_TIMEOUT

#: The agent's work dir when ``zwdx gpu-client`` is not given one (agent.Agent's default).
DEFAULT_WORK_DIR = os.path.join(os.path.expanduser("~"), ".zwdx", "gpu_client")


def path(work_dir: str) -> str:
    return os.path.join(work_dir, "alive")


def beat(work_dir: str) -> None:
    """The server just acknowledged this client."""
    try:
        os.makedirs(work_dir, exist_ok=True)
        with open(path(work_dir), "a"):
            pass
        os.utime(path(work_dir))
    except OSError:
        pass  # a read-only work dir: the healthcheck says unwell, nothing else breaks


def fresh(work_dir: str, stale: float = STALE) -> bool:
    try:
        return time.time() - os.path.getmtime(path(work_dir)) <= stale
    except OSError:
        return False


def main(argv: list[str]) -> int:
    work_dir = argv[0] if argv else DEFAULT_WORK_DIR
    if fresh(work_dir):
        return 0
    print(f"gpu client unwell: no heartbeat acknowledged within {STALE:g} s ({path(work_dir)})", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
