"""What a caller may use of the server: request sizes, rate limits, and each room's quotas.

- Sizes: every request body but an artifact's bytes is at most ``MAX_REQUEST_BYTES`` (Flask's
  ``MAX_CONTENT_LENGTH``; ``http._json_body`` says it in words, 413); an artifact's bytes stream
  within ``MAX_ARTIFACT_BYTES`` and what is left of the room's quota (``artifact_allowance``).
- Rate limits, by the caller's address (the ``limits`` library's moving windows; in memory unless
  ``RATELIMIT_STORAGE_URI`` names a shared one, such as ``redis://``, for several server
  processes; memory storage works under gevent):
  - ``POST /api/v1/rooms``: ``RATE_LIMIT_ROOMS``;
  - ``GET``/``POST /api/v1/link`` (a GPU client's link measurement, donor token): together
    ``RATE_LIMIT_LINK``;
  - failed authentication: once an address made ``RATE_LIMIT_AUTH_FAILURES`` requests with a
    wrong room token or rank key (answered 401 or 403), every request it makes to a route that
    authenticates is refused (429) until the window passes; Socket.IO connections with a wrong
    token count alike (``socket_auth``).
  A refused request is answered 429 (``too_many_requests``) and changes nothing. A rate of
  several windows (``20 per second; 600 per minute``) holds in each.
  - ``POST /api/v1/jobs/<id>/events``: ``RATE_LIMIT_EVENTS`` per rank of the job (its key), not
    per address (``check_event_rate``).
  In memory, expired windows are dropped every ``PURGE_INTERVAL`` seconds (``PurgedMemoryStorage``),
  not every 10 ms as the library's memory storage does; what is counted is the same.
- Quotas per room (0: none): ``ROOM_MAX_JOBS`` jobs waiting or running at once
  (``check_job_quota``, at submit), ``ROOM_MAX_ARTIFACT_BYTES`` bytes of artifacts and events
  together (an event's bytes: its JSON, ``store.base.event_bytes``), ``ROOM_MAX_EVENTS`` events
  (``check_event_quota``). Over them: 429 ``quota_exceeded`` with ``limit`` and ``used``, and
  nothing stored. ``usage`` says where a room stands (``GET /api/v1/room`` and the dashboard's
  room overview).
"""
from __future__ import annotations

import functools
import threading
import time

from flask import Flask, current_app, request
from limits import parse_many
from limits.storage import MemoryStorage, storage_from_string
from limits.strategies import MovingWindowRateLimiter

from ..errors import QuotaExceeded, RateLimited
from ..protocol import ACTIVE, WAITING
from ..protocol.rest import RoomUsage
from .settings import settings

#: The route that creates rooms (anyone may call it): rate-limited per address.
ROOM_CREATION = "api.create_room"
#: The routes a GPU client times its link with: one rate limit for both, per address.
LINK_PROBES = ("links.link_down", "links.link_up")
#: Answers that mean the caller's token or rank key was wrong.
FAILED_AUTH = (401, 403)
#: Seconds an event post may go on a room's artifact bytes as read before (``check_event_quota``).
ARTIFACT_SUM_TTL = 5.0
#: The statuses a job counts against its room's ``ROOM_MAX_JOBS`` in.
OPEN = [*WAITING, *ACTIVE]
#: Seconds between two sweeps of the expired windows of the in-memory rate limits.
PURGE_INTERVAL = 1.0


class PurgedMemoryStorage(MemoryStorage):
    """The ``limits`` library's memory storage, its expired windows swept every ``PURGE_INTERVAL``
    seconds instead of 10 ms after each hit: a sweep walks every key (each rank of each job posting
    events has one), and one every 10 ms cost a busy server several % of a core. A moving window
    reads its entries' times, so a late sweep changes no answer, only how long the expired ones stay
    in memory (a window's list holds at most its limit's entries per window). A key whose
    windows all passed goes too (the library keeps its empty list: one per rank of every job
    ever, each walked at every sweep)."""

    def _MemoryStorage__schedule_expiry(self) -> None:  # the library's private hook, called on each hit
        if not self.timer.is_alive():
            self.timer = threading.Timer(PURGE_INTERVAL, self._sweep)
            self.timer.daemon = True
            self.timer.start()

    def acquire_entry(self, key: str, limit: int, expiry: int, amount: int = 1) -> bool:
        try:
            return super().acquire_entry(key, limit, expiry, amount)
        except KeyError:  # a sweep dropped the key between its setdefault and its insert: nothing counted yet
            return super().acquire_entry(key, limit, expiry, amount)

    def _sweep(self) -> None:
        self._MemoryStorage__expire_events()
        for key in [key for key, entries in list(self.events.items()) if not entries]:
            with self.locks[key]:  # the lock a hit on it holds between its setdefault and its insert
                if not self.events.get(key, True):
                    del self.events[key]
            self.locks.pop(key, None)


