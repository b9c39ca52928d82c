"""What the REST routes share: one decorator that declares an operation and checks its input
once, at the edge (FastAPI's habit, applied to Flask), and the helpers handlers call.

    @operation(bp, "POST", "/jobs", "Submit a job", body=SubmitJob, answer=Submitted, status=201)
    def create_job(room: dict, body: SubmitJob) -> Submitted: ...

``operation`` registers the route on the blueprint and, before the handler runs:
1. checks who asks (``auth``, ``auth.py``): ``Auth.ROOM`` a submitter token of the room
   (``room``; ``job`` too when the path names a job, which must be the room's: other rooms'
   jobs are "not found"), ``Auth.JOB`` the key of a rank of the job's current attempt
   (``job`` and ``sender``, the rank it speaks for; ``late``: also for a moment after the job
   failed), ``Auth.ROOM_OR_JOB`` either, ``Auth.DONOR`` a donor token (a GPU client's link
   measurement), ``Auth.NONE`` nothing;
2. checks the path's integers, then the query as ``query`` (a ``zwdx.protocol.rest.Query``)
   and the JSON body as ``body`` (a ``Message``), each through ``parse``: a wrong one is a 400
   whose ``field`` names its path, and nothing is changed;
3. passes the handler the arguments it declares of ``room``, ``caller`` (the token's record),
   ``job``, ``sender``, ``body``, ``query`` and the path's values, and turns its answer (a declared ``Answer``; ``(answer, status)`` for
   another status it declares) into JSON, or passes a ``Response`` (an artifact's bytes) through.

The operation is kept on the view function (``view.operation``), where ``openapi.py`` reads
the route table to describe the API.

    ctx()                       -> ServerContext of the current app (config, store, artifacts, scheduler)
    save_artifact(room, kind)   -> stores the request's streamed bytes (size and sha256 checked)
    stream(artifact)            -> a streamed response of an artifact's bytes
    job_artifact(job, id, kind) -> the artifact, if it is the job's and of that kind
"""
from __future__ import annotations

import functools
import inspect
import json
import logging
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from enum import Enum

import orjson
from flask import Response, current_app, request
from pydantic import BaseModel
from werkzeug.exceptions import RequestEntityTooLarge

from .. import defaults
from ..errors import BadRequest, NotFound, PayloadTooLarge, ZwdxError
from ..protocol.base import LONG_NUMBER_BYTES, parse
from ..protocol.rest import ArtifactView
from . import connections, json_limits, limits
from .auth import donor, job_in_room, rank_sender, request_token, submitter
from .settings import settings

log = logging.getLogger(__name__)

#: Where every REST route lives.
P = defaults.API_PREFIX

#: Largest JSON body a route reads by default (config ``MAX_REQUEST_BYTES``; artifact bytes
#: stream apart, with their own limit).
MAX_JSON_BYTES = defaults.MAX_REQUEST_BYTES
#: Deepest nesting of a JSON body (``json_limits``): a deeper one is refused before it is parsed.
MAX_JSON_DEPTH = json_limits.MAX_JSON_DEPTH
#: Bytes of a JSON body read (and checked) at a time.
_CHUNK = 64 * 1024
#: Largest count in a path (a rank, a checkpoint's number): what JSON readers keep exact.
MAX_PATH_INT = 2**53

#: Body and answer of an operation that carries an artifact's bytes.
OCTET = "application/octet-stream"


class Auth(str, Enum):
    """What an operation needs of its caller (``auth.py``)."""
    NONE = "none"                # nothing
    ROOM = "room"                # a submitter token of the room (X-Zwdx-Room-Token); a donor token is refused
    JOB = "job"                  # a rank key of the job's current attempt (X-Zwdx-Rank-Key): its rank processes
    ROOM_OR_JOB = "room or job"  # either (a checkpoint's files: the submitter, and the ranks that resume from it)
    DONOR = "donor"              # a donor token of the room (a GPU client's); a submitter token is refused


@dataclass(frozen=True)
class Operation:
    """One REST operation as declared: what ``openapi.py`` describes and ``operation`` checks."""
    name: str                                     # the handler's name: the endpoint, the operationId
    method: str
    rule: str                                     # Flask's rule, under the API prefix
    summary: str
    description: str
    auth: Auth
    tag: str
    body: type[BaseModel] | str | None            # a Message, OCTET, or None
    query: type[BaseModel] | None
    #: status -> an Answer model, OCTET, or "text/html"; the first is the usual answer
    answers: dict[int, type[BaseModel] | str] = field(default_factory=dict)
    #: statuses of errors it may answer (``ErrorAnswer``)
    errors: tuple[int, ...] = ()
    #: the path's parameters, in order: name -> ``int`` (a count: a rank, a checkpoint's number) or ``str``
    path: dict[str, type] = field(default_factory=dict)
    #: ``Auth.JOB``: a rank's key is taken for a moment after its job failed too (``auth.rank_sender``)
    late: bool = False


