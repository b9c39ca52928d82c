"""Bounds on the JSON a peer sends, checked before anything parses it, in C (numpy and bytes'
own methods), never byte by byte in Python on the hub: a REST body (``http._json_body``) and a
Socket.IO packet (``wire_loads``) go through the same checks.

- Nesting: at most ``MAX_JSON_DEPTH`` levels. ``Depth`` follows a body as it is read, chunk by
  chunk, so that 8 MiB of ``[`` is refused after its first chunk, with the rest unread.
- Object keys: none may hold a NUL character (``\\u0000``), which no MongoDB key can carry
  (a store's 500 otherwise): ``nul_key`` finds one in the text, in C.

    depth = Depth(); depth.feed(chunk) ... depth.end()   -> BadRequest past the limit
    check_text(text, what)                               -> a whole text (a Socket.IO packet)
    nul_key(raw) -> the first key with a NUL in it, as written, or None
"""
from __future__ import annotations

import json
import re

import numpy as np
import orjson

from ..errors import BadRequest

#: Deepest nesting of a JSON body or packet: a deeper one is refused before anything parses it
#: (MongoDB keeps documents 100 levels deep; Python's parser stops near 1,000).
MAX_JSON_DEPTH = 32

#: What matters to nesting once escapes are gone: quotes and brackets ({} read as []).
_DROP = bytes(b for b in range(256) if b not in b'"[]{}')
_AS_SQUARE = bytes.maketrans(b"{}", b"[]")
_QUOTE, _OPEN, _CLOSE = ord('"'), ord("["), ord("]")
#: A key (a string followed by a colon) with an escaped NUL in it, in text whose escaped
#: backslashes and quotes are gone (``_unescaped``): the string's body cannot hold a quote then.
_NUL_KEY = re.compile(rb'"([^"]*\\u0000[^"]*)"[ \t\r\n]*:')


def _unescaped(raw: bytes) -> bytes:
    """``raw`` without its escaped backslashes and quotes: every quote left opens or closes a
    string. A run of backslashes pairs from its start (nothing escapes its first), as JSON reads it."""
    return raw.replace(b"\\\\", b"").replace(b'\\"', b"")


class Depth:
    """How deep a JSON text nests, fed in chunks (``feed``), outside strings; ``BadRequest``
    once past ``limit``. Each chunk costs a few passes in C; a run of backslashes at a chunk's
    end waits for the next (its pairing decides what the byte after it means)."""

    def __init__(self, limit: int = MAX_JSON_DEPTH, what: str = "the body", field: str = "body"):
        self.limit, self.what, self.field = limit, what, field
        self.depth = 0
        self.in_string = False
        self._held = b""

    def feed(self, chunk: bytes) -> None:
        data = self._held + chunk
        cut = len(data.rstrip(b"\\"))
        data, self._held = data[:cut], data[cut:]
        self._walk(data)

    def end(self) -> None:
        self._walk(self._held)
        self._held = b""

    def _walk(self, data: bytes) -> None:
        if not self.in_string and b'"' not in data:
            opens = data.count(b"[") + data.count(b"{")
            if self.depth + opens <= self.limit:  # cannot pass the limit: counted, not walked
                self.depth = max(0, self.depth + opens - data.count(b"]") - data.count(b"}"))
                return
        marks = np.frombuffer(_unescaped(data).translate(_AS_SQUARE, _DROP), np.uint8)
        if not len(marks):
            return
        steps = (marks == _OPEN).view(np.int8) - (marks == _CLOSE).view(np.int8)
        quotes = marks == _QUOTE
        if self.in_string or quotes.any():  # a bracket after an odd number of quotes is text
            inside = (np.cumsum(quotes, dtype=np.int32) + self.in_string) & 1
            steps[inside.astype(bool)] = 0
            self.in_string = bool(inside[-1])
        level = np.cumsum(steps, dtype=np.int32)
        level += self.depth
        if int(level.max()) > self.limit:
            raise BadRequest(f"{self.what} nests deeper than {self.limit} levels", field=self.field)
        self.depth = max(0, int(level[-1]))


def nul_key(raw: bytes) -> str | None:
    """The first object key of the JSON text ``raw`` that holds a NUL character (``\\u0000``), as
    written (escaped), or None. Only for text that parsed as JSON: outside strings it then holds
    no backslash, so every match starts at a key's opening quote."""
    if b"\\u0000" not in raw:
        return None
    found = _NUL_KEY.search(_unescaped(raw))
    return found.group(1).decode("utf-8", "replace")[:100] if found else None


def refuse_nul_key(raw: bytes, what: str = "the body", data=None) -> None:
    """``BadRequest`` if an object key of ``raw`` holds a NUL character, naming its path in
    ``data`` (``raw`` decoded) where a short walk finds it, else the key as written."""
    key = nul_key(raw)
    if key is None:
        return
    path = _nul_key_path(data) if data is not None else None
    raise BadRequest(f"{what}: field '{path or key}' is an object key with a NUL character (\\u0000) in it, which "
                     f"no store keeps", field=path or key)


def _nul_key_path(data, budget: int = 10_000) -> str | None:
    """The path (``versions.a\\u0000b``) of the first key with a NUL in it, looking at no more
    than ``budget`` containers (the walk is Python's: it only runs for a body being refused)."""
    todo = [((), data)]
    while todo and budget > 0:
        budget -= 1
        path, value = todo.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            if isinstance(key, str) and "\0" in key:
                return ".".join(str(p) for p in (*path, key.replace("\0", "\\u0000")))[:200]
            if isinstance(item, (dict, list)):
                todo.append(((*path, key), item))
    return None


def refuse_nul_key_in(data, what: str) -> None:
    """``refuse_nul_key`` for decoded JSON (a Socket.IO payload), written again in C to be searched."""
    try:
        raw = orjson.dumps(data)
    except TypeError:  # an integer past 64 bits
        raw = json.dumps(data).encode()
    refuse_nul_key(raw, what, data)


def check_text(text: str | bytes, what: str = "the packet") -> None:
    """A whole JSON text (a Socket.IO packet's) within ``MAX_JSON_DEPTH``; ``BadRequest`` if not."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:  # the usual packet: it cannot nest deeper
        return
    depth = Depth(what=what, field="packet")
    depth.feed(raw)
    depth.end()