def _storage(uri: str):
    return PurgedMemoryStorage() if uri.split("://", 1)[0] == "memory" else storage_from_string(uri)


class RateLimits:
    """The server's rate limits: moving windows per caller address, counted in the storage
    ``RATELIMIT_STORAGE_URI`` names (the ``limits`` library's; ``memory://`` by default). Checked
    straight from the request hooks: a request costs one window lookup, and only a route that
    authenticates pays it."""

    def __init__(self, uri: str):
        self.window = MovingWindowRateLimiter(_storage(uri))

    def allowed(self, setting: str, scope: str) -> bool:
        """Whether the caller's address is still under ``setting``'s rates in ``scope`` (not counted)."""
        return all(self.window.test(rate, scope, _address()) for rate in _rates(getattr(settings(), setting.lower())))

    def hit(self, setting: str, scope: str, key: str | None = None) -> bool:
        """Count one for ``key`` (the caller's address by default); False when that took it over the rate."""
        return self.hit_rate(getattr(settings(), setting.lower()), scope, key or _address())

    def hit_rate(self, rate: str, scope: str, key: str) -> bool:
        """Count one for ``key`` in each of ``rate``'s windows ("20 per second; 600 per minute": both),
        in order; False at the first that was full (the later ones are not counted)."""
        return all(self.window.hit(item, scope, key) for item in _rates(rate))


@functools.lru_cache(maxsize=64)
def _rates(rate: str) -> tuple:
    return tuple(parse_many(rate))


def _address() -> str:
    return request.remote_addr or "?"  # behind PROXY_HOPS proxies, the client's (ProxyFix)


def init_app(app: Flask) -> RateLimits:
    """The app's rate limits (kept as ``ServerContext.limiter``): failed authentication counted
    per address over every route that authenticates, room creation and link probes limited per
    address. Call after the blueprints are registered."""
    limiter = RateLimits(app.extensions["zwdx"].settings.ratelimit_storage_uri)

    @app.before_request
    def _refuse_after_failures():
        if _authenticating() and not limiter.allowed("rate_limit_auth_failures", "auth-failures"):
            raise RateLimited("too many requests with a wrong room token or rank key from this address; wait and "
                              "retry")

    @app.after_request
    def _count_failures(response):
        if response.status_code in FAILED_AUTH and _authenticating():
            limiter.hit("rate_limit_auth_failures", "auth-failures")
        return response

    def limited(view, setting: str, scope: str, message: str):
        @functools.wraps(view)
        def checked(*args, **kwargs):
            if not limiter.hit(setting, scope):
                raise RateLimited(message)
            return view(*args, **kwargs)
        return checked

    app.view_functions[ROOM_CREATION] = limited(app.view_functions[ROOM_CREATION], "rate_limit_rooms", "rooms",
                                                "too many rooms created from this address; wait and retry")
    for endpoint in LINK_PROBES:  # one window for both
        app.view_functions[endpoint] = limited(app.view_functions[endpoint], "rate_limit_link", "link",
                                               "too many link measurements from this address; wait and retry")
    return limiter


def _authenticating() -> bool:
    """Whether the request's route asks for a token or key (those that do not are never counted nor refused)."""
    view = current_app.view_functions.get(request.endpoint or "")
    operation = getattr(view, "operation", None)
    return operation is not None and operation.auth.value != "none"


def socket_auth(ok: bool | None = None) -> None:
    """A Socket.IO connection's token: before it is checked (``ok`` None), ``RateLimited`` if
    the caller's address failed too often; afterwards, ``ok=False`` counts one failure."""
    limiter = current_app.extensions["zwdx"].limiter
    if ok is None and not limiter.allowed("rate_limit_auth_failures", "socket-auth-failures"):
        raise RateLimited("too many connections with a wrong room token from this address; wait and retry")
    if ok is False:
        limiter.hit("rate_limit_auth_failures", "socket-auth-failures")


# -- quotas --------------------------------------------------------------------------------------
def _limit(name: str) -> int:
    return int(getattr(settings(), name))