def _errors(auth: Auth, rule: str, checks_input: bool, json_body: bool, more: tuple[int, ...]) -> tuple[int, ...]:
    """The error statuses an operation may answer: 400 when it reads input (413 when that is a
    JSON body), 401 and 403 with a token or a key (and 429 once its caller failed too often,
    ``limits.py``), 404 when its path names a job or an artifact, and ``more``."""
    out = set(more)
    if checks_input:
        out.add(400)
    if json_body:
        out.add(413)
    if auth is not Auth.NONE:
        out.update((401, 403, 429))
    if "<job_id>" in rule or "<artifact_id>" in rule:
        out.add(404)
    return tuple(sorted(out))


def operation(bp, method: str, rule: str, summary: str, *, auth: Auth = Auth.ROOM, body=None, query=None,
              answer=None, status: int = 200, answers: dict | None = None, errors: tuple[int, ...] = (),
              tag: str = "", prefix: str = P, late: bool = False, refused=None):
    """Declare a REST operation on ``bp`` (see the module's docstring). ``answer`` is the model
    of the ``status`` answer; ``answers`` adds other statuses; ``errors`` adds error statuses
    to those implied; ``late`` (``Auth.JOB``): a failed job's rank keys are taken for a moment;
    ``refused(room, data)``: called with the caller's room and the JSON body as sent when a
    caller who passed ``auth`` is refused (its body or the handler raised a ``ZwdxError``), to
    undo what the request's earlier ones left for it (a submit's uploaded bundle)."""
    full = prefix + rule

    def decorate(handler):
        signature = inspect.signature(handler, eval_str=True)
        wants = set(signature.parameters)
        path_types = {name: int if name in wants and signature.parameters[name].annotation is int else str
                      for name in re.findall(r"<([a-z_]+)>", full)}
        json_in = isinstance(body, type)
        op = Operation(name=handler.__name__, method=method.upper(), rule=full, summary=summary, auth=auth,
                       tag=tag or bp.name, description=inspect.cleandoc(handler.__doc__ or ""), body=body,
                       query=query, answers={status: answer, **(answers or {})}, path=path_types, late=late,
                       errors=_errors(auth, full, bool(json_in or query or int in path_types.values()), json_in,
                                      errors))

        @functools.wraps(handler)
        def view(**path):
            args = dict(path)
            key = request.headers.get(defaults.RANK_KEY_HEADER)
            if auth is Auth.JOB or (auth is Auth.ROOM_OR_JOB and key is not None):
                args["job"], args["sender"] = rank_sender(path["job_id"], key, late)
            elif auth is Auth.DONOR:
                args["caller"] = donor(request_token())
                args["room"] = args["caller"].room
            elif auth is not Auth.NONE:
                args["caller"] = submitter(request_token())
                room = args["room"] = args["caller"].room
                if "job_id" in path:
                    args["job"] = job_in_room(path["job_id"], room)
            for name, kind in path_types.items():
                if kind is int:
                    args[name] = path_count(name, path[name])
            if query is not None:
                args["query"] = parse(query, request.args.to_dict(), "query")
            data = None
            try:
                if body is not None and body != OCTET:
                    args["body"] = parse(body, data := _json_body())
                return _answer(op, handler(**{k: v for k, v in args.items() if k in wants}))
            except ZwdxError:
                if refused is not None and data is not None and "room" in args:
                    try:
                        refused(args["room"], data)
                    except Exception:  # the caller still gets its refusal, not a 500
                        log.exception("server: undoing what a refused %s %s left failed", method, full)
                raise

        view.operation = op
        bp.add_url_rule(full, endpoint=handler.__name__, view_func=view, methods=[op.method])
        return view
    return decorate


def path_count(name: str, text: str) -> int:
    """A count in the path (a rank, a checkpoint's number): digits, at most ``MAX_PATH_INT``."""
    if not (text.isascii() and text.isdigit()) or len(text) > 16 or int(text) > MAX_PATH_INT:
        raise BadRequest(f"path '{name}' must be a whole number from 0 to {MAX_PATH_INT}, got {text[:50]!r}",
                         field=name)
    return int(text)


def _answer(op: Operation, out):
    """The handler's answer as the response: a declared model as JSON, a ``Response`` as is."""
    if isinstance(out, Response):
        return out
    out, status = out if isinstance(out, tuple) else (out, next(iter(op.answers)))
    declared = op.answers.get(status)
    if not (isinstance(declared, type) and isinstance(out, declared)):
        raise TypeError(f"{op.method} {op.rule} answered {type(out).__name__} with {status}, "
                        f"which it does not declare")
    # pydantic writes the JSON itself (non-finite numbers as strings: ``Answer``'s config), not
    # through a dict and json.dumps: the most frequent answers are the largest (a job, its events).
    return Response(out.model_dump_json(), status=status, mimetype="application/json")


