"""Hashing (and writing) bytes as they stream by, in a thread of its own.

``hashlib`` lets go of the GIL while it hashes a large block, so a thread that hashes block k
while the caller reads block k+1 (from a socket, a file) runs on a core of its own: the sha256
of a bundle costs about what reading it costs, instead of adding to it. A GPU client's agent
writes and hashes a bundle so as it downloads it (``gpu_client.agent.workspace``), and a rank hashes
the bytes it loads so (``zwdx.bundle.load``): on a 500 MB bundle each sha256 is a few tenths of
a second that the job's start used to wait for.

    digest = hashlib.sha256()
    with Behind(digest.update, fh.write) as behind:
        for block in blocks:
            behind.put(block)        # returns at once while fewer than ``depth`` blocks wait
    digest.hexdigest()               # every block hashed and written, in order
"""
from __future__ import annotations

import queue
import threading

_END = object()


class Behind:
    """Feeds each block ``put`` to every one of ``sinks`` (callables), in order, in a thread of
    its own; at most ``depth`` blocks wait. Leaving the ``with`` (or ``close``) waits for the
    last block and raises what a sink raised; a block put after a sink failed raises at once.
    Blocks must not change after ``put`` (``bytes``, or a view of memory nobody writes again)."""

    def __init__(self, *sinks, depth: int = 16):
        self.sinks = sinks
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="zwdx-behind", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (block := self._queue.get()) is not _END:
            if self._error is not None:
                continue  # drained, so that put never blocks on a dead consumer
            try:
                for sink in self.sinks:
                    sink(block)
            except BaseException as exc:
                self._error = exc

    def put(self, block) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(block)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_END)
            self._thread.join()
        if self._error is not None:
            raise self._error

    def __enter__(self) -> "Behind":
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.close()
            return
        try:  # the caller's error wins; the thread still ends before it propagates
            self.close()
        except BaseException:
            pass
