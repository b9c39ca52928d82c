"""Reading a job's events and metric series a page at a time, so that no read holds the server.

A job may hold millions of events (``limits.py`` bounds how many). One answer never carries them
all: ``GET /jobs/<id>/events`` ends a page after ``limit`` events or about ``PAGE_BYTES``, and
``GET /jobs/<id>/metrics`` after about ``PAGE_POINTS`` points; each answers ``next``, the
``after`` of the next page (null at the end). Within a page, the store is read ``CHUNK`` events
at a time, and other requests (heartbeats) run between two reads.

A metric series shows at most ``MAX_SERIES_POINTS`` points, however long the job ran: once the
job holds more events than that, its events are cut into spans of ``stride`` events (about
``MAX_SERIES_POINTS / 2`` spans) and a series keeps the first and the last of its points in
each span: its first and last points always, and every jump's edges. The stride is fixed by the
first page and passed back with ``next``, so that the pages of one read agree.
"""
from __future__ import annotations

import time
from typing import Iterator

from ..protocol import SYSTEM_METRICS, EventKind
from ..protocol.report import NON_FINITE

#: Events read from the store at once; the server's other requests run between two reads.
CHUNK = 500
#: An events page ends after about this many bytes of events (and at ``limit`` events).
PAGE_BYTES = 1024**2
#: A metrics page ends after this many points, at the end of a span.
PAGE_POINTS = 2_000
#: ... and after this many in the middle of one (spans of many events with many series each).
PAGE_POINTS_MAX = 4 * PAGE_POINTS


def _size(event: dict) -> int:
    """About an event's JSON length, without encoding it."""
    data = event.get("data") or {}
    return 100 + (len(data.get("text") or "") if event.get("kind") == EventKind.LOG.value else 40 * len(data))


def events_page(store, job_id: str, after: int, limit: int, kind: str | None = None) -> tuple[list[dict], int | None]:
    """The job's events after ``after`` (of ``kind``): at most ``limit``, about ``PAGE_BYTES``
    at most; and the ``after`` of the next page, or None when this one reached the last event."""
    out, size = [], 0
    while len(out) < limit:
        want = min(CHUNK, limit - len(out))
        chunk = store.get_events(job_id, after=after, kind=kind, limit=want)
        for ev in chunk:
            out.append(ev)
            after, size = ev["seq"], size + _size(ev)
            if size >= PAGE_BYTES:
                return out, after
        if len(chunk) < want:
            return out, None
        time.sleep(0)  # under gevent: other requests run between two reads
    return out, after


def every_event(store, job_id: str, kind: str | None = None) -> Iterator[dict]:
    """Each of the job's events (of ``kind``), read ``CHUNK`` at a time with other requests
    between two reads: for a server-side sum over a whole job, never for an answer."""
    after = 0
    while True:
        chunk = store.get_events(job_id, after=after, kind=kind, limit=CHUNK)
        yield from chunk
        if len(chunk) < CHUNK:
            return
        after = chunk[-1]["seq"]
        time.sleep(0)


def _number(value) -> bool:
    """A metric's value: a number, one of the strings of a non-finite one, or null."""
    return value is None or isinstance(value, (int, float)) and not isinstance(value, bool) or \
        isinstance(value, str) and value in NON_FINITE


def stride_for(store, job_id: str, max_points: int) -> int:
    """Events per span: 1 (every point) while the job holds at most ``max_points`` events."""
    last = store.last_event_seq(job_id)
    if not max_points or last <= max_points:
        return 1
    spans = max(1, max_points // 2)
    return -(-last // spans)


def metrics_page(store, job_id: str, after: int, stride: int) -> tuple[dict[str, list[dict]], int | None]:
    """The job's metric series from its events after ``after``, thinned by spans of ``stride``
    events (module docstring); and the ``after`` of the next page, or None at the end."""
    series: dict[str, list[dict]] = {name: [] for name in SYSTEM_METRICS}
    held: dict[str, list[dict]] = {}  # name -> [first, last] point of the span being read
    points, span, cursor = 0, None, after

    def flush() -> int:
        added = 0
        for name, (first, last) in held.items():
            kept = series.setdefault(name, [])
            kept.append(first)
            if last is not first:
                kept.append(last)
            added += 1 + (last is not first)
        held.clear()
        return added

    while True:
        chunk = store.get_events(job_id, after=cursor, kind=EventKind.METRIC.value, limit=CHUNK)
        for ev in chunk:
            this = (ev["seq"] - 1) // stride
            if this != span:
                if span is not None:
                    points += flush()
                    if points >= PAGE_POINTS:
                        return series, (span + 1) * stride  # the next page starts with this event's span
                span = this
            data = ev.get("data")
            for name, value in (data if isinstance(data, dict) else {}).items():
                if _number(value):  # what the API took is; records of an older zwdx may hold others
                    point = {"step": ev.get("step"), "value": value, "rank": ev.get("rank"), "ts": ev.get("ts")}
                    if (pair := held.get(name)) is None:
                        held[name] = [point, point]
                    else:
                        pair[1] = point
            cursor = ev["seq"]
            if points + 2 * len(held) >= PAGE_POINTS_MAX:
                flush()
                return series, cursor
        if len(chunk) < CHUNK:
            flush()
            return series, None
        time.sleep(0)
