"""The server's settings, typed and checked once as it starts.

    ServerConfig.from_sources(flags, env) -> ServerConfig   # defaults < ZWDX_<NAME> < flags
    settings() -> the current app's ServerConfig (in a request or an app context)

Every setting has a field here (lowercase) and a key (uppercase: ``CLIENT_TIMEOUT``), which is
also its environment variable (``ZWDX_CLIENT_TIMEOUT``), the key of ``create_app``'s mapping and
of ``app.config`` (kept as a mirror, for Flask and extensions). A bad value fails at start with
its name and what was expected, not at the first request that reads it.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from flask import current_app
from limits import parse_many
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from .. import defaults, sizes

PREFIX = "ZWDX_"


def _none_is_zero(value: Any) -> Any:
    return 0 if value is None or value == "" else value


def _size(value: Any) -> Any:
    value = _none_is_zero(value)
    return sizes.parse(value) if isinstance(value, str) else value  # its error names what it expected


def _rate(value: str) -> str:
    try:
        parse_many(value)
    except ValueError:
        raise ValueError("expected a rate such as '20 per minute' or '20 per second; 600 per minute'") from None
    return value


#: seconds (0: off, where the setting says so); a count (0: no limit); bytes (units taken: 8GiB)
Seconds = Annotated[float, BeforeValidator(_none_is_zero), Field(ge=0)]
Count = Annotated[int, BeforeValidator(_none_is_zero), Field(ge=0)]
Size = Annotated[int, BeforeValidator(_size), Field(ge=0)]
Rate = Annotated[str, AfterValidator(_rate)]


class ServerConfig(BaseModel):
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
    max_request_bytes: Size = defaults.MAX_REQUEST_BYTES
    room_max_jobs: Count = defaults.ROOM_MAX_JOBS
    room_max_artifact_bytes: Size = defaults.ROOM_MAX_ARTIFACT_BYTES
    room_max_events: Count = defaults.ROOM_MAX_EVENTS
    max_series_points: Count = defaults.MAX_SERIES_POINTS
    min_free_bytes: Size = defaults.MIN_FREE_BYTES
    rate_limit_events: Rate = defaults.RATE_LIMIT_EVENTS
    rate_limit_rooms: Rate = defaults.RATE_LIMIT_ROOMS
    rate_limit_auth_failures: Rate = defaults.RATE_LIMIT_AUTH_FAILURES
    rate_limit_link: Rate = defaults.RATE_LIMIT_LINK
    #: None or empty: registers are not rate-limited
    rate_limit_registers: Annotated[Rate | None, BeforeValidator(lambda v: v or None)] = defaults.RATE_LIMIT_REGISTERS
    link_probe_max_bytes: Size = defaults.LINK_PROBE_MAX_BYTES
    unreachable_ttl: Seconds = defaults.UNREACHABLE_TTL
    #: parallelism="AUTO" (``auto.py``): the slowest link to the server (bytes/s) for DDP across hosts,
    #: the share of a slot's free memory held back, activations per parameter byte when not given
    auto_min_link: Annotated[float, Field(gt=0)] = defaults.AUTO_MIN_LINK
    auto_margin: Annotated[float, Field(ge=0, lt=1)] = defaults.AUTO_MARGIN
    auto_activation_factor: Annotated[float, Field(ge=0)] = defaults.AUTO_ACTIVATION_FACTOR
    sweep_interval: Seconds = defaults.SWEEP_INTERVAL
    unattached_grace: Seconds = defaults.UNATTACHED_GRACE
    artifact_retention: Seconds = defaults.ARTIFACT_RETENTION
    client_timeout: Seconds = defaults.CLIENT_TIMEOUT
    client_retention: Seconds = defaults.CLIENT_RETENTION
    heartbeat_interval: Seconds = defaults.HEARTBEAT_INTERVAL
    heartbeat_rate: Annotated[float, Field(ge=0)] = defaults.HEARTBEAT_RATE
    collective_timeout: Seconds = defaults.COLLECTIVE_TIMEOUT
    reserve_timeout: Seconds = defaults.RESERVE_TIMEOUT
    start_timeout: Seconds = defaults.START_TIMEOUT
    start_tries: Count = defaults.START_TRIES
    donor_max_clients: Count = defaults.DONOR_MAX_CLIENTS
    client_max_slots: Count = defaults.CLIENT_MAX_SLOTS
    header_timeout: Seconds = defaults.HEADER_TIMEOUT
    idle_timeout: Seconds = defaults.IDLE_TIMEOUT
    body_timeout: Seconds = defaults.BODY_TIMEOUT
    max_connections_per_address: Count = defaults.MAX_CONNECTIONS_PER_ADDRESS
    socket_sessions_per_address: Count = defaults.SOCKET_SESSIONS_PER_ADDRESS
    socket_auth_timeout: Seconds = defaults.SOCKET_AUTH_TIMEOUT
    #: reverse proxies in front whose X-Forwarded-For/-Proto to believe (docker-compose's tls profile: 1)
    proxy_hops: Count = 0

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
