"""The vocabulary shared by the SDK, the server and the GPU client.

Event names, the job state machine and the shapes of the messages. Nothing here imports
the server or torch, so every side can depend on it.
"""
from __future__ import annotations

import platform
from enum import Enum


class JobStatus(str, Enum):
    QUEUED = "queued"          # waiting for slots
    RESUMING = "resuming"      # lost a GPU client; waiting for slots to go on from its last checkpoint
    STARTING = "starting"      # slots reserved, ranks being launched
    RUNNING = "running"        # at least one rank reported it started
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in FINISHED


FINISHED = frozenset({JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED})
ACTIVE = frozenset({JobStatus.STARTING, JobStatus.RUNNING})
WAITING = frozenset({JobStatus.QUEUED, JobStatus.RESUMING})


class Parallelism(str, Enum):
    DDP = "DDP"
    FSDP = "FSDP"


class ClientStatus(str, Enum):
    ONLINE = "online"
    OFFLINE = "offline"


class EventKind(str, Enum):
    METRIC = "metric"
    LOG = "log"
    STATUS = "status"


class FailureKind(str, Enum):
    """How a rank failed; a job's ``failure_order`` lists the ranks whose own code raised first."""
    RAISED = "raised"            # its own code (or its start) raised
    COLLECTIVE = "collective"    # a torch.distributed call broke: it lost its peers
    EXITED = "exited"            # its process died without a word


#: Metric series zwdx records itself; ``GET /jobs/<id>/metrics`` always has them (maybe empty).
SYSTEM_METRICS = ("throughput", "gpu_utilization")


class ArtifactKind(str, Enum):
    BUNDLE = "bundle"
    WEIGHTS = "weights"
    CHECKPOINT = "checkpoint"


# The named arguments zwdx offers the submitter's functions; each is called with those it
# declares (the runner passes them, the SDK checks a function's signature against them at submit).
LOADER_ARGS = ("rank", "world_size", "device")
TRAIN_ARGS = ("model", "loader", "optimizer", "optim", "rank", "world_size", "epochs", "device", "eval_func",
              "reporter", "start_epoch", "resume")
EVAL_ARGS = ("model", "loader", "rank", "world_size", "device")


# Socket.IO events, GPU client namespace "/gpu".
GPU_NAMESPACE = "/gpu"
EV_REGISTER = "register"            # client -> server {client_id, hostname, host_id, slots, versions, modules,
                                    #                   advertise_addr, running}
EV_HEARTBEAT = "heartbeat"          # client -> server {slots, running}
EV_RESERVE_PORT = "reserve_port"    # server -> rank-0 client (call) {job_id} -> {addr, port}
EV_JOB_ASSIGN = "job_assign"        # server -> client {job_id, job_key, ranks, master_addr, ...}
EV_RANKS_EXITED = "ranks_exited"    # client -> server {job_id, exits: {rank: returncode}}
EV_JOB_CANCEL = "job_cancel"        # server -> client {job_id, reason}

# Socket.IO events, dashboard namespace "/ui" (connect with auth {token}; server -> browser).
UI_NAMESPACE = "/ui"
EV_JOB_UPDATE = "job_update"        # server -> browser: a job document
EV_JOB_EVENTS = "job_events"        # server -> browser {job_id, events: [...]}
EV_CLIENTS_UPDATE = "clients_update"  # server -> browser {clients: [...]}


def runtime_versions() -> dict:
    """Versions that decide whether cloudpickled code can be loaded here."""
    versions = {"python": platform.python_version()}
    try:
        import torch
        versions["torch"] = torch.__version__.split("+")[0]
    except ImportError:  # the server runs without torch
        pass
    try:
        import cloudpickle
        versions["cloudpickle"] = cloudpickle.__version__
    except ImportError:
        pass
    return versions


def python_minor(version: str) -> str:
    """'3.11.7' -> '3.11'."""
    return ".".join(str(version).split(".")[:2])