def check_job_quota(room: dict) -> None:
    """``QuotaExceeded`` if the room has ``ROOM_MAX_JOBS`` jobs waiting or running already."""
    limit = _limit("room_max_jobs")
    if not limit:
        return
    used = current_app.extensions["zwdx"].store.count_jobs(room["id"], OPEN)
    if used >= limit:
        raise QuotaExceeded(f"room {room['id']} has {used} job(s) waiting or running, its quota is {limit}: "
                            f"wait for one to end (or cancel one)", limit=limit, used=used)


def _stored_bytes(room_id: str) -> int:
    """What counts against ``ROOM_MAX_ARTIFACT_BYTES``: the room's artifacts and events."""
    store = current_app.extensions["zwdx"].store
    return store.room_artifact_bytes(room_id) + store.room_event_usage(room_id)["bytes"]


def artifact_allowance(room_id: str, max_bytes: int) -> tuple[int, bool]:
    """How many bytes an artifact of the room may have now: ``max_bytes``, or less when the
    room's quota has less left; and whether the quota is what limits it."""
    limit = _limit("room_max_artifact_bytes")
    if not limit:
        return max_bytes, False
    left = max(0, limit - _stored_bytes(room_id))
    return (left, True) if left < max_bytes else (max_bytes, False)


def artifact_quota_exceeded(room_id: str, size: int | None = None) -> QuotaExceeded:
    """The error for an artifact of ``size`` bytes (None: unknown, over what is left) that the room's quota has no room for."""
    limit = _limit("room_max_artifact_bytes")
    used = _stored_bytes(room_id)
    what = f"an artifact of {size} bytes" if size is not None else "the artifact"
    return QuotaExceeded(f"room {room_id} keeps {used} bytes of artifacts and events, its quota is {limit}: {what} "
                         f"does not fit (finished jobs' artifacts go after the retention the server keeps)",
                         limit=limit, used=used)


def check_event_rate(job_id: str, rank: int | None) -> None:
    """``RateLimited`` once this rank of the job posted events ``RATE_LIMIT_EVENTS`` times in the window."""
    if not current_app.extensions["zwdx"].limiter.hit("rate_limit_events", "events", f"{job_id}:{rank}"):
        raise RateLimited(f"rank {rank} of job {job_id} posts events faster than the server takes them "
                          f"({settings().rate_limit_events}); send larger batches less often",
                          job_id=job_id, rank=rank)


def check_event_quota(room_id: str, events: int, size: int) -> None:
    """``QuotaExceeded`` if ``events`` more events of ``size`` bytes would take the room past
    ``ROOM_MAX_EVENTS`` or ``ROOM_MAX_ARTIFACT_BYTES``. Checked before the write: posts racing
    each other may go past a quota by a batch each (``MAX_REQUEST_BYTES``)."""
    rows_limit, bytes_limit = _limit("room_max_events"), _limit("room_max_artifact_bytes")
    if not rows_limit and not bytes_limit:
        return
    held = current_app.extensions["zwdx"].store.room_event_usage(room_id)
    if rows_limit and held["events"] + events > rows_limit:
        raise QuotaExceeded(f"room {room_id} keeps {held['events']} events, its quota is {rows_limit}: {events} more "
                            f"do not fit (report metrics less often, or fewer of them)",
                            limit=rows_limit, used=held["events"])
    if not bytes_limit:
        return
    # the artifacts' sum as read at most ARTIFACT_SUM_TTL ago: MongoDB adds it up in Python, and a
    # room of many dataset chunks would pay that on every post (uploads read it afresh)
    seen = current_app.extensions.setdefault("zwdx.artifact_sums", {})
    at, artifacts = seen.get(room_id, (0.0, 0))
    if time.monotonic() - at > ARTIFACT_SUM_TTL:
        artifacts = current_app.extensions["zwdx"].store.room_artifact_bytes(room_id)
        seen[room_id] = (time.monotonic(), artifacts)
    used = artifacts + held["bytes"]
    if used + size > bytes_limit:
        raise QuotaExceeded(f"room {room_id} keeps {used} bytes of artifacts and events, its quota is {bytes_limit}: "
                            f"{events} events of {size} bytes do not fit", limit=bytes_limit, used=used)


def usage(room_id: str) -> RoomUsage:
    """What the room uses of its quotas."""
    store = current_app.extensions["zwdx"].store
    held = store.room_event_usage(room_id)
    return RoomUsage(jobs=store.count_jobs(room_id, OPEN), jobs_limit=_limit("room_max_jobs"),
                     artifact_bytes=store.room_artifact_bytes(room_id),
                     artifact_bytes_limit=_limit("room_max_artifact_bytes"),
                     events=held["events"], event_bytes=held["bytes"], events_limit=_limit("room_max_events"))
