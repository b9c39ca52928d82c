"""Experiment trackers: a job's metrics also in TensorBoard or Weights & Biases.

Trackers run where the SDK runs, never on a donor's machine: the metrics are already the
server's (ranks report them there), so nothing of a tracker (a W&B API key, a log dir) travels
to a GPU client. Two ways in:

    zwdx.submit_job(..., trackers=["tensorboard", "wandb"])  # live, while submit_job/wait follows
    zwdx.export_metrics(job_id, ["tensorboard"])             # afterwards, from what the server stored
    zwdx jobs tensorboard JOB_ID [--logdir DIR]              # the same from the command line

A tracker gets each metric point once, in the order the server stored them: ``name`` at
``step`` from ``rank``; once across exports too, where it remembers how far it got
(``Tracker.through``): TensorBoard keeps the last event's number in ``zwdx-export.json`` in its
log dir, so exporting a job again into the same dir (or after following it live there) adds
only the points reported since, never a second copy. A series reported by rank 0 (or no rank) keeps its name; one from
another rank is ``name/rank<r>`` (per-rank platform metrics such as throughput).

    "tensorboard"           -> TensorBoard(log_dir=./zwdx-runs/<job id>)  (needs `tensorboard`)
    "wandb"                 -> WandB(project="zwdx")                       (needs `wandb`; WANDB_MODE=offline works)
    a Tracker instance      -> as it is
"""
from __future__ import annotations

import json
import math
import os
from typing import Iterable

from .errors import BadRequest


class Tracker:
    """What a tracker does: ``start`` once per job, ``log`` each point, ``close`` at the end."""

    name = "tracker"
    #: The number (``seq``) of the job's last event this tracker holds already: later events only
    #: are sent to it. ``start`` may set it from what an earlier export left.
    through = 0

    def start(self, job: dict) -> None:
        """The job (its id, name, room, spec) before its first point."""

    def log(self, values: dict[str, float], step: int | None) -> None:
        """Values (series name -> number) at one step."""
        raise NotImplementedError

    def close(self) -> None:
        """After the last point (the job ended, or the export is done)."""


class TensorBoard(Tracker):
    """Event files TensorBoard reads (``tensorboard --logdir ./zwdx-runs``), one dir per job;
    ``MARK`` in it says which job's events it holds and up to which one."""

    name = "tensorboard"
    MARK = "zwdx-export.json"

    def __init__(self, log_dir: str | None = None, root: str = "zwdx-runs"):
        self.log_dir, self.root, self.writer = log_dir, root, None

    def start(self, job: dict) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # torch's writer needs the tensorboard package
            raise BadRequest(f"the tensorboard tracker needs the tensorboard package (pip install tensorboard): "
                             f"{err}", field="trackers") from None
        self.log_dir, self.job_id = self.log_dir or os.path.join(self.root, job["id"]), job["id"]
        self.through = self._marked()
        self.writer = SummaryWriter(log_dir=self.log_dir)
        if not self.through:
            self.writer.add_text("zwdx/job", f"job {job['id']} ({job.get('name') or 'unnamed'}) of room "
                                             f"{job.get('room_id')}", 0)

    def _marked(self) -> int:
        """How far an earlier export of this job into the log dir got (0: none did)."""
        try:
            with open(os.path.join(self.log_dir, self.MARK)) as f:
                mark = json.load(f)
        except (OSError, ValueError):
            return 0
        through = mark.get("through") if isinstance(mark, dict) and mark.get("job_id") == self.job_id else None
        return through if isinstance(through, int) and not isinstance(through, bool) and through > 0 else 0

    def log(self, values: dict[str, float], step: int | None) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self.writer is None:
            return
        self.writer.close()  # the points on disk before the mark says so
        path = os.path.join(self.log_dir, self.MARK)
        with open(path + ".tmp", "w") as f:
            json.dump({"job_id": self.job_id, "through": self.through}, f)
        os.replace(path + ".tmp", path)


class WandB(Tracker):
    """A Weights & Biases run per job, named after it; the job's spec is its config. The API
    key is the submitter's (``wandb login`` or ``WANDB_API_KEY`` where the SDK runs)."""

    name = "wandb"

    def __init__(self, project: str = "zwdx", **init_kwargs):
        self.project, self.init_kwargs, self.run = project, init_kwargs, None

    def start(self, job: dict) -> None:
        try:
            import wandb
        except ImportError as err:
            raise BadRequest(f"the wandb tracker needs the wandb package (pip install wandb): {err}",
                             field="trackers") from None
        kwargs = {"project": self.project, "name": job.get("name") or job["id"], "id": job["id"],
                  "resume": "allow", "config": {"zwdx_job_id": job["id"], "zwdx_room_id": job.get("room_id"),
                                                **(job.get("spec") or {})}, **self.init_kwargs}
        self.run = wandb.init(**kwargs)
        # The job's step is an x-axis of its own: points of several ranks may come a step
        # apart, and W&B's own step only grows (it would drop the later-arriving earlier one).
        self.run.define_metric("zwdx/step")
        self.run.define_metric("*", step_metric="zwdx/step")

    def log(self, values: dict[str, float], step: int | None) -> None:
        self.run.log({**values, **({"zwdx/step": step} if step is not None else {})})

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()


KNOWN = {"tensorboard": TensorBoard, "wandb": WandB}


def make(trackers: Iterable | None) -> list[Tracker]:
    """Tracker objects from names and instances; a clear error for anything else."""
    if trackers is None:
        return []
    if isinstance(trackers, (str, Tracker)):
        trackers = [trackers]
    out = []
    for t in trackers:
        if isinstance(t, Tracker):
            out.append(t)
        elif isinstance(t, str) and t.lower() in KNOWN:
            out.append(KNOWN[t.lower()]())
        else:
            raise BadRequest(f"trackers: each is one of {', '.join(sorted(KNOWN))} or a zwdx.trackers.Tracker, "
                             f"got {t!r}", field="trackers")
    return out


def series_name(name: str, rank: int | None) -> str:
    return name if rank in (None, 0) else f"{name}/rank{rank}"


class Feed:
    """Metric events, as the SDK reads them from the server, into trackers."""

    def __init__(self, trackers: list[Tracker], job: dict):
        self.trackers = trackers
        for t in trackers:
            t.start(job)

    @property
    def after(self) -> int:
        """The events every tracker holds already: read from the next one on."""
        return min((t.through for t in self.trackers), default=0)

    def event(self, rank: int | None, step: int | None, values: dict, seq: int | None = None) -> None:
        """One metric event (the ``seq``-th of the job): a rank's values at a step (decoded: NaN
        is a float again), to each tracker that does not hold it yet."""
        clean = {series_name(name, rank): float(value) for name, value in values.items()
                 if not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)}
        for t in self.trackers:
            if seq is not None and seq <= t.through:
                continue
            if clean:  # a diverged value is a gap, as on the dashboard
                t.log(clean, step)
            if seq is not None:
                t.through = seq

    def close(self) -> None:
        for t in self.trackers:
            t.close()
