"""The words every side uses: statuses and kinds as ``str`` enums (their values are what is
stored and sent), the groups of job statuses, the arguments offered to the submitter's
functions, and the versions that decide where a bundle can load.

The dashboard uses the same enums: ``ui/src/lib/protocol.js`` is generated from this module
(``python -m zwdx.protocol.js``), and a test fails when the two differ.
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
    #: Each GPU client a worker, training alone for ``inner_steps``; outer steps sync through the
    #: server (``zwdx.protocol.diloco``).
    DILOCO = "DILOCO"
    #: The model cut into stages, one per rank, run as a pipeline over micro-batches
    #: (``torch.distributed.pipelining``; ``zwdx.protocol.pipeline``).
    PIPELINE = "PIPELINE"
    #: Tensor parallel: the job's ranks one group on one GPU client, each Linear pair split
    #: column/row-wise over them (DTensor ``parallelize_module``; ``gpu_client/rank/strategies/tensor_parallel.py``).
    TP = "TP"
    #: 2-D: TP inside each GPU client's group of ranks, FSDP2 ``fully_shard`` across the groups.
    FSDP_TP = "FSDP+TP"
    #: Chosen by the server as the job is placed (``zwdx.server.auto``): a job is AUTO only while
    #: it waits; its record then holds the mode chosen and why (``Job.auto``).
    AUTO = "AUTO"


class PipelineSchedule(str, Enum):
    """The order a PIPELINE job's stages run their micro-batches in (torch's schedule classes)."""
    GPIPE = "gpipe"  # every forward, then every backward (ScheduleGPipe)
    ONE_F_ONE_B = "1f1b"  # one forward, one backward, once the pipeline is full (Schedule1F1B)
    #: 1F1B over several stages a rank (rank r runs stages r, r + ranks, ...): a smaller bubble
    #: for more sends (ScheduleInterleaved1F1B)
    INTERLEAVED_ONE_F_ONE_B = "interleaved1f1b"


class LayoutRole(str, Enum):
    """What a rank holds of the model, as its layout says (``zwdx.protocol.layout``)."""
    REPLICA = "replica"  # the whole model (DDP, a DILOCO worker)
    SHARD = "shard"      # a share of each FSDP unit's weights
    STAGE = "stage"      # a run of layers: a PIPELINE stage
    TP = "tp"            # halves of layers (tensor parallel)
    FSDP_TP = "fsdp+tp"  # FSDP across clients, tensor parallel within one


class TpStyle(str, Enum):
    """How a TP job splits one module of the model (``tp_plan``'s values; torch's parallel styles)."""
    COLWISE = "colwise"  # the output features split over the TP group (ColwiseParallel)
    ROWWISE = "rowwise"  # the input features split, the outputs summed (RowwiseParallel)


class Compression(str, Enum):
    """How a DILOCO worker's pseudo-gradients travel (``zwdx.codec``)."""
    INT8 = "int8"    # int8 codes with one float32 scale per block of 4,096 values: about 1/4 of float32
    FP16 = "fp16"    # float16: 1/2 of float32
    NONE = "none"    # float32 as computed


class Aggregate(str, Enum):
    """How a DILOCO round combines its workers' pseudo-gradients (``zwdx.robust``)."""
    ROBUST = "robust"  # clipped to the round's median norm, then a coordinate-wise trimmed mean
    MEAN = "mean"      # the plain mean: every worker trusted


class Devices(str, Enum):
    """Which kinds of slot one job's ranks take (``submit_job(..., devices=...)``)."""
    SAME = "same"      # one kind: every rank on a GPU, or every rank on a CPU slot (NCCL or gloo)
    MIXED = "mixed"    # GPU and CPU slots together, over gloo; each rank's batch weighted by its
                       # measured speed (gpu_client/rank/strategies/mixed.py)


class JobKind(str, Enum):
    """What a job runs: the submitter's functions over a pickled bundle, or a script of an
    uploaded working dir under torchrun's environment (``zwdx run``)."""
    FUNCTION = "function"
    SCRIPT = "script"


class RankStatus(str, Enum):
    """What a rank last reported of itself (or, for ``dropped``, what the server decided)."""
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    DROPPED = "dropped"    # a DILOCO worker whose GPU client or process was lost: the others go on


