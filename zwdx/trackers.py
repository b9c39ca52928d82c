"""Experiment trackers: a job's metrics also in TensorBoard or Weights & Biases.

Trackers run where the SDK runs, never on a donor's machine: the metrics are already the
server's (ranks report them there), so nothing of a tracker (a W&B API key, a log dir) travels
to a GPU client. Two ways in:

    zwdx.submit_job(..., trackers=["tensorboard", "wandb"])  # live, while submit_job/wait follows
    zwdx.export_metrics(job_id, ["tensorboard"])             # afterwards, from what the server stored
    zwdx jobs tensorboard JOB_ID [--logdir DIR]              # the same from the command line

A tracker gets each metric point once, in the order the server stored them: ``name`` at
``step`` from ``rank``. A series reported by rank 0 (or no rank) keeps its name; one from
another rank is ``name/rank<r>`` (per-rank platform metrics such as throughput).

    "tensorboard"           -> TensorBoard(log_dir=./zwdx-runs/<job id>)  (needs `tensorboard`)
    "wandb"                 -> WandB(project="zwdx")                       (needs `wandb`; WANDB_MODE=offline works)
    a Tracker instance      -> as it is
"""
from __future__ import annotations

import math
import os
from typing import Iterable

from .errors import BadRequest


class Tracker:
    """What a tracker does: ``start`` once per job, ``log`` each point, ``close`` at the end."""

    name = "tracker"

    def start(self, job: dict) -> None:
        """The job (its id, name, room, spec) before its first point."""

    def log(self, values: dict[str, float], step: int | None) -> None:
        """Values (series name -> number) at one step."""
        raise NotImplementedError

    def close(self) -> None:
        """After the last point (the job ended, or the export is done)."""


class TensorBoard(Tracker):
    """Event files TensorBoard reads (``tensorboard --logdir ./zwdx-runs``), one dir per job."""

    name = "tensorboard"

    def __init__(self, log_dir: str | None = None, root: str = "zwdx-runs"):
        self.log_dir, self.root, self.writer = log_dir, root, None

    def start(self, job: dict) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # torch's writer needs the tensorboard package
            raise BadRequest(f"the tensorboard tracker needs the tensorboard package (pip install tensorboard): "
                             f"{err}", field="trackers") from None
        self.log_dir = self.log_dir or os.path.join(self.root, job["id"])
        self.writer = SummaryWriter(log_dir=self.log_dir)
        self.writer.add_text("zwdx/job", f"job {job['id']} ({job.get('name') or 'unnamed'}) of room "
                                         f"{job.get('room_id')}", 0)

    def log(self, values: dict[str, float], step: int | None) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


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

    def event(self, rank: int | None, step: int | None, values: dict) -> None:
        """One metric event: a rank's values at a step (decoded: NaN is a float again)."""
        clean = {series_name(name, rank): float(value) for name, value in values.items()
                 if not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)}
        if clean:  # a diverged value is a gap, as on the dashboard
            for t in self.trackers:
                t.log(clean, step)

    def close(self) -> None:
        for t in self.trackers:
            t.close()
