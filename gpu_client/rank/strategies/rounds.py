"""A DILOCO round's timing and travel, shared by the worker (``diloco.py``) and a worker joining
(``joining.py``): how often to ask, the timeout that says peers are lost, a round on its own thread."""
from __future__ import annotations

import threading
import time

import torch

#: Seconds between two asks for a round's average (growing to ``POLL_MAX``).
POLL_FIRST, POLL_MAX = 0.02, 0.5


class RoundTimeout(TimeoutError):
    """A round's peers did not upload in time: this worker lost them."""


class Transfer:
    """One round travelling while the worker trains on (``overlap``): ``work`` (the exchange, or a
    joining worker's first fetch) on a thread of its own; ``result()`` waits for it and raises
    what it raised."""

    def __init__(self, n: int, work):
        self.round, self.seconds = n, 0.0
        self._out = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), name=f"diloco-round-{n}", daemon=True)
        self._thread.start()

    def _run(self, work) -> None:
        started = time.time()
        try:
            self._out = work()
        except BaseException as exc:  # raised again in the training thread, at the next sync point
            self._error = exc
        self.seconds = time.time() - started

    def result(self) -> tuple[torch.Tensor, bool, int, int]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._out
