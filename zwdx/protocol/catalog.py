"""Every Socket.IO event, with its namespace, who sends it and the types of its payload and its
answer: the table of ``docs/events.md`` (the REST API's own description is its OpenAPI
document, ``GET /api/v1/openapi.json``). The names are ``events.py``'s, the types those of
``gpu.py``, ``job.py`` and ``rest.py``; ``test/test_events_catalog.py`` fails when an event of
``events.py`` is missing here or the checked-in page differs.

    python -m zwdx.protocol.catalog            # write docs/events.md of this checkout
    python -m zwdx.protocol.catalog --check    # exit 1 if it differs from what this module makes
    python -m zwdx.protocol.catalog --stdout   # print it
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from . import events as ev
from .gpu import (Ack, Heartbeat, HeartbeatAnswer, JobAssign, JobCancel, PortOffer, RanksExited, Refresh, Register,
                  RegisterAnswer, ReservePort, Unreachable)
from .job import JobView
from .rest import ClientsUpdate, JobEvents

PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "events.md")
COMMAND = "python -m zwdx.protocol.catalog"

CLIENT_TO_SERVER = "gpu client → server"
SERVER_TO_CLIENT = "server → gpu client"
SERVER_TO_RANK0 = "server → rank 0's gpu client (a call)"
SERVER_TO_BROWSER = "server → dashboard"


@dataclass(frozen=True)
class Event:
    name: str
    namespace: str
    direction: str
    payload: type[BaseModel]
    answer: type[BaseModel] | None
    #: When it is sent, and what it does.
    note: str


EVENTS = (
    Event(ev.EV_REGISTER, ev.GPU_NAMESPACE, CLIENT_TO_SERVER, Register, RegisterAnswer,
          "First thing after connecting, and again after every reconnect: its slots, versions, importable "
          "modules, the jobs whose ranks it still runs, where its peers reach it (`reach_port`) and its link to "
          "the server (`link`, measured over `/api/v1/link`). The first register of a client id is answered "
          "with its client secret; every later one must carry it."),
    Event(ev.EV_HEARTBEAT, ev.GPU_NAMESPACE, CLIENT_TO_SERVER, Heartbeat, HeartbeatAnswer,
          "Every `heartbeat_interval` seconds (from the register's answer, then from the last heartbeat "
          "answer that carried one: a server process with many GPU clients stretches it): fresh figures of "
          "its slots. Silent for `CLIENT_TIMEOUT`, stretched alike: lost."),
    Event(ev.EV_RANKS_EXITED, ev.GPU_NAMESPACE, CLIENT_TO_SERVER, RanksExited, Ack,
          "Its rank processes of one attempt of a job exited (rank → exit code): their slots are free. Only "
          "for ranks placed on it."),
    Event(ev.EV_UNREACHABLE, ev.GPU_NAMESPACE, CLIENT_TO_SERVER, Unreachable, Ack,
          "Before the ranks of a DDP/FSDP job start, it could not connect to these other GPU clients of the job "
          "(`JobAssign.peers`): the job fails at once naming the pairs, and the scheduler keeps them apart. "
          "Only for a job it and those peers are placed on."),
    Event(ev.EV_RESERVE_PORT, ev.GPU_NAMESPACE, SERVER_TO_RANK0, ReservePort, PortOffer,
          "The scheduler placed a job: where will the ranks meet? The scheduler does not wait for the answer."),
    Event(ev.EV_JOB_ASSIGN, ev.GPU_NAMESPACE, SERVER_TO_CLIENT, JobAssign, None,
          "Start these ranks of this attempt of the job, each with its rank key; the agent makes one `RankSpec` "
          "per rank."),
    Event(ev.EV_JOB_CANCEL, ev.GPU_NAMESPACE, SERVER_TO_CLIENT, JobCancel, None,
          "Stop the job's ranks (of this attempt, when given): cancelled, failed, or gone on without them."),
    Event(ev.EV_REFRESH, ev.GPU_NAMESPACE, SERVER_TO_CLIENT, Refresh, None,
          "A waiting job needs modules this client did not list at its register: it looks again at what its "
          "ranks can import (at most every `--modules-refresh` seconds) and registers again if that changed. "
          "Asked again for the same modules at most every `MODULES_REFRESH` seconds."),
    Event(ev.EV_JOB_UPDATE, ev.UI_NAMESPACE, SERVER_TO_BROWSER, JobView, None,
          "A job of the room changed (the same view as `GET /api/v1/jobs/<id>`)."),
    Event(ev.EV_JOB_EVENTS, ev.UI_NAMESPACE, SERVER_TO_BROWSER, JobEvents, None,
          "New metric and log events of a job, as ranks report them."),
    Event(ev.EV_CLIENTS_UPDATE, ev.UI_NAMESPACE, SERVER_TO_BROWSER, ClientsUpdate, None,
          "The room's GPU clients and totals: on connecting, and when they change (coalesced)."),
)


def _module(model: type[BaseModel]) -> str:
    """Where the type is declared: ``zwdx/protocol/gpu.py``."""
    return "zwdx/" + model.__module__.removeprefix("zwdx.").replace(".", "/") + ".py"


def _type(schema: dict[str, Any]) -> str:
    """A JSON Schema as a short type: ``int``, ``str | null``, ``Slot[]``, ``{str: int}``."""
    if "$ref" in schema:
        return str(schema["$ref"]).rsplit("/", 1)[-1]
    if "anyOf" in schema:
        return " | ".join(_type(s) for s in schema["anyOf"])
    if "enum" in schema:
        return " | ".join(f'"{v}"' for v in schema["enum"])
    if "const" in schema:
        return f'"{schema["const"]}"'
    kind = schema.get("type")
    if kind == "array":
        return _type(schema.get("items", {})) + "[]"
    if kind == "object":
        values = schema.get("additionalProperties") or next(iter(schema.get("patternProperties", {}).values()), None)
        return "{str: " + _type(values) + "}" if isinstance(values, dict) else "object"
    names = {"integer": "int", "string": "str", "number": "float", "boolean": "bool", "null": "null"}
    return names.get(str(kind), "any")


def _section(name: str, schema: dict[str, Any], where: str = "") -> list[str]:
    """One type: its description, then its fields (``name?`` may be left out) or its values."""
    out = [f"### `{name}`" + (f" ({where})" if where else ""), ""]
    doc = " ".join((schema.get("description") or "").split("\n\n")[0].split()).replace("``", "`")
    if doc:
        out += [doc, ""]
    if "properties" in schema:
        required = set(schema.get("required", []))
        out.append(", ".join(f"`{field}{'' if field in required else '?'}: {_type(prop)}`"
                             for field, prop in schema["properties"].items()))
    else:
        out.append(f"`{_type(schema)}`")
    return out + [""]


def render() -> str:
    """The text of ``docs/events.md``."""
    out = [f"<!-- Generated by `{COMMAND}` from zwdx/protocol/events.py and the payload types: do not edit. -->",
           "# Socket.IO events", "",
           'GPU clients connect to the `/gpu` namespace with `auth={"token": DONOR_TOKEN, "protocol": "MAJOR.MINOR", '
           '"zwdx": VERSION}` (the room\'s donor token; a client that names no protocol speaks 1.0, refused '
           'by a server of another major) and dashboards to `/ui` with `auth={"token": SUBMITTER_TOKEN}`; any other connection is '
           "refused, saying which token it takes. Every payload is "
           "one JSON object of a declared type (`zwdx/protocol/`). The server checks what GPU clients send "
           "(`zwdx/server/events.py`) and answers a wrong payload `Ack(ok=false, error=...)` naming the field; "
           "the REST API is described by `GET /api/v1/openapi.json` (rendered at `/api/v1/docs`).", "",
           "| event | namespace | direction | payload | answer | when |",
           "| --- | --- | --- | --- | --- | --- |"]
    for e in EVENTS:
        answer = f"`{e.answer.__name__}`" if e.answer else "none"
        out.append(f"| `{e.name}` | `{e.namespace}` | {e.direction} | `{e.payload.__name__}` | {answer} | {e.note} |")
    out += ["", "## The types", "",
            "A field marked `?` may be left out. What a peer sends is checked strictly (no `\"1\"` for `1`); "
            "fields a GPU client of a newer minor adds are ignored (logged once), unknown fields elsewhere refused; "
            "what the server sends may gain fields, which older peers ignore "
            "([upgrades](operations.md#upgrades)).", ""]
    top: dict[str, tuple[dict[str, Any], str]] = {}
    nested: dict[str, dict[str, Any]] = {}
    for e in EVENTS:
        sent_by_server = e.direction != CLIENT_TO_SERVER
        modes: tuple[Literal["serialization", "validation"], Literal["serialization", "validation"]] = \
            ("serialization", "validation") if sent_by_server else ("validation", "serialization")
        for model, mode in ((e.payload, modes[0]),
                            (e.answer, modes[1])):
            if model is None or model.__name__ in top:
                continue
            schema = model.model_json_schema(mode=mode)
            nested.update(schema.pop("$defs", {}))
            top[model.__name__] = (schema, _module(model))
    for name, (schema, where) in top.items():
        out += _section(name, schema, where)
    out += ["## The types they hold", ""]
    for name in sorted(set(nested) - set(top)):
        out += _section(name, nested[name])
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from what this makes")
    parser.add_argument("--stdout", action="store_true", help="print the file instead of writing it")
    parser.add_argument("--path", default=PATH, help=f"the file to write or check (default {PATH})")
    args = parser.parse_args(argv)
    text = render()
    if args.stdout:
        sys.stdout.write(text)
        return 0
    if args.check:
        try:
            with open(args.path, encoding="utf-8") as fh:
                same = fh.read() == text
        except FileNotFoundError:
            same = False
        if not same:
            print(f"{args.path} is not what zwdx/protocol/catalog.py makes: run `{COMMAND}`", file=sys.stderr)
        return 0 if same else 1
    with open(args.path, "w", encoding="utf-8") as fh:
        fh.write(text)
    print(f"wrote {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