class SlotKind(str, Enum):
    """What a slot of a GPU client is: one GPU, or the CPU of a client without GPUs."""
    CUDA = "cuda"
    CPU = "cpu"


class Isolation(str, Enum):
    """How a GPU client keeps the job code of its slots away from itself and from other jobs
    (``gpu_client/sandbox/isolation.py``; ``zwdx gpu-client --isolation``)."""
    USER = "user"          # per-job user: each job's ranks run as an unprivileged uid of their own
    PROCESS = "process"    # same user: ranks run as the GPU client's own user (it is not root)
    DOCKER = "docker"      # container: each rank in a fresh locked-down container (gpu_client/sandbox/container.py)


class CheckpointFormat(str, Enum):
    """How a checkpoint's files were written; the server decides it from the job's parallelism
    (``zwdx.protocol.checkpoint``), never from what a rank says."""
    TORCH = "torch"    # DDP: one file from rank 0, read with torch.load(weights_only=True)
    SHARDS = "shards"  # FSDP: each rank's shards as safetensors with a JSON index; no pickle
    DCP = "dcp"        # FSDP of earlier versions (torch.distributed.checkpoint, whose metadata is
                       # a pickle): in old records only; never committed, never read
    STAGES = "stages"  # PIPELINE: each rank its stage's model and optimizer state, read as TORCH's


class CredentialRole(str, Enum):
    """What a room's token may do: a submitter's submits and reads jobs, a donor's connects GPU
    clients (``zwdx.protocol.tokens``)."""
    SUBMITTER = "submitter"
    DONOR = "donor"


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
    WORKDIR = "workdir"    # a script job's working dir (a tar.gz), the room's, found by its sha256
    OUTPUT = "output"      # the files a script job's rank 0 wrote under $ZWDX_OUTPUT_DIR (a tar)
    PSEUDO_GRADIENT = "pseudo_gradient"   # a DILOCO worker's upload for one round
    OUTER_GRADIENT = "outer_gradient"     # a round's average of them, which every worker fetches
    DATASET = "dataset"                   # a version of a room dataset: its manifest (JSON), the room's
    DATASET_CHUNK = "dataset_chunk"       # a piece of a dataset's file, the room's, found by its sha256
    DILOCO_STATE = "diloco_state"         # the global weights and outer optimizer state a joining worker starts from
    DILOCO_START = "diloco_start"         # the submitter's model as submitted: a DILOCO job's start weights
    DILOCO_GLOBAL = "diloco_global"       # the global weights and outer momentum the server holds after a round


# The named arguments zwdx offers the submitter's functions; each is called with those it
# declares (the runner passes them, the SDK checks a function's signature against them at submit).
LOADER_ARGS = ("rank", "world_size", "device", "data_dir", "batch_size", "sampler")
TRAIN_ARGS = ("model", "loader", "optimizer", "optim", "rank", "world_size", "epochs", "device", "eval_func",
              "reporter", "start_epoch", "resume", "pipeline")
EVAL_ARGS = ("model", "loader", "rank", "world_size", "device")


def runtime_versions() -> dict[str, str]:
    """Versions that decide whether cloudpickled code can be loaded here."""
    versions = {"python": platform.python_version()}
    try:
        import torch
        versions["torch"] = torch.__version__.split("+")[0]
    except ImportError:  # the server runs without torch
        pass
    try:
        import cloudpickle  # type: ignore[import-untyped]
        versions["cloudpickle"] = cloudpickle.__version__
    except ImportError:
        pass
    return versions


def python_minor(version: str) -> str:
    """'3.11.7' -> '3.11'."""
    return ".".join(str(version).split(".")[:2])

__all__ = ['JobStatus', 'FINISHED', 'ACTIVE', 'WAITING', 'Parallelism', 'PipelineSchedule', 'LayoutRole', 'Devices', 'TpStyle', 'JobKind', 'Compression', 'Aggregate', 'RankStatus', 'SlotKind', 'Isolation', 'CheckpointFormat', 'CredentialRole', 'ClientStatus', 'EventKind', 'FailureKind', 'SYSTEM_METRICS', 'ArtifactKind', 'LOADER_ARGS', 'TRAIN_ARGS', 'EVAL_ARGS', 'runtime_versions', 'python_minor']
