"""What a rank measures of its own training: the samples its loader yields, and the platform's
metric series (``throughput``, ``gpu_utilization``; see ``zwdx.protocol.SYSTEM_METRICS``)."""
from __future__ import annotations

import threading
import time

from zwdx import defaults

from gpu_client.gpus import utilization


class CountingLoader:
    """The user's DataLoader, counting the samples it yields (for throughput). A full pass made
    while the model is in training mode is an epoch. Hooks: ``on_first_pass`` as the user's
    code starts its first pass; ``on_first_step`` once it comes back for the batch after the
    first, or ends the pass (its first step is done); ``on_epoch_end(passes)`` after an epoch,
    when the user's code starts its next pass or ``finish()`` is called: what the user does
    after a pass (``scheduler.step()``, their own counters) is done by then."""

    def __init__(self, loader, model=None, on_epoch_end=None, on_first_step=None, on_first_pass=None):
        self._loader = loader
        self._model, self._on_epoch_end = model, on_epoch_end
        self._on_first_step, self._on_first_pass = on_first_step, on_first_pass
        self.samples = 0
        self.epochs = 0
        self._epoch_pending = False

    def __iter__(self):
        self.finish()
        if self._on_first_pass is not None:
            hook, self._on_first_pass = self._on_first_pass, None
            hook()
        training = self._model is None or self._model.training
        for batch in self._loader:
            self.samples += batch_size(batch)
            yield batch
            self._first_step_done()
        if training and (self._model is None or self._model.training):
            self.epochs += 1
            self._epoch_pending = self._on_epoch_end is not None

    def finish(self) -> None:
        """Run the end of the last epoch now, if it is still due (once training is over)."""
        if self._epoch_pending:
            self._epoch_pending = False
            self._on_epoch_end(self.epochs)

    def cancel_epoch_end(self) -> None:
        """The user saved a checkpoint after the pass: the epoch's own is not needed."""
        self._epoch_pending = False

    def _first_step_done(self) -> None:
        if self._on_first_step is not None:
            hook, self._on_first_step = self._on_first_step, None
            hook()

    def __len__(self):
        return len(self._loader)

    def __getattr__(self, name):
        return getattr(self._loader, name)


def batch_size(batch) -> int:
    """Samples in a batch as loaders give them: a tensor's first dimension, that of the first
    item of a tuple or list, or of a dict's first value; 1 otherwise."""
    if hasattr(batch, "shape") and len(batch.shape):
        return int(batch.shape[0])
    if isinstance(batch, (list, tuple)) and batch:
        return batch_size(batch[0])
    if isinstance(batch, dict) and batch:
        return batch_size(next(iter(batch.values())))
    return 1


class SystemMetrics(threading.Thread):
    """The platform's metrics of one rank, in a thread: ``throughput`` (samples/s of the whole
    job: rank 0's count times ``world``, the replicas, or for mixed devices the global batch over
    rank 0's share) from rank 0, ``gpu_utilization`` (percent, from
    NVML) from every rank on a GPU. A sample is taken after the first step, every
    ``SYSTEM_METRICS_INTERVAL`` seconds and at the end (``finish``), so a job shorter than the
    interval has its samples too. ``needed`` is False where there is nothing to sample."""

    def __init__(self, reporter, loader: CountingLoader, rank: int, world: float, device):
        super().__init__(name="zwdx-system-metrics", daemon=True)
        self.reporter, self.loader, self.world = reporter, loader, world
        self.counts = rank == 0
        self.gpu = device.index if device.type == "cuda" else None
        self.needed = self.counts or self.gpu is not None
        self.started = time.time()
        self._last = (0, self.started)
        self._wake = threading.Event()
        self._first = threading.Event()  # the first step is done and its sample not yet taken
        self._done = threading.Event()

    def first_step(self) -> None:
        """Called by the training thread: sample now (from this thread, off the training path)."""
        self._first.set()
        self._wake.set()

    def run(self) -> None:
        while True:
            self._wake.wait(defaults.SYSTEM_METRICS_INTERVAL)
            self._wake.clear()
            if self._done.is_set():
                return
            self._sample(self._last)
            self._first.clear()

    def finish(self, sample: bool = True) -> None:
        """Training is over: stop the thread and (``sample``) take the last sample, with the mean
        throughput over the whole of training. Only the first call does anything."""
        if self._done.is_set():
            return
        self._done.set()
        self._wake.set()
        if self.is_alive():
            self.join(timeout=5)
        if sample and self.needed:
            if self._first.is_set():  # training ended before the thread took it
                self._sample(self._last)
            self._sample((0, self.started))

    def _sample(self, since: tuple[int, float]) -> None:
        now, n = time.time(), self.loader.samples
        values = {}
        if self.counts and n > since[0]:
            values["throughput"] = (n - since[0]) * self.world / max(now - since[1], 1e-9)
        if self.gpu is not None:
            util = utilization(self.gpu)
            if util is not None:
                values["gpu_utilization"] = util
        if values:
            self.reporter.log_system(**values)
        self._last = (n, now)
