"""The REST API described as an OpenAPI 3.1 document, made from the route table and the models.

    GET /api/v1/openapi.json   the document (no token needed)
    GET /api/v1/docs           a page that renders it, self-contained (``apidocs.py``): it loads
                               nothing from elsewhere, so it works on a machine with no internet

Every route is an ``http.operation``, which keeps its declaration on the view function
(``view.operation``): method, path, summary, how it authenticates, its query, body and
answers. Schemas are pydantic's JSON Schema (2020-12, the dialect of OpenAPI 3.1) of the
``zwdx.protocol`` models, bodies as they are checked and answers as they are written; errors
are ``ErrorAnswer``; artifact bytes are ``application/octet-stream`` with their sha256 in
``X-Zwdx-Sha256``.

Written by hand rather than with a library: spectree validates in its own way and answers in
its own error shape, and its pages load Swagger UI from a CDN; flask-openapi3 replaces Flask's
app and blueprint classes; apispec would only hold the dicts built here. The route table and
pydantic's schemas are most of the work, and both are ours already.
"""
from __future__ import annotations

import re

from flask import Blueprint, Response, current_app
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

import zwdx

from .. import defaults
from ..protocol.rest import ErrorAnswer, OpenApiDocument
from . import apidocs
from .http import OCTET, P, Auth, Operation, operation

bp = Blueprint("openapi", __name__)

HTML = "text/html"
_REF = "#/components/schemas/{model}"
_CACHE = "zwdx.openapi"

#: What each error status means here.
_ERRORS = {
    400: "Bad input: ``error.field`` names the wrong field (its path: ``versions.python``), "
         "``error.problems`` lists up to 20. Nothing was changed.",
    401: "No token (or rank key), or one that opens nothing: unknown or revoked.",
    403: "A token or key that may not do this: a donor token (it opens no REST route), a rank key of "
         "another rank, another attempt or a job that ended.",
    404: "No such job or artifact in this room (other rooms' are not found either).",
    409: "The job's state does not allow it (a job that ended; a bundle another job has).",
    413: "Larger than the server's limit (``error.limit``).",
    422: "The bytes do not match the sha256 announced in ``X-Zwdx-Sha256``.",
}

_SECURITY = {
    Auth.NONE: [],
    Auth.ROOM: [{"roomToken": []}],
    Auth.JOB: [{"rankKey": []}],
    Auth.ROOM_OR_JOB: [{"roomToken": []}, {"rankKey": []}],
    Auth.DONOR: [{"roomToken": []}],
}

_BINARY = {"type": "string", "contentMediaType": OCTET}
_SHA256 = {"type": "string", "pattern": "^[0-9a-fA-F]{64}$"}


def _text(doc: str) -> str:
    """A docstring as the document's text: reST's ````code```` as Markdown's ```code```."""
    return doc.replace("``", "`")


def operations(app) -> list[Operation]:
    """Every declared operation of the app, in the order the routes were registered."""
    return [op for rule in app.url_map.iter_rules()
            if (op := getattr(app.view_functions.get(rule.endpoint), "operation", None)) is not None]


def _path(rule: str) -> str:
    """Flask's ``/jobs/<job_id>/ranks/<rank>`` -> OpenAPI's ``/jobs/{job_id}/ranks/{rank}``."""
    return re.sub(r"<([a-z_]+)>", r"{\1}", rule)


def _path_schema(name: str, kind: type) -> dict:
    if kind is int:
        return {"type": "integer", "minimum": 0, "maximum": 2**53}
    if name == "digest":  # a sha256, lowercase
        return {"type": "string", "pattern": "^[0-9a-f]{64}$"}
    if name == "name":
        return {"type": "string", "pattern": "^[A-Za-z0-9._-]+$", "minLength": 1, "maxLength": 200}
    return {"type": "string", "pattern": "^[A-Za-z0-9._:-]+$", "minLength": 1, "maxLength": 128}


def _not_null(schema: dict) -> dict:
    """A query parameter's schema without the ``null`` a ``str | None`` field carries (absent is None)."""
    choices = [s for s in schema.get("anyOf", []) if s.get("type") != "null"]
    if len(choices) == 1:
        rest = {k: v for k, v in schema.items() if k != "anyOf" and not (k == "default" and v is None)}
        return {**rest, **choices[0]}
    return schema


def _query_params(model: type[BaseModel], schemas: dict) -> list[dict]:
    schema = model.model_json_schema(ref_template=_REF)
    schemas.update(schema.pop("$defs", {}))
    required = set(schema.get("required", []))
    params = []
    for name, prop in schema["properties"].items():
        prop = _not_null(prop)
        param = {"name": name, "in": "query", "required": name in required, "schema": prop}
        description = model.model_fields[name].description
        if description:
            param["description"] = description
        params.append(param)
    return params


def _content(answer, refs: dict) -> dict:
    if answer == OCTET:
        return {OCTET: {"schema": _BINARY}}
    if isinstance(answer, str):  # text: HTML, Prometheus's format
        return {answer: {"schema": {"type": "string"}}}
    return {"application/json": {"schema": refs[(answer, "serialization")]}}


