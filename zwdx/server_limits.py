"""The server's limits and its connections' timeouts: the settings ``zwdx server`` also takes as
flags, each declared once, here, as a typed field with its flag (``Flag``).

``ServerConfig`` (zwdx/server/settings.py) extends ``Limits``: these are its fields, checked as
every other setting is (defaults < ``ZWDX_<NAME>`` < flags). They live outside ``zwdx.server``
so that ``zwdx``'s parser builds without importing the server (the CLI builds it before gevent
patches the standard library, and for every command): ``add_arguments`` gives ``zwdx server`` one
flag per field that has a ``Flag``, and ``flag_values`` reads them back as settings' keys.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Annotated, Any, Callable

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from . import defaults, sizes


def _none_is_zero(value: Any) -> Any:
    return 0 if value is None or value == "" else value


def _size(value: Any) -> Any:
    value = _none_is_zero(value)
    return sizes.parse(value) if isinstance(value, str) else value  # its error names what it expected


def _rate(value: str) -> str:
    from limits import parse_many  # not at import: limits imports ssl, which gevent patches later
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


@dataclass(frozen=True)
class Flag:
    """A setting's flag of ``zwdx server``: ``--<field-name>`` in ``group`` (``GROUPS``), read
    with ``type``; unset, the setting is the environment's ``ZWDX_<NAME>``, else its default."""
    group: str
    help: str
    type: Callable[[str], Any] = str
    metavar: str | None = None


def _size_flag(group: str, help: str) -> Flag:
    return Flag(group, help, sizes.argument, "SIZE")


#: The flags' groups in ``zwdx server --help``: (title, description).
GROUPS = {"limits": ("limits", "each also ZWDX_<NAME> in the environment (ZWDX_ROOM_MAX_JOBS=...)"),
          "connections": ("connections", "each also ZWDX_<NAME> in the environment (ZWDX_HEADER_TIMEOUT=...)")}


