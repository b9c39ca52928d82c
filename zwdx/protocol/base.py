"""How messages are declared and checked: pydantic v2 models, validated once at the edge.

Why pydantic: its models give JSON Schema (the OpenAPI spec is generated from them), errors
that carry the path of the field that was wrong, strict checking of JSON types, and it is the
most widely known validation library in Python; the control plane's messages are small, so
its speed is plenty (about a microsecond a field).

- ``Message``: what a peer sends us. Strict (no "1" for 1, no true for 1), unknown fields
  refused (a typo is an error, not a silent default), no NaN or Infinity.
- ``Tolerant``: a ``Message`` a newer peer of the same protocol major may send with fields this
  version does not know: they are ignored (and logged once per message type and field).
- ``Answer``: what we send back. Unknown fields ignored, so an older peer reads a newer answer.
- ``parse(Model, data)``: the one way in; a ``ValidationError`` becomes ``BadRequest`` whose
  message and ``field`` name the path of the first wrong field (``slots.0.index``).

Versions (``PROTOCOL``, MAJOR.MINOR; docs/operations.md, Upgrades). Peers exchange it as they
meet: a GPU client in its connect's ``auth``, the server in its register answer and on every
HTTP answer (``Zwdx-Protocol``), the SDK in every request's ``Zwdx-Protocol`` header. Peers of
different majors are refused at once, with a message naming both versions and which side to
upgrade (``incompatible``). Within a major, a newer minor only adds optional fields, and only to
messages an older peer reads leniently: every ``Answer``, and the ``Tolerant`` messages (what a
GPU client and its ranks send the server). A submitter's and an operator's requests (a job's
spec, tokens, a room's settings) stay closed ``Message``s: an option the server does not know
must not be dropped in silence, as the job would train otherwise than asked, or a token or a
quota would be made without the limit its maker set; they are refused, naming the field.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, TypeVar

import orjson
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, Strict, StringConstraints, ValidationError,
                      model_validator)

from ..errors import BadRequest

log = logging.getLogger(__name__)

#: The protocol this version of zwdx speaks, MAJOR.MINOR: the major changes when a message
#: changes in a way an older peer would misread (a field removed, renamed or made required); the
#: minor when optional fields are added. A peer that does not say speaks 1.0 (every release
#: before versions were exchanged: zwdx 0.1.0). 2.0: the job spec became one tree (JobAssign and
#: RankSpec carry it; a 1.x GPU client would misread them).
PROTOCOL = "2.0"
#: The HTTP header each side of the REST API names its protocol in, and the one an SDK names its
#: zwdx version in (shown in a refusal).
PROTOCOL_HEADER = "Zwdx-Protocol"
VERSION_HEADER = "Zwdx-Version"
_PROTOCOL = re.compile(r"^([0-9]{1,4})\.([0-9]{1,4})$")


def protocol_major(version: object) -> int | None:
    """``'1.3'`` -> 1; None for anything that is not MAJOR.MINOR."""
    found = _PROTOCOL.match(version) if isinstance(version, str) else None
    return int(found.group(1)) if found else None


def incompatible(theirs: object, them: str, us: str, their_zwdx: object, ours: str) -> str | None:
    """Why a peer speaking protocol ``theirs`` (None: one that did not say, 1.0) cannot talk to
    this one, naming both versions and which side to upgrade; None when it can. ``them`` and
    ``us`` say who is who, as nouns ("GPU client", "server"); ``their_zwdx`` and ``ours``: the
    zwdx versions of the peer (None: not said) and of this process."""
    theirs = "1.0" if theirs is None else theirs
    major, mine = protocol_major(theirs), protocol_major(PROTOCOL)
    if major == mine:
        return None
    said = escape_controls(str(theirs)[:20])
    them_at = f"this {them} speaks zwdx protocol {said}" + (f" (zwdx {escape_controls(str(their_zwdx)[:32])})"
                                                       if isinstance(their_zwdx, str) else "")
    if major is None or mine is None:
        return f"{them_at}, which is no protocol version (MAJOR.MINOR); this {us} speaks {PROTOCOL} (zwdx {ours})"
    older = them if major < mine else us
    return (f"{them_at}; this {us} speaks {PROTOCOL} (zwdx {ours}): another major version, which the "
            f"{older} does not understand: upgrade the {older} (pip install -U zwdx; docs/operations.md, "
            f"Upgrades)")

#: Counts, steps, epochs, ranks: whole numbers a JSON reader keeps exact (2**53) and a store's
#: 64-bit integer holds.
Count = Annotated[int, Field(ge=0, le=2**53)]
#: Sizes in bytes.
Bytes = Annotated[int, Field(ge=0, le=2**62)]
#: Seconds since the epoch, or durations in seconds.
Seconds = Annotated[float, Field(ge=0, le=1e11)]
#: Ids the server or a GPU client made: letters, digits and ``._:-``, as used in URLs and keys.
Id = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")]
#: A rank, as a JSON object key (JSON keys are strings).
RankKey = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,6}$")]
#: Free text shown to people: a name, a host name, a reason.
Text = Annotated[str, StringConstraints(max_length=1000)]
#: Characters a terminal or a bidi-aware reader acts on rather than shows: C0 controls, DEL, C1
#: controls (an OSC 52 clipboard write, a screen clear), and the bidi marks, embeddings,
#: overrides and isolates that reorder what is shown (CVE-2021-42574's "Trojan Source").
CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def no_controls(text: str) -> str:
    """``text``, or ``ValueError`` naming the first control character in it and where."""
    found = CONTROLS.search(text)
    if found:
        raise ValueError(f"must not contain control characters, got U+{ord(found.group()):04X} at "
                         f"position {found.start()}")
    return text


def escape_controls(text: str, keep: str = "") -> str:
    """``text`` with every control character but those in ``keep`` written out (``\\x1b``,
    ``\\u202e``): what a terminal shows of a name some peer chose, never acts on."""
    return CONTROLS.sub(lambda m: m.group() if m.group() in keep else m.group().encode("unicode_escape").decode(),
                        text)


#: A name a peer chose that people read in tables (a host name, a GPU's name): no control characters.
Name = Annotated[str, StringConstraints(max_length=1000), AfterValidator(no_controls)]
#: A traceback or a log line.
LongText = Annotated[str, StringConstraints(max_length=200_000)]


#: Put on an enum field of a ``Message``: its value as a string is accepted (strict mode alone
#: would want the Python enum member, which JSON cannot carry).
ByValue = Strict(False)


class Message(BaseModel):
    """A message a peer sends: checked strictly."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=False)


