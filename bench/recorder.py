"""What one load generator (simulate.py) keeps of a control_plane.py level: the latencies of the
calls that started inside the measurement window, their errors and counts, and with a kill
planned (``--kill-one``) its clients' drops; calls and errors that overlapped the kill's span
are filed under their name with ``kill_one.DURING`` appended, and the errors seen after the window
(while the SDK users follow their jobs to the end) with ``kill_one.AFTER`` (reported, not gated).
"""
from __future__ import annotations

import time
from collections import defaultdict

from kill_one import AFTER, DURING, during


class Recorder:
    def __init__(self):
        self.t0, self.t1 = None, None
        self.lat: dict[str, list[float]] = defaultdict(list)
        self.errors: dict[str, int] = defaultdict(int)
        self.counts: dict[str, int] = defaultdict(int)
        self.error_samples: list[str] = []
        self.kill_time: float | None = None
        self.drops: list[list] = []  # [client, dropped at, registered again at or None]

    def inside(self, t: float) -> bool:
        return self.t0 is not None and self.t0 <= t <= self.t1

    def note(self, kind: str, started: float, ended: float | None = None) -> None:
        ended = ended or time.time()
        if self.inside(started):
            self.lat[kind + (DURING if during(self.kill_time, started, ended) else "")].append(1000.0 * (ended - started))

    def error(self, kind: str, exc, started: float | None = None) -> None:
        """An error of a call (made at ``started``: one that overlapped the kill's span is filed apart)."""
        now = time.time()
        if self.t1 is not None and now > self.t1:
            if self.kill_time is None:
                return
            kind += AFTER  # following the jobs to their end after a kill: shown, not gated
        elif during(self.kill_time, started or now, now):
            kind += DURING
        self.errors[kind] += 1
        if len(self.error_samples) < 20:
            self.error_samples.append(f"{kind}: {type(exc).__name__}: {exc}"[:300])

    def count(self, kind: str, n: int = 1, at: float | None = None) -> None:
        if self.inside(at or time.time()):
            self.counts[kind] += n