class Limits(BaseModel):
    """What one request, room, donor, GPU client, rank or address may use, and how long a
    connection may take (docs/configuration.md says what each does)."""
    model_config = ConfigDict(frozen=True, extra="ignore", str_strip_whitespace=True)

    max_request_bytes: Annotated[Size, _size_flag(
        "limits", f"largest request body but an artifact's (default {sizes.human(defaults.MAX_REQUEST_BYTES)})")] \
        = defaults.MAX_REQUEST_BYTES
    room_max_jobs: Annotated[Count, Flag(
        "limits", f"jobs a room may have waiting or running, 0: no limit (default {defaults.ROOM_MAX_JOBS})",
        int)] = defaults.ROOM_MAX_JOBS
    room_max_artifact_bytes: Annotated[Size, _size_flag(
        "limits", f"bytes of artifacts a room may keep, 0: no limit "
                  f"(default {sizes.human(defaults.ROOM_MAX_ARTIFACT_BYTES)})")] = defaults.ROOM_MAX_ARTIFACT_BYTES
    room_max_events: Annotated[Count, Flag(
        "limits", f"metric and log events a room may keep (their bytes count in --room-max-artifact-bytes), "
                  f"0: no limit (default {defaults.ROOM_MAX_EVENTS})", int)] = defaults.ROOM_MAX_EVENTS
    rate_limit_events: Annotated[Rate, Flag(
        "limits", f"event posts one rank of a job may make (default '{defaults.RATE_LIMIT_EVENTS}')")] \
        = defaults.RATE_LIMIT_EVENTS
    max_series_points: Annotated[Count, Flag(
        "limits", f"points a job's metric series shows at most; a longer one is thinned, keeping its first "
                  f"and last (default {defaults.MAX_SERIES_POINTS})", int)] = defaults.MAX_SERIES_POINTS
    min_free_bytes: Annotated[Size, _size_flag(
        "limits", f"free bytes kept on the data dir's disk: below, uploads, events and jobs are refused "
                  f"(507), 0: no floor (default {defaults.MIN_FREE_BYTES})")] = defaults.MIN_FREE_BYTES
    rate_limit_rooms: Annotated[Rate, Flag(
        "limits", f"rooms one address may create (default '{defaults.RATE_LIMIT_ROOMS}')")] = defaults.RATE_LIMIT_ROOMS
    rate_limit_auth_failures: Annotated[Rate, Flag(
        "limits", f"wrong tokens one address may send before it is refused "
                  f"(default '{defaults.RATE_LIMIT_AUTH_FAILURES}')")] = defaults.RATE_LIMIT_AUTH_FAILURES
    start_timeout: Annotated[Seconds, Flag(
        "limits", f"seconds a placed job's ranks get to report running before the job is placed again on "
                  f"other GPU clients, 0: never (default {defaults.START_TIMEOUT:g})", float)] = defaults.START_TIMEOUT
    start_tries: Annotated[Count, Flag(
        "limits", f"placements that did not start after which a job fails (default {defaults.START_TRIES})",
        int)] = defaults.START_TRIES
    donor_max_clients: Annotated[Count, Flag(
        "limits", f"GPU clients one donor token may have online at once, 0: no limit "
                  f"(default {defaults.DONOR_MAX_CLIENTS})", int)] = defaults.DONOR_MAX_CLIENTS
    client_max_slots: Annotated[Count, Flag(
        "limits", f"slots one GPU client may offer, 0: no limit (default {defaults.CLIENT_MAX_SLOTS})", int)] \
        = defaults.CLIENT_MAX_SLOTS
    #: None or empty: registers are not rate-limited
    rate_limit_registers: Annotated[Rate | None, BeforeValidator(lambda v: v or None), Flag(
        "limits", f"registers one donor token may make (default '{defaults.RATE_LIMIT_REGISTERS}')")] \
        = defaults.RATE_LIMIT_REGISTERS
    client_retention: Annotated[Seconds, Flag(
        "limits", f"seconds a GPU client may stay offline before it is dropped from its room's list, unless "
                  f"the room sets its own (zwdx room settings), 0: never (default {defaults.CLIENT_RETENTION:g})",
        float)] = defaults.CLIENT_RETENTION
    artifact_retention: Annotated[Seconds, Flag(
        "limits", "seconds a finished job keeps its artifacts, 0: for ever (default 0)", float)] \
        = defaults.ARTIFACT_RETENTION
    sweep_interval: Annotated[Seconds, Flag(
        "limits", f"seconds between sweeps of unreferenced artifacts, 0: never "
                  f"(default {defaults.SWEEP_INTERVAL:g})", float)] = defaults.SWEEP_INTERVAL
    header_timeout: Annotated[Seconds, Flag(
        "connections", f"seconds a connection has to send a request's line and headers, 0: no limit "
                       f"(default {defaults.HEADER_TIMEOUT:g})", float)] = defaults.HEADER_TIMEOUT
    idle_timeout: Annotated[Seconds, Flag(
        "connections", f"seconds a kept-alive connection may wait for its next request, 0: no limit "
                       f"(default {defaults.IDLE_TIMEOUT:g})", float)] = defaults.IDLE_TIMEOUT
    body_timeout: Annotated[Seconds, Flag(
        "connections", f"seconds a JSON body has to arrive once its headers are in, 0: no limit "
                       f"(default {defaults.BODY_TIMEOUT:g})", float)] = defaults.BODY_TIMEOUT
    max_connections_per_address: Annotated[Count, Flag(
        "connections", f"connections one address may hold at once, 0: no cap; not applied behind "
                       f"ZWDX_PROXY_HOPS proxies (default {defaults.MAX_CONNECTIONS_PER_ADDRESS})", int)] \
        = defaults.MAX_CONNECTIONS_PER_ADDRESS
    socket_sessions_per_address: Annotated[Count, Flag(
        "connections", f"Socket.IO sessions one address may have open, 0: no cap "
                       f"(default {defaults.SOCKET_SESSIONS_PER_ADDRESS})", int)] = defaults.SOCKET_SESSIONS_PER_ADDRESS
    socket_auth_timeout: Annotated[Seconds, Flag(
        "connections", f"seconds a Socket.IO session has to connect with its token before it is closed, 0: no "
                       f"limit (default {defaults.SOCKET_AUTH_TIMEOUT:g})", float)] = defaults.SOCKET_AUTH_TIMEOUT
    #: reverse proxies in front whose X-Forwarded-For/-Proto to believe (docker-compose's tls profile: 1)
    proxy_hops: Annotated[Count, Flag(
        "connections", "reverse proxies in front (nginx, HAProxy) whose X-Forwarded-For and -Proto to believe, so "
                       "that rate limits and /metrics see the client's address (default: $ZWDX_PROXY_HOPS, else 0)",
        int)] = 0


def flags() -> dict[str, Flag]:
    """Each field that has a flag, by field name, in the order declared."""
    return {name: flag for name, field in Limits.model_fields.items()
            for flag in field.metadata if isinstance(flag, Flag)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field that has one (``--room-max-jobs``), in its group; unset: None."""
    groups = {key: parser.add_argument_group(title, description) for key, (title, description) in GROUPS.items()}
    for name, flag in flags().items():
        groups[flag.group].add_argument("--" + name.replace("_", "-"), type=flag.type, default=None,
                                        metavar=flag.metavar, help=flag.help)


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The flags given, by setting key (``ROOM_MAX_JOBS``): those unset are left to the environment
    and the defaults."""
    return {name.upper(): getattr(args, name) for name in flags() if getattr(args, name) is not None}


__all__ = ["Count", "Flag", "Limits", "Rate", "Seconds", "Size", "add_arguments", "flag_values", "flags"]
