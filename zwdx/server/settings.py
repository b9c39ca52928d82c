"""The server's settings, typed and checked once as it starts.

    ServerConfig.from_sources(flags, env) -> ServerConfig   # defaults < ZWDX_<NAME> < flags
    settings() -> the current app's ServerConfig (in a request or an app context)

Every setting has a field here (lowercase) and a key (uppercase: ``CLIENT_TIMEOUT``), which is
also its environment variable (``ZWDX_CLIENT_TIMEOUT``), the key of ``create_app``'s mapping and
of ``app.config`` (kept as a mirror, for Flask and extensions). A bad value fails at start with
its name and what was expected, not at the first request that reads it. The limits and the
connections' timeouts, which ``zwdx server`` also takes as flags, are declared with their flags
in zwdx/server_limits.py (``Limits``, which this model extends).
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from flask import current_app
from pydantic import ConfigDict, Field, ValidationError

from .. import defaults
from ..server_limits import Limits, Rate, Seconds, Size

PREFIX = "ZWDX_"


class ServerConfig(Limits):
    """What the server reads of its settings (docs/configuration.md says what each does)."""
    model_config = ConfigDict(frozen=True, extra="ignore", str_strip_whitespace=True)

    data_dir: str = Field(default_factory=lambda: os.path.abspath("zwdx-data"))
    mongo_uri: str | None = None
    async_mode: Literal["gevent", "threading"] = "threading"
    #: the dashboard's build; None: the one installed with the package (ui.find_dashboard)
    ui_dir: str | None = None
    #: Socket.IO's message queue (redis://host:port/db) shared by several server processes on one
    #: store; None: one process (docs/deploy-scale.md)
    message_queue: str | None = None
    scheduler_lease_ttl: Seconds = defaults.SCHEDULER_LEASE_TTL
    #: False: no scheduler loop (the in-process tests, which step it themselves)
    scheduler: bool = True
    #: None: GET /metrics answers loopback addresses only (prometheus.py)
    metrics_token: str | None = None
    ratelimit_storage_uri: str = "memory://"
    max_artifact_bytes: Size = defaults.MAX_ARTIFACT_BYTES
    rate_limit_link: Rate = defaults.RATE_LIMIT_LINK
    link_probe_max_bytes: Size = defaults.LINK_PROBE_MAX_BYTES
    unreachable_ttl: Seconds = defaults.UNREACHABLE_TTL
    #: parallelism="AUTO" (``auto.py``): the slowest link to the server (bytes/s) for DDP across hosts,
    #: the share of a slot's free memory held back, activations per parameter byte when not given
    auto_min_link: Annotated[float, Field(gt=0)] = defaults.AUTO_MIN_LINK
    auto_margin: Annotated[float, Field(ge=0, lt=1)] = defaults.AUTO_MARGIN
    auto_activation_factor: Annotated[float, Field(ge=0)] = defaults.AUTO_ACTIVATION_FACTOR
    unattached_grace: Seconds = defaults.UNATTACHED_GRACE
    client_timeout: Seconds = defaults.CLIENT_TIMEOUT
    heartbeat_interval: Seconds = defaults.HEARTBEAT_INTERVAL
    heartbeat_rate: Annotated[float, Field(ge=0)] = defaults.HEARTBEAT_RATE
    collective_timeout: Seconds = defaults.COLLECTIVE_TIMEOUT
    reserve_timeout: Seconds = defaults.RESERVE_TIMEOUT

    @classmethod
    def keys(cls) -> list[str]:
        """Every setting's key (``CLIENT_TIMEOUT``)."""
        return [name.upper() for name in cls.model_fields]

    @classmethod
    def from_sources(cls, flags: Mapping[str, Any] | None = None,
                     env: Mapping[str, str] | None = None) -> ServerConfig:
        """The defaults, overridden by ``ZWDX_<KEY>`` in ``env`` (a JSON value, else the text, as
        Flask's ``from_prefixed_env`` reads them), overridden by ``flags`` (keys as ``app.config``'s).
        ``ValueError`` naming the first bad setting, where it came from and what it expected."""
        values: dict[str, Any] = {}
        where: dict[str, str] = {}
        for key in cls.keys():
            if env is not None and PREFIX + key in env:
                values[key.lower()], where[key.lower()] = _decoded(env[PREFIX + key]), PREFIX + key
            if flags is not None and key in flags:
                values[key.lower()], where[key.lower()] = flags[key], key
        return cls._checked(values, where)

    @classmethod
    def _checked(cls, values: dict[str, Any], where: dict[str, str]) -> ServerConfig:
        try:
            return cls(**values)
        except ValidationError as exc:
            error = exc.errors()[0]
            name = str(error["loc"][0]) if error["loc"] else "?"
            message = str(error["msg"]).removeprefix("Value error, ")
            got = "" if repr(values.get(name)) in message else f", got {values.get(name)!r}"
            raise ValueError(f"server setting {where.get(name, name.upper())}: {message}{got}") from None

    def replace(self, **changes: Any) -> ServerConfig:
        """A copy with ``changes`` (keys or field names: ``START_TIMEOUT=0.3``), checked as at start."""
        values = self.model_dump()
        values.update({name.lower(): value for name, value in changes.items()})
        return self._checked(values, {name.lower(): name for name in changes})

    def as_config(self) -> dict[str, Any]:
        """The settings by key, as ``app.config`` mirrors them."""
        return {name.upper(): value for name, value in self.model_dump().items()}


def _decoded(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def settings() -> ServerConfig:
    """The current app's settings (``ServerContext.settings``)."""
    return current_app.extensions["zwdx"].settings  # type: ignore[no-any-return]


__all__ = ["ServerConfig", "settings"]
