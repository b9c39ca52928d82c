"""The exceptions zwdx raises, one tree for the SDK, the server and the GPU client.

    ZwdxError                      root: everything zwdx raises derives from it
    ├── ServerUnreachable          the SDK could not reach the server at all
    ├── BadRequest                 input that names a wrong or missing field (400)
    ├── PayloadTooLarge            an artifact over the configured size limit (413)
    ├── AuthError                  missing or wrong room token / rank key (401)
    ├── Forbidden                  the caller may not touch this object (403)
    ├── NotFound                   unknown room, job or artifact (404)
    ├── Conflict                   a state change that is no longer possible (409)
    │   └── Unschedulable          a job the room cannot run as it is, refused on request
    ├── RateLimited                too many requests from one address, or failed logins (429)
    ├── QuotaExceeded              a room over its quota of jobs, bytes or events (429)
    ├── InsufficientStorage        the server's disk is below its free-space floor, or full (507)
    ├── StoreError                 the store cannot be used (500)
    │   └── SchemaVersionError     the store was written by a newer zwdx
    ├── IntegrityError             an artifact whose sha256 does not match (422)
    └── JobFailed                  a job ended "failed"; carries every failing rank's traceback

Each error carries its context as attributes (``job_id``, ``status``, ``failures``) and
turns into ``{"error": {"code": ..., "message": ...}}`` on the wire.
"""
from __future__ import annotations


class ZwdxError(Exception):
    """Root of every zwdx error."""

    code = "zwdx_error"
    http_status = 500

    def __init__(self, message: str, **context):
        super().__init__(message)
        self.message = message
        self.context = context
        for key, value in context.items():
            setattr(self, key, value)

    def to_dict(self) -> dict:
        return {"error": {"code": self.code, "message": self.message, **self.context}}


class ServerUnreachable(ZwdxError):
    code = "server_unreachable"
    http_status = 503


class BadRequest(ZwdxError):
    code = "bad_request"
    http_status = 400


class PayloadTooLarge(ZwdxError):
    code = "payload_too_large"
    http_status = 413


class AuthError(ZwdxError):
    code = "unauthorized"
    http_status = 401


class Forbidden(ZwdxError):
    code = "forbidden"
    http_status = 403


class NotFound(ZwdxError):
    code = "not_found"
    http_status = 404


class Conflict(ZwdxError):
    code = "conflict"
    http_status = 409


class Unschedulable(Conflict):
    """``submit_job(..., fail_if_unschedulable=True)`` for a job the room cannot run as it is
    now (more ranks than its slots, more memory than any slot has): nothing was stored."""

    code = "unschedulable"


class RateLimited(ZwdxError):
    """Too many requests of a kind (rooms created, wrong tokens) from one address: wait and retry."""

    code = "too_many_requests"
    http_status = 429


class QuotaExceeded(ZwdxError):
    """The room holds as many jobs waiting or running, or as many artifact bytes, as the server
    allows (``limit``, ``used``): nothing was stored."""

    code = "quota_exceeded"
    http_status = 429


class InsufficientStorage(ZwdxError):
    """The server keeps less free disk than its floor (``MIN_FREE_BYTES``), or a write found the
    disk full: nothing of the request was stored; what was stored before stays readable."""

    code = "insufficient_storage"
    http_status = 507


class StoreError(ZwdxError):
    code = "store_error"
    http_status = 500


class SchemaVersionError(StoreError):
    code = "schema_version"


class IntegrityError(ZwdxError):
    code = "integrity_error"
    http_status = 422


class JobFailed(ZwdxError):
    """A job that ended failed. ``failures`` maps rank -> traceback text; ``failure_order``
    lists those ranks first failure first (a rank whose own code raised before the ranks that
    only lost their peers), the order ``str()`` shows them in."""

    code = "job_failed"
    http_status = 200

    def __init__(self, message: str, job_id: str = "", failures: dict | None = None,
                 reason: str = "", result: dict | None = None, failure_order: list | None = None):
        failures = {str(rank): tb for rank, tb in (failures or {}).items()}
        order = [str(r) for r in failure_order or [] if str(r) in failures]
        order += sorted((str(r) for r in failures if str(r) not in order), key=lambda r: (len(r), r))
        super().__init__(message, job_id=job_id, failures=failures, reason=reason, failure_order=order)
        self.result = result or {}

    def __str__(self) -> str:
        parts = [self.message]
        for rank in self.failure_order:
            parts.append(f"--- rank {rank} ---\n{self.failures[rank]}")
        return "\n".join(parts)


_BY_CODE = {cls.code: cls for cls in (
    BadRequest, PayloadTooLarge, AuthError, Forbidden, NotFound, Conflict, Unschedulable, RateLimited,
    QuotaExceeded, InsufficientStorage, StoreError, SchemaVersionError, IntegrityError)}


def from_response(status: int, body: dict | None) -> ZwdxError:
    """Rebuild the typed error that the server sent as JSON."""
    err = (body or {}).get("error") or {}
    code = err.get("code", "")
    message = err.get("message") or f"server answered HTTP {status}"
    cls = _BY_CODE.get(code)
    if cls is None:
        cls = {400: BadRequest, 401: AuthError, 403: Forbidden, 404: NotFound,
               409: Conflict, 413: PayloadTooLarge, 422: IntegrityError, 429: RateLimited,
               507: InsufficientStorage}.get(status, ZwdxError)
    context = {k: v for k, v in err.items() if k not in ("code", "message")}
    return cls(message, **context)
