"""The submitter's credential store: which room token opens which of their jobs.

The SDK remembers, per server URL, the submitter token of every room it created or submitted
to (never a donor token: those go to GPU clients), and
the room of every job it submitted, so that in a fresh process the job id is enough:

    ZWDX("http://server:4461").get_trained_model(job_id, Net())

One JSON file per user, ``credentials.json`` in ``$ZWDX_CONFIG_DIR``, else
``$XDG_CONFIG_HOME/zwdx``, else ``~/.config/zwdx``. The directory is made 0700 and the file
0600; every write replaces the file atomically under a lock, so two submitting processes
lose nothing. ``ZWDX(..., remember=False)`` or ``ZWDX_REMEMBER=0`` turns it off. Tokens are
secrets: nothing here prints or logs one.

    {"version": 1,
     "servers": {"http://server:4461": {"rooms": {room_id: token},
                                        "jobs": {job_id: room_id}}}}
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from contextlib import contextmanager

from filelock import FileLock

log = logging.getLogger(__name__)

FILE_NAME = "credentials.json"
VERSION = 1


def config_dir() -> str:
    """Where the store lives: ``$ZWDX_CONFIG_DIR``, ``$XDG_CONFIG_HOME/zwdx`` or ``~/.config/zwdx``."""
    explicit = os.environ.get("ZWDX_CONFIG_DIR")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "zwdx")


def remember_by_default() -> bool:
    """False when ``ZWDX_REMEMBER`` is 0, false, no or off."""
    return os.environ.get("ZWDX_REMEMBER", "1").strip().lower() not in ("0", "false", "no", "off")


class CredentialStore:
    """Room tokens and job -> room records of one user, per server URL."""

    def __init__(self, directory: str | None = None):
        self.directory = directory or config_dir()
        self.path = os.path.join(self.directory, FILE_NAME)

    # -- reading ---------------------------------------------------------------------------
    def _read(self) -> dict:
        try:
            with open(self.path, encoding="utf-8") as fh:
                data = json.load(fh)
        except FileNotFoundError:
            return {"version": VERSION, "servers": {}}
        except (OSError, ValueError) as exc:
            log.warning("zwdx: cannot read the credential store %s (%s); it is ignored", self.path,
                        type(exc).__name__)
            return {"version": VERSION, "servers": {}}
        if not isinstance(data, dict) or not isinstance(data.get("servers"), dict):
            return {"version": VERSION, "servers": {}}
        return data

    def token_for_job(self, server_url: str, job_id: str) -> str | None:
        """The token of the room the job was submitted to from this account, or None."""
        server = self._read()["servers"].get(_key(server_url)) or {}
        room_id = (server.get("jobs") or {}).get(job_id)
        return (server.get("rooms") or {}).get(room_id) if room_id else None

    def tokens(self, server_url: str) -> dict[str, str]:
        """room id -> token of the rooms known for this server."""
        return dict((self._read()["servers"].get(_key(server_url)) or {}).get("rooms") or {})

    # -- writing ---------------------------------------------------------------------------
    def remember_room(self, server_url: str, room_id: str, token: str) -> None:
        with self._update(server_url) as server:
            server["rooms"][room_id] = token

    def remember_job(self, server_url: str, job_id: str, room_id: str, token: str) -> None:
        with self._update(server_url) as server:
            server["rooms"][room_id] = token
            server["jobs"][job_id] = room_id

    def replace_token(self, server_url: str, old: str, new: str) -> None:
        """A token was rotated: the rooms that held ``old`` hold ``new`` from now on."""
        with self._update(server_url) as server:
            for room_id, token in list(server["rooms"].items()):
                if token == old:
                    server["rooms"][room_id] = new

    @contextmanager
    def _update(self, server_url: str):
        self._make_directory()
        with FileLock(self.path + ".lock", mode=0o600):
            data = self._read()
            server = data["servers"].setdefault(_key(server_url), {})
            server.setdefault("rooms", {})
            server.setdefault("jobs", {})
            yield server
            data["version"] = VERSION
            self._write(data)

    def _make_directory(self) -> None:
        if not os.path.isdir(self.directory):
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            os.chmod(self.directory, 0o700)  # whatever the umask

    def _write(self, data: dict) -> None:
        fd, tmp = tempfile.mkstemp(prefix=".credentials.", suffix=".tmp", dir=self.directory)  # made 0600
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(data, fh, indent=1, sort_keys=True)
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o600)
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise


def _key(server_url: str) -> str:
    return server_url.rstrip("/")