def _describe(op: Operation, refs: dict, schemas: dict) -> dict:
    params = [{"name": name, "in": "path", "required": True, "schema": _path_schema(name, kind)}
              for name, kind in op.path.items()]
    if op.query is not None:
        params += _query_params(op.query, schemas)
    if op.body == OCTET:
        params.append({"name": defaults.SHA256_HEADER, "in": "header", "required": False, "schema": _SHA256,
                       "description": "The bytes' sha256 (hex): the server refuses them (422) if they differ."})
    out = {"operationId": op.name, "summary": op.summary, "tags": [op.tag], "security": _SECURITY[op.auth]}
    if op.description:
        out["description"] = _text(op.description)
    if params:
        out["parameters"] = params
    if op.body == OCTET:
        out["requestBody"] = {"required": True, "content": {OCTET: {"schema": _BINARY}}}
    elif op.body is not None:
        required = any(f.is_required() for f in op.body.model_fields.values())
        out["requestBody"] = {"required": required,
                              "content": {"application/json": {"schema": refs[(op.body, "validation")]}}}
    responses = {}
    for status, answer in op.answers.items():
        response = {"description": _answer_description(answer), "content": _content(answer, refs)}
        if answer == OCTET:
            response["headers"] = {defaults.SHA256_HEADER: {"schema": _SHA256, "description": "The bytes' sha256."}}
        responses[str(status)] = response
    for status in op.errors:
        responses[str(status)] = {"description": _text(_ERRORS.get(status, "An error.")),
                                  "content": {"application/json": {"schema": refs[(ErrorAnswer, "serialization")]}}}
    out["responses"] = responses
    return out


def _answer_description(answer) -> str:
    if answer == OCTET:
        return "The artifact's bytes, streamed."
    if answer == HTML:
        return "A page."
    doc = (answer.__doc__ or "").strip().split("\n\n")[0]
    return _text(" ".join(doc.split())) or answer.__name__


def document(app) -> dict:
    """The OpenAPI document of ``app`` (made once per app)."""
    cached = app.extensions.get(_CACHE)
    if cached is not None:
        return cached
    ops = operations(app)
    models = {(ErrorAnswer, "serialization")}
    for op in ops:
        if isinstance(op.body, type):
            models.add((op.body, "validation"))
        models |= {(answer, "serialization") for answer in op.answers.values() if isinstance(answer, type)}
    refs, top = models_json_schema(sorted(models, key=lambda m: (m[0].__name__, m[1])), ref_template=_REF)
    schemas = {name: {**schema, "description": _text(schema["description"])} if "description" in schema else schema
               for name, schema in top.get("$defs", {}).items()}
    paths: dict[str, dict] = {}
    for op in ops:
        paths.setdefault(_path(op.rule), {})[op.method.lower()] = _describe(op, refs, schemas)
    doc = {
        "openapi": "3.1.0",
        "info": {"title": "zwdx", "version": zwdx.__version__,
                 "description": "Pool the GPUs people lend and train PyTorch models on them. Every call that "
                                "touches a room needs a submitter token of the room in "
                                f"`{defaults.TOKEN_HEADER}` (or `Authorization: Bearer`); a donor token "
                                "connects GPU clients on Socket.IO and opens only `/link` here (the "
                                "clients' link measurement). The rank "
                                "processes of a job call with their rank's key in "
                                f"`{defaults.RANK_KEY_HEADER}` instead. Errors are `{{\"error\": {{\"code\", \"message\", "
                                "...}}}` with the matching status. Socket.IO events: docs/events.md."},
        "paths": dict(sorted(paths.items())),
        "components": {
            "schemas": dict(sorted(schemas.items())),
            "securitySchemes": {
                "roomToken": {"type": "apiKey", "in": "header", "name": defaults.TOKEN_HEADER,
                              "description": "A submitter token of the room (zs_..., or a legacy zr_...), "
                                             "shown once when it was made; on `/link`, a donor token (zd_...)."},
                "rankKey": {"type": "apiKey", "in": "header", "name": defaults.RANK_KEY_HEADER,
                            "description": "The key of one rank of the current attempt of a running job "
                                           "(rk_...), given only to the GPU client that runs it."}}},
    }
    app.extensions[_CACHE] = doc
    return doc


@operation(bp, "GET", "/openapi.json", "This API as an OpenAPI 3.1 document", auth=Auth.NONE,
           answer=OpenApiDocument, tag="server")
def openapi_json():
    return OpenApiDocument.model_validate(document(current_app))


@operation(bp, "GET", "/docs", "This API as a page to read", auth=Auth.NONE, answer=HTML, tag="server")
def docs():
    """Self-contained: it loads nothing from elsewhere."""
    return Response(apidocs.PAGE, mimetype=HTML, headers={"Content-Security-Policy": apidocs.CSP})


__all__ = ["bp", "document", "operations", "P"]