def _json_body():
    """The request's body, decoded as JSON (an empty body is ``{}``), within ``MAX_REQUEST_BYTES``
    and ``MAX_JSON_DEPTH``, with no NaN or Infinity in it (no JSON has them; a rank's non-finite
    numbers are the strings "NaN", "Infinity", "-Infinity"), no number too large for a float and
    no object key with a NUL in it; ``BadRequest`` (or ``PayloadTooLarge``) otherwise."""
    limit = settings().max_request_bytes or MAX_JSON_BYTES
    if (request.content_length or 0) > limit:
        raise PayloadTooLarge(f"a JSON body is at most {limit} bytes", limit=limit)
    raw = _read_bounded(limit)
    if not raw.strip():
        return {}
    # orjson refuses NaN, Infinity and numbers past a float, as this must; it would read an
    # integer past 64 bits as a float, so a body with 19 digits in a row goes to json.
    body = None
    if not LONG_NUMBER_BYTES.search(raw):
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # json says which of those it was, and reads what orjson refuses (lone surrogates)
    if body is None:
        try:
            body = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
        except (ValueError, RecursionError) as exc:
            raise BadRequest(f"the body must be a JSON object; it is not JSON ({str(exc)[:100]})", field="body")
    json_limits.refuse_nul_key(raw, "the body", body)
    return body


def _read_bounded(limit: int) -> bytes:
    """The body, read a chunk at a time within ``limit`` bytes, its nesting followed as it comes
    (``json_limits.Depth``): a body too deep is refused at its first chunk past the limit, the
    rest unread, and the hub gets a turn between chunks."""
    depth, chunks, size = json_limits.Depth(), [], 0
    with connections.body_deadline(settings().body_timeout, request.environ):
        while True:
            chunk = request.stream.read(min(_CHUNK, limit + 1 - size))
            if not chunk:
                break
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"a JSON body is at most {limit} bytes", limit=limit)
            depth.feed(chunk)
            chunks.append(chunk)
            time.sleep(0)  # gevent's: other greenlets run between chunks
    depth.end()
    return b"".join(chunks)


def _no_constant(name: str):
    raise BadRequest(f"the body holds {name}, which is not JSON: send a non-finite number a job measured as the "
                     f"string \"NaN\", \"Infinity\" or \"-Infinity\"", field="body")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadRequest(f"the body holds a number too large for a float ({text[:40]})", field="body")
    return value


def ctx():
    """The ``ServerContext`` of the current app (``app.extensions["zwdx"]``)."""
    return current_app.extensions["zwdx"]


def save_artifact(room: dict, kind: str, job_id: str | None = None, **fields) -> ArtifactView:
    """Store the request's body as an artifact of the room (and the job): streamed to the
    artifact store within ``MAX_ARTIFACT_BYTES`` and the room's quota (``limits.py``), checked
    against the sha256 header if sent. Refused, it leaves nothing behind."""
    artifact_id = uuid.uuid4().hex
    allowed, by_quota = limits.artifact_allowance(room["id"], settings().max_artifact_bytes)

    def too_large(size: int | None = None) -> Exception:
        if by_quota:
            return limits.artifact_quota_exceeded(room["id"], size)
        return PayloadTooLarge(f"artifact larger than the limit of {allowed} bytes", limit=allowed)
    if request.content_length is not None and request.content_length > allowed:
        raise too_large(request.content_length)
    request.max_content_length = allowed + 1  # the bytes' own limit, not the JSON bodies': the copy stops first
    try:
        size, sha = ctx().artifacts.save(artifact_id, request.stream, allowed,
                                         request.headers.get(defaults.SHA256_HEADER))
    except (PayloadTooLarge, RequestEntityTooLarge):
        raise too_large() from None
    artifact = {"id": artifact_id, "room_id": room["id"], "kind": kind, "size": size, "sha256": sha,
                "job_id": job_id, "created_at": time.time(), **fields}
    try:
        return ArtifactView.model_validate(ctx().store.add_artifact(artifact))
    except BaseException:
        ctx().artifacts.delete(artifact_id)  # bytes no record names would never be read nor deleted
        raise


def stream(artifact: dict) -> Response:
    """The artifact's bytes as a streamed response, with their size and sha256 in the headers."""
    try:
        chunks = ctx().artifacts.open(artifact["id"])
    except (FileNotFoundError, KeyError, ValueError):
        raise NotFound(f"artifact {artifact['id']} has no bytes on this server", artifact_id=artifact["id"])
    headers = {"Content-Length": str(artifact["size"]), defaults.SHA256_HEADER: artifact["sha256"]}
    return Response(chunks, mimetype=OCTET, headers=headers)


def job_artifact(job, artifact_id: str, kind: str) -> dict | None:
    """The artifact ``artifact_id``, if it belongs to ``job`` (and its room) and is a ``kind``;
    None otherwise. Ids are plain strings here (``Id``-checked at the edge)."""
    if not isinstance(artifact_id, str):
        return None
    artifact = ctx().store.get_artifact(artifact_id)
    if artifact is None or artifact.get("job_id") != job.id or artifact.get("room_id") != job.room_id \
            or artifact.get("kind") != kind:
        return None
    return artifact