#: (message type, field) pairs a newer peer sent and this version ignored, each logged once;
#: bounded, so that a peer sending many made-up names grows nothing.
_IGNORED: set[tuple[str, str]] = set()
_IGNORED_MAX = 1000


class Tolerant(Message):
    """A message a newer peer may send with optional fields this version does not know: they
    are ignored, each (type, field) logged once. Known fields are checked as strictly as ever."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, frozen=False)

    @model_validator(mode="before")
    @classmethod
    def _note_unknown(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in data.keys() - cls.model_fields.keys():
                key = (cls.__name__, escape_controls(str(name)[:64]))
                if key not in _IGNORED and len(_IGNORED) < _IGNORED_MAX:
                    _IGNORED.add(key)
                    log.warning("protocol: a %s carried field '%s', which this version (protocol %s) does not "
                                "know: ignored (sent by a newer peer?)", *key, PROTOCOL)
        return data


class Answer(BaseModel):
    """A message we send: a peer of an older version ignores what it does not know."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, ser_json_inf_nan="strings")


M = TypeVar("M", bound=BaseModel)


#: pydantic's error types for a value of the wrong JSON type -> the type wanted, by its Python name.
_EXPECTED = {"int_type": "int", "int_parsing": "int", "int_from_float": "int", "float_type": "float",
             "float_parsing": "float", "string_type": "str", "bool_type": "bool", "bool_parsing": "bool",
             "dict_type": "dict", "model_type": "dict", "model_attributes_type": "dict", "list_type": "list"}
#: pydantic's error types for a value out of bounds -> how to say it (with the error's ``ctx``).
_BOUNDS = {"greater_than_equal": "must be at least {ge}", "less_than_equal": "must be at most {le}",
           "greater_than": "must be more than {gt}", "less_than": "must be less than {lt}",
           "string_too_short": "must be at least {min_length} characters long",
           "string_too_long": "must be at most {max_length} characters long",
           "too_short": "must have at least {min_length} item(s)", "too_long": "must have at most {max_length} item(s)",
           "string_pattern_mismatch": "must match {pattern}",
           "extra_forbidden": "is not a field of this message"}


def say(error: Mapping[str, Any]) -> str:
    """One of pydantic's errors in words, after ``field 'path'``: ``must be int, got str``."""
    kind, ctx, msg = error["type"], error.get("ctx") or {}, str(error["msg"])
    if kind in _EXPECTED:
        return f"must be {_EXPECTED[kind]}, got {type(error['input']).__name__}"
    if kind in _BOUNDS:
        try:
            return _BOUNDS[kind].format(**ctx)
        except KeyError:
            pass
    if kind == "value_error" and msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
        return msg if msg.startswith("must ") else f": {msg}"
    if msg.startswith("Input should be "):
        return "must be " + msg[len("Input should be "):]
    return f": {msg[:1].lower() + msg[1:]}"


def field_path(loc: Sequence[object]) -> str:
    """``('slots', 0, 'index')`` -> ``'slots.0.index'``."""
    return ".".join(str(part) for part in loc if part not in ("[key]",)) or "body"


def parse(model: type[M], data: object, what: str = "") -> M:
    """``data`` (already decoded JSON) as ``model``, or ``BadRequest`` naming the first wrong field."""
    where = f"{what}: " if what else ""
    if not isinstance(data, dict):
        raise BadRequest(f"{where}the body must be a JSON object, got {type(data).__name__}", field="body")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        path = field_path(first["loc"])
        words = say(first)
        raise BadRequest(f"{where}field '{path}'{'' if words.startswith(':') else ' '}{words}", field=path,
                         problems=[{"field": field_path(e["loc"]), "message": e["msg"]}
                                   for e in exc.errors(include_url=False)[:20]]) from None


#: A run of digits as long as an integer past 64 bits (orjson would read one as a float).
LONG_NUMBER = re.compile(r"[0-9]{19}")
LONG_NUMBER_BYTES = re.compile(rb"[0-9]{19}")


def loads(text: str | bytes) -> Any:
    """JSON text as zwdx's processes and stores write it, read with orjson (several times
    ``json``'s speed: every Socket.IO packet, every stored document); ``json`` reads what orjson
    refuses (NaN, lone surrogates), and text that starts with a space: ``exact`` marks so a
    document that may hold an integer past 64 bits, which orjson would read as a float."""
    if text[:1] in (" ", b" "):
        return json.loads(text)
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)


def exact(text: str) -> str:
    """JSON text as written, with a space before it (still JSON) when it has 19 digits in a row,
    where an integer past 64 bits may be: ``loads`` then reads it with ``json``, which keeps
    every digit. For documents that hold a user's numbers (a job's results, its events): the
    check costs a few microseconds once, at the write, not at every read."""
    return " " + text if LONG_NUMBER.search(text) else text
