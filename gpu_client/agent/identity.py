"""Who a GPU client is to the server: its client id and the client secret that proves it.

The server answers the first ``register`` of an id with a secret and refuses every later
register of that id without it, so a donor cannot take another donor's id (and its jobs) from
the room's list. The agent keeps the secret in its work dir, ``secrets/<client id>.secret``
(the folder 0700, the file 0600), and sends it with every register; an agent that lost it
(another work dir, a wiped one) goes on under a new id: ``renew()``.
"""
from __future__ import annotations

import logging
import os
import socket
import uuid

log = logging.getLogger("gpu_client.agent.identity")


class Identity:
    """A client id and its secret, kept under ``work_dir``."""

    def __init__(self, work_dir: str, client_id: str | None = None):
        self.work_dir = work_dir
        self.base_id = client_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self.client_id = self.base_id
        self.secret = self._read()

    @property
    def path(self) -> str:
        return os.path.join(self.work_dir, "secrets", f"{self.client_id}.secret")

    def _read(self) -> str | None:
        try:
            with open(self.path, encoding="ascii") as fh:
                return fh.read().strip() or None
        except (OSError, ValueError):
            return None

    def keep(self, secret: str) -> None:
        """Keep the secret the server gave this id, for every later register (and the next start)."""
        self.secret = secret
        folder, path = os.path.dirname(self.path), self.path
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            os.chmod(folder, 0o700)
            fd = os.open(f"{path}.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="ascii") as fh:
                fh.write(secret)
            os.chmod(f"{path}.tmp", 0o600)
            os.replace(f"{path}.tmp", path)
        except OSError as exc:  # it is registered this time; a restart will need a new id
            log.warning("gpu-client %s: cannot keep its client secret in %s: %s", self.client_id, path, exc.strerror)

    def renew(self) -> None:
        """The server holds another secret for this id: go on under a new id (and no secret yet)."""
        old = self.client_id
        self.client_id = f"{self.base_id}-{uuid.uuid4().hex[:6]}"
        self.secret = None
        log.warning("gpu-client %s: the server holds another client secret for this id (this work dir does not "
                    "have it, or another agent uses the id); registering as %s", old, self.client_id)
