"""What a rank tells the server: metrics, log lines, its start, result or failure.

Every call carries the rank's key (``X-Zwdx-Rank-Key``), which speaks for this rank of this
attempt only: no room token. Events queue in memory and a sender thread posts them in batches
(of at most ``BATCH_BYTES``). If the server is away, the batch is kept and retried with backoff
(``outage.py``) until it is delivered, so nothing reported is lost while training goes on (up to
``BUFFER_BYTES`` undelivered; later ones are dropped and counted in the log); each event carries
a key unique in its job and rank, so a batch sent twice is stored once. A batch the server refuses (4xx; over the room's
quota, 429 ``quota_exceeded``; below its free-space floor, 507), or that cannot be written as
JSON, is dropped with an error in the log, never retried; one refused for the rank's pace (429
``too_many_requests``) is sent again later.

A NaN or infinite number (a loss that diverged) travels as the string "NaN", "Infinity" or
"-Infinity" (``zwdx.protocol.report.to_wire``): JSON has no such numbers, and ``requests``
refuses to send them.
"""
from __future__ import annotations

import hashlib
import logging
import numbers
import os
import queue
import threading
import time

import requests

from zwdx import defaults
from zwdx.protocol.report import to_wire

from gpu_client.outage import http_session, sent_again

log = logging.getLogger(__name__)

#: The most an events batch holds, in bytes of its events' text (well under the server's
#: limit on a request body, ``MAX_REQUEST_BYTES``, 8 MiB by default).
BATCH_BYTES = 1024 * 1024
#: The most events a rank keeps undelivered (bytes of their text, as ``BATCH_BYTES``) while the
#: server is away: past it, new ones are dropped and counted, and the count is logged once the
#: server is back (training goes on, and its memory stays bounded).
BUFFER_BYTES = 16 * 1024 * 1024


def _number(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Number):
        raise TypeError(f"metric values must be numbers, got {type(value).__name__}")
    return float(value)


def _size(event: dict) -> int:
    """About how many bytes an event takes in a batch (its text; numbers are small)."""
    return 200 + sum(len(v) if isinstance(v, str) else 24 for v in event["data"].values())


