"""The wait loop: follow a job with held polls (``GET /jobs/<id>?events_after=&wait=``) until
it ends, riding out a server that is briefly away, showing its progress (a bar, or its log
lines as they come) and feeding its metrics to trackers; Ctrl-C's handling."""
from __future__ import annotations

import sys
import time

from .. import defaults, trackers as _trackers
from ..errors import Conflict, ServerUnreachable, ZwdxError
from ..protocol import WAITING, JobStatus
from ..protocol.report import from_wire


def log_line(event: dict) -> str:
    """A job's log event as one line, labelled with the rank that wrote it (the server's own
    lines, such as DILOCO's round summaries, have no rank)."""
    rank = event.get("rank")
    return f"[{'server' if rank is None else f'rank {rank}'}] {(event.get('data') or {}).get('text', '')}"


def say(message: str) -> None:
    """A line for the person at the terminal (stderr), never carrying a token."""
    print(message, file=sys.stderr, flush=True)


def interrupt(job_id: str) -> KeyboardInterrupt:
    """The ``KeyboardInterrupt`` a Ctrl-C while following a job raises: raised ``from None`` in
    a fresh one, so that its traceback ends in the SDK's call, not in the socket read it cut."""
    return KeyboardInterrupt(f"job {job_id}: interrupted")


class Follower:
    """One job followed to its end by one client (``ZWDX._follow``)."""

    def __init__(self, sdk, job_id: str, token: str, progress: bool, timeout: float | None, trackers=None,
                 on_log=None):
        self.sdk, self.job_id, self.token, self.on_log, self.timeout = sdk, job_id, token, on_log, timeout
        self.deadline = (time.time() + timeout) if timeout else None
        self.after, self.latest, self.said, self.away_since = 0, {}, None, None
        self.feed = _trackers.Feed(_trackers.make(trackers), sdk._json("GET", f"/jobs/{job_id}", token)) \
            if trackers else None
        self.bar = None
        if progress and on_log is None:
            from tqdm.auto import tqdm
            self.bar = tqdm(desc=f"job {job_id}", unit="step", dynamic_ncols=True)

    def run(self) -> dict:
        """The job's last document, once it ended."""
        try:
            while True:
                asked = time.monotonic()
                answer = self._poll()
                if answer is None:  # the server is away: keep waiting, within reason
                    continue
                job, events = answer
                self._show(job, events)
                if JobStatus(job["status"]).finished:
                    if not events:  # its last events may fill more than one answer (a page each)
                        return job
                    continue
                if self.deadline and time.time() > self.deadline:
                    raise TimeoutError(f"job {self.job_id} still {job['status']} after {self.timeout} s")
                # News came at once: let more gather (one call per POLL_INTERVAL at most, also
                # against a server that does not hold polls).
                time.sleep(max(0.0, defaults.POLL_INTERVAL - (time.monotonic() - asked)))
        finally:
            if self.bar is not None:
                self.bar.close()
            if self.feed is not None:
                self.feed.close()

    def _poll(self) -> tuple[dict, list] | None:
        """One held poll: the job and its new events; None while the server is away (a restart)."""
        # The server holds the call until the job has news (at most LONG_POLL s): waiting on a
        # quiet job costs a call every LONG_POLL s.
        hold = defaults.LONG_POLL if not self.deadline else max(0.0, min(defaults.LONG_POLL,
                                                                         self.deadline - time.time()))
        try:
            job = self.sdk._json("GET", f"/jobs/{self.job_id}", self.token,
                                 params={"events_after": self.after, "wait": hold},
                                 timeout=max(self.sdk.timeout, defaults.LONG_POLL + 15))
        except ServerUnreachable:
            self.away_since = self.away_since or time.time()
            if time.time() - self.away_since > defaults.OUTAGE_TOLERANCE:
                raise
            if self.bar is not None:
                self.bar.set_description(f"job {self.job_id} (server unreachable, waiting)")
            time.sleep(1.0)
            return None
        self.away_since = None
        return job, job.pop("events", [])

    def _show(self, job: dict, events: list) -> None:
        for ev in events:
            self.after = ev["seq"]
            if ev["kind"] == "metric":
                self._metric(ev)
            elif ev["kind"] == "log" and self.on_log is not None:
                self.on_log(ev)
            elif ev["kind"] == "log" and self.bar is not None:
                self.bar.write(log_line(ev))
        waiting = JobStatus(job["status"]) in WAITING and job.get("waiting_reason")
        line = f"job {self.job_id} {job['status']}" + (f": {waiting}" if waiting else "")
        if self.on_log is not None and (job["status"], waiting) != self.said:
            self.said = (job["status"], waiting)
            say(f"zwdx: {line}")
        if self.bar is not None:
            self.bar.set_description(line)
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in sorted(self.latest.items())[:6]}, refresh=True)

    def _metric(self, ev: dict) -> None:
        self.latest.update(from_wire(ev["data"]))
        if self.feed is not None:
            self.feed.event(ev.get("rank"), ev.get("step"), from_wire(ev["data"]), ev["seq"])
        if self.bar is not None and ev.get("step") is not None:
            self.bar.n = max(self.bar.n, ev["step"] + 1)


def interrupted(sdk, job_id: str, token: str, cancel: bool) -> None:
    """Ctrl-C while waiting: cancel the job, or leave it running and say how to get back to it."""
    server = f" --server {sdk.server_url}"
    if not cancel:
        say(f"zwdx: stopped waiting; job {job_id} goes on running. Re-attach with zwdx.wait({job_id!r}) or "
            f"`zwdx jobs show {job_id}{server}`; cancel it with `zwdx jobs cancel {job_id}{server}`")
        return
    say(f"zwdx: Ctrl-C: cancelling job {job_id} (Ctrl-C again to stop at once)")
    try:
        # A fresh session: the interrupted request may have left its connection half read.
        with sdk._new_session() as session:
            sdk._json("POST", f"/jobs/{job_id}/cancel", token, session=session, timeout=15)
        say(f"zwdx: job {job_id} cancelled")
    except KeyboardInterrupt:
        say(f"zwdx: stopped; job {job_id} may still be running: `zwdx jobs cancel {job_id}{server}`")
        raise interrupt(job_id) from None
    except Conflict as exc:
        say(f"zwdx: job {job_id} had already ended ({exc.context.get('status', 'finished')})")
    except ZwdxError as exc:
        say(f"zwdx: could not cancel job {job_id} ({exc}); cancel it with `zwdx jobs cancel {job_id}{server}`")