class Reporter:
    """Given to ``train_func`` as ``reporter``: ``log_metrics(**values)`` and ``log(text)``."""

    def __init__(self, server: str, rank_key: str, job_id: str, rank: int, attempt: int = 0,
                 flush_interval: float = 0.2, verify: str | bool = True,
                 patience: float = defaults.OUTAGE_TOLERANCE):
        self.base = f"{server.rstrip('/')}{defaults.API_PREFIX}/jobs/{job_id}"
        #: Seconds a call waits for a server that is away (``outage.py``).
        self.patience = float(patience)
        self.session = http_session(rank_key, verify=verify, patience=self.patience)
        self.job_id, self.rank, self.attempt = job_id, rank, attempt
        self.step = 0
        #: Where to go on from: the first epoch to run (0 unless resumed from a checkpoint).
        self.start_epoch = 0
        #: None, or ``{"epoch", "step", "epoch_complete", "checkpoint"}`` of the checkpoint restored.
        self.resume: dict | None = None
        self._checkpointer = None  # the job's Checkpointer (attach)
        self._loader = None        # the CountingLoader given to train_func (attach)
        #: DILOCO: the worker's outer step (``diloco.Diloco.sync``); None in other modes.
        self.outer_step = None
        self._n = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._flush_interval = flush_interval
        self._closed = threading.Event()
        self._outstanding = 0                 # queued or in flight, not yet delivered
        self._buffered = 0                    # their bytes (``_size``), at most BUFFER_BYTES
        self._dropped = 0                     # events dropped on a full buffer, not yet told
        self._delivered = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._send_loop, name="zwdx-reporter", daemon=True)
        self._thread.start()

    # -- the runner's side -----------------------------------------------------------------
    def attach(self, checkpointer, loader=None) -> None:
        """Give ``checkpoint()`` and ``track()`` the job's Checkpointer and the loader given to
        ``train_func``; go on from the checkpoint it restored (its epoch and step), if any."""
        self._checkpointer, self._loader = checkpointer, loader
        self.start_epoch, self.resume = checkpointer.start_epoch, checkpointer.resume
        if checkpointer.latest is not None:
            self.step = int(checkpointer.latest.step or 0)

    def commit_checkpoint(self, n: int, files: list[str], **fields) -> None:
        """Rank 0: checkpoint ``n`` is complete (every rank uploaded ``files``); the server keeps it."""
        self.flush()
        resp = self.session.post(f"{self.base}/checkpoints/{n}/commit", json={"files": files, **fields}, timeout=60)
        if resp.status_code == 409 and "is committed" in resp.text and sent_again(resp):
            # an earlier try went through and its answer was lost (the server went away)
            log.info("rank %d: checkpoint %d committed by an earlier try", self.rank, n)
            return
        resp.raise_for_status()

    def send_layout(self, layout: dict) -> bool:
        """Tell the server what this rank holds of the model (``zwdx.protocol.layout``), for the
        job's page. It only describes: one that breaks a bound, or a server that does not take
        it, is logged, never raised. True when the server kept it."""
        from zwdx.errors import BadRequest
        from zwdx.protocol.base import parse
        from zwdx.protocol.layout import RankLayout
        try:
            body = parse(RankLayout, layout, "layout").model_dump(mode="json")
            resp = self.session.post(f"{self.base}/ranks/{self.rank}/layout", json=body, timeout=30)
        except (BadRequest, requests.RequestException) as exc:
            log.warning("rank %d: layout not sent: %s", self.rank, exc)
            return False
        if resp.status_code >= 400:
            log.warning("rank %d: layout refused (%d): %s", self.rank, resp.status_code, resp.text[:300])
            return False
        try:
            return bool(resp.json().get("ok"))
        except ValueError:
            return False

    def download(self, path: str, file_path: str) -> None:
        """GET ``<job url>/<path>`` into ``file_path``, streamed, checked against the sha256 the
        server stored for it (``IOError`` and no file when it differs)."""
        digest = hashlib.sha256()
        with self.session.get(f"{self.base}/{path}", stream=True, timeout=600) as resp:
            resp.raise_for_status()
            with open(file_path, "wb") as fh:
                for block in resp.iter_content(defaults.CHUNK_BYTES):
                    digest.update(block)
                    fh.write(block)
            expected = resp.headers.get(defaults.SHA256_HEADER)
        if expected is not None and digest.hexdigest() != expected:
            os.unlink(file_path)
            raise OSError(f"{path} arrived corrupted (sha256 {digest.hexdigest()}, the server stored {expected})")

    # -- the user's side -------------------------------------------------------------------
    def log_metrics(self, step: int | None = None, **values) -> None:
        """Record metrics (loss=..., accuracy=...). ``step`` defaults to a running count."""
        if not values:
            return
        data = {name: to_wire(_number(v)) for name, v in values.items()}
        with self._lock:
            if step is None:
                step = self.step
                self.step += 1
            else:
                self.step = int(step) + 1
        self._put("metric", data, int(step))

    def log_system(self, **values) -> None:
        """Platform metrics (throughput, GPU utilisation) at the user's latest step."""
        with self._lock:
            step = max(self.step - 1, 0)
        self._put("metric", {name: to_wire(_number(v)) for name, v in values.items()}, step)

    def checkpoint(self) -> int | None:
        """Save a checkpoint now (model, optimizer, tracked objects, epoch, step). Every rank must
        call it at the same point of training. Returns the checkpoint's number."""
        if self._checkpointer is None:
            return None
        passes = 0
        if self._loader is not None:
            self._loader.cancel_epoch_end()  # this one holds what the epoch's own would
            passes = self._loader.epochs
        return self._checkpointer.save(self.start_epoch + passes, self.step, epoch_complete=False)

    def track(self, obj, name: str | None = None):
        """Keep ``obj``'s state (anything with ``state_dict()`` and ``load_state_dict()``: an LR
        scheduler, a GradScaler, your own counters) in every checkpoint; when the job resumes
        from one, that state is loaded back into ``obj`` here, as you track it again. Objects
        are told apart by ``name``, or by their type and the order you track them in.
        Returns ``obj``."""
        if self._checkpointer is None:
            raise RuntimeError("reporter.track works inside a job's train_func")
        return self._checkpointer.track(obj, name)

    def sync(self) -> None:
        """DILOCO: take an outer step now (with the other workers, through the server), whatever
        the count of inner steps; the next one comes ``inner_steps`` later. Other modes: nothing."""
        if self.outer_step is not None:
            self.outer_step()

    def upload(self, path: str, file_path: str) -> dict:
        """PUT a file to ``<job url>/<path>``, streamed, with its sha256 for the server to check."""
        digest = hashlib.sha256()
        with open(file_path, "rb") as fh:
            for block in iter(lambda: fh.read(defaults.CHUNK_BYTES), b""):
                digest.update(block)
        with open(file_path, "rb") as fh:
            resp = self.session.put(f"{self.base}/{path}", data=fh,
                                    headers={defaults.SHA256_HEADER: digest.hexdigest()}, timeout=600)
        resp.raise_for_status()
        return resp.json()

    def log(self, text: str) -> None:
        """A log line, shown in the job's logs."""
        self._put("log", {"text": str(text)}, None)

    def _put(self, kind: str, data: dict, step) -> None:
        event = {"kind": kind, "rank": self.rank, "step": step, "data": data, "ts": time.time()}
        size = _size(event)
        with self._lock:
            if self._buffered + size > BUFFER_BYTES:  # the server has been away long: training goes on
                self._dropped += 1
                return
            self._n += 1
            self._outstanding += 1
            self._buffered += size
            event["key"] = f"{self.attempt}:{self._n}"
        self._queue.put(event)

    def _settled(self, events: list[dict]) -> None:
        """``events`` delivered (or refused for good): out of the count and the buffer."""
        with self._delivered:
            self._outstanding -= len(events)
            self._buffered -= sum(_size(e) for e in events)
            dropped, self._dropped = self._dropped, 0
            self._delivered.notify_all()
        if dropped:
            log.warning("rank %d: %d event(s) dropped while the server was away (%d MiB kept undelivered at most)",
                        self.rank, dropped, BUFFER_BYTES >> 20)
            self.log(f"rank {self.rank}: {dropped} metric or log event(s) were dropped while the server was away "
                     f"(a rank keeps {BUFFER_BYTES >> 20} MiB of them undelivered at most)")

    # -- delivery ----------------------------------------------------------------------------
    def _send_loop(self) -> None:
        pending: list[dict] = []
        held = None  # the event that did not fit the last batch: the next one's first
        backoff = 0.2
        last_post = 0.0
        while True:
            if not pending:
                # at most one post per flush interval: what comes meanwhile goes in the next batch
                # (a rank posting after every step outruns the server's pace per rank: 429s)
                pause = self._flush_interval - (time.monotonic() - last_post)
                if pause > 0 and not self._closed.is_set():
                    self._closed.wait(pause)
                size = 0
                try:
                    event = held if held is not None else self._queue.get(timeout=self._flush_interval)
                    held = None
                    while True:
                        pending.append(event)
                        size += _size(event)
                        if len(pending) >= 500:
                            break
                        event = self._queue.get_nowait()
                        if size + _size(event) > BATCH_BYTES:
                            held = event
                            break
                except queue.Empty:
                    pass
            if not pending:
                if self._closed.is_set():
                    return
                continue
            try:
                last_post = time.monotonic()
                resp = self.session.post(f"{self.base}/events", json={"events": pending}, timeout=30)
                refused = resp.status_code == 507 or resp.status_code == 429 and "quota_exceeded" in resp.text
                if resp.status_code == 429 and not refused:  # this rank posts too often: later
                    raise requests.RequestException(f"server busy (429): {resp.text[:200]}")
                if 400 <= resp.status_code < 500 or refused:
                    # never retry what the server rejects as wrong, nor what the room's quota or
                    # the server's disk has no room for: the job goes on without these
                    log.error("rank %d: server refused %d event(s): %s", self.rank, len(pending), resp.text[:200])
                else:
                    resp.raise_for_status()
                self._settled(pending)
                pending = []
                backoff = 0.2
            except requests.exceptions.InvalidJSONError as exc:  # a bug of ours: sending it again would not help
                log.error("rank %d: %d event(s) cannot be sent as JSON, dropped: %s", self.rank, len(pending), exc)
                self._settled(pending)
                pending = []
            except requests.RequestException as exc:
                log.warning("rank %d: server unreachable, keeping %d event(s): %s", self.rank, len(pending), exc)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every event so far is delivered."""
        with self._delivered:
            return self._delivered.wait_for(lambda: self._outstanding == 0, timeout=timeout)

    def status(self, status: str, **fields) -> None:
        """Tell the server this rank is running, completed or failed (delivered with retries)."""
        self.flush(timeout=self.patience)
        deadline = time.time() + self.patience
        while True:
            try:
                resp = self.session.post(f"{self.base}/ranks/{self.rank}", json=to_wire({"status": status, **fields}),
                                         timeout=30)
                if resp.status_code < 500 and resp.status_code != 429:
                    if resp.status_code >= 400:
                        log.error("rank %d: status %s refused: %s", self.rank, status, resp.text[:300])
                    return
            except requests.RequestException as exc:
                if time.time() > deadline:
                    raise
                log.warning("rank %d: cannot report %s yet: %s", self.rank, status, exc)
            time.sleep(1.0)

    def close(self) -> None:
        self.flush()
        self._closed.set()
        self._thread.join(timeout=5)
