"""What a GPU client's agent hands each rank process it starts: one ``RankSpec``, once.

The agent writes it as one JSON line on the rank process's stdin, to a standby process (started
ahead, torch imported) and to a fresh one alike; when the job's bundle is still being fetched
(``bundle_pending``) a second line, ``ready``, follows once it is on disk (end of input: it could
not be fetched); with ``bundle_size`` the rank reads and hashes the file as the agent writes it,
and still waits for that line before it goes on. Nothing else travels: no ``ZWDX_*`` environment
variables. The environment keeps only what libraries read themselves (``OMP_NUM_THREADS``,
``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, ``PYTHONUNBUFFERED``); the rank process sets torch's ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` from the spec for libraries
that read them.

A rank holds one secret, its rank key (``zwdx.protocol.tokens``): bound to this rank of this
attempt of the job and to this GPU client, good only while the job runs. No room token, no
client secret: job code that reads its own spec can speak for its own rank and nothing else.
The key travels only here, on stdin: never in an environment or on a command line, where other
processes of the machine could read it. It is a ``SecretStr``, so a spec printed or logged
shows ``**********``; only its JSON line carries it.

Every value the server decided comes resolved (``JobAssign``): the rank process derives no
default of its own.

The ``sandbox`` is where the rank runs (``gpu_client/sandbox/isolation.py``): the job's private
directory on this GPU client and, under a per-job user, the uid and gid the rank process
drops to right after reading its spec, before it opens anything of the job.
"""
from __future__ import annotations

from typing import IO, Annotated, Literal

from pydantic import Field, SecretStr, StringConstraints, field_serializer

from .. import defaults
from .base import Count, Id, Message, Seconds, Text
from .job import CheckpointEntry
from .spec import Diloco, JobSpec, Pipeline, Script
from .vocab import Devices, JobKind, Parallelism, TpStyle

#: Where a rank's tensors live: the CPU, or one GPU of this machine.
Device = Annotated[str, StringConstraints(pattern=r"^(cpu|cuda:[0-9]{1,3})$")]
Path = Annotated[str, StringConstraints(min_length=1, max_length=4096)]


#: A uid or gid a rank may run as: never root's.
UnprivilegedId = Annotated[int, Field(ge=1, le=2**32 - 2)]


class Sandbox(Message):
    """Where one job's ranks run on one GPU client: its private directory (the agent's: the
    bundle, the CA file, ``data``; its ``home`` the ranks' working directory and ``HOME``, its
    ``tmp`` their ``TMPDIR``: ``gpu_client/sandbox/folder.py``) and, under a per-job user
    (``--isolation user``), the uid and gid they run as. None of them: the GPU client's own."""
    dir: Path
    uid: UnprivilegedId | None = None
    gid: UnprivilegedId | None = None
    #: The room's compile cache on this GPU client (``--compile-cache``), lent to this job; None:
    #: the sandbox's own (``gpu_client/sandbox/compile_cache.py``).
    compile_cache: Path | None = None


class RankSpec(Message):
    """Everything one rank process needs to run its rank of one attempt of a job."""

    # -- which rank of which job -----------------------------------------------------------------
    job_id: Id
    attempt: Count
    rank: Count
    #: Its index among this GPU client's ranks of the job.
    local_rank: Count
    world_size: Annotated[int, Field(ge=1, le=2**20)]
    #: The job's spec as the server stores it (``zwdx.protocol.spec``): its options, read where used.
    job: JobSpec

    # -- how the ranks meet and train ------------------------------------------------------------
    master_addr: Annotated[str, StringConstraints(min_length=1, max_length=255)]
    master_port: Annotated[int, Field(ge=1, le=65535)]
    #: The job's GPU clients' addresses a rank in a container may connect to (``reach.egress_peers``).
    peers: Annotated[list[Annotated[str, StringConstraints(max_length=255)]], Field(max_length=4096)] = []
    backend: Literal["nccl", "gloo"]
    device: Device
    #: Seconds a collective may wait for its peers.
    collective_timeout: Annotated[float, Field(gt=0, le=1e7)]
    #: The checkpoint to go on from (a resumed attempt), or None.
    checkpoint: CheckpointEntry | None
    #: torch threads of this rank.
    threads: Annotated[int, Field(ge=1, le=4096)]
    #: DILOCO: this worker joins a running job (``JobAssign.joining``).
    joining: bool = False
    #: DILOCO with ``verify``: this process is a shadow (``zwdx.verify``), and this is its own rank,
    #: the one its key speaks for (from ``world_size`` on), while ``rank`` is the worker's it runs
    #: again: its uploads are compared with that worker's and never averaged; None: a worker.
    shadow: Annotated[int, Field(ge=0, le=2**21)] | None = None
    #: DILOCO with several ranks per worker: the port on 127.0.0.1 where this GPU client's ranks
    #: of the job (one worker) meet as their own process group (the agent picks it); None: one rank.
    worker_port: Annotated[int, Field(ge=1, le=65535)] | None = None
    #: Listening sockets the GPU client hands this rank on its channel (``launcher``), for the
    #: stores it serves: rank 0's rendezvous port, a DILOCO worker's port; 0 where none (a container).
    listeners: Annotated[int, Field(ge=0, le=2)] = 0
    #: TP and FSDP+TP: the TP group's size, resolved (``JobAssign.tp_size``).
    tp_size: Annotated[int, Field(ge=1, le=1024)] | None = None

    # -- the job's code --------------------------------------------------------------------------
    bundle_path: Path
    #: The job's bundle, as the server stored it: the rank loads the file only if its bytes are these.
    bundle_sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
    #: True: the agent is still fetching it, and says ``ready`` on stdin once it is there.
    bundle_pending: bool
    #: Set: the agent writes the fetched bytes into ``bundle_path`` as they arrive, and the rank
    #: reads (and hashes) them as they grow, up to this size, instead of waiting for ``ready``
    #: first (it still waits for ``ready`` before it goes on: the datasets come before it).
    bundle_size: Annotated[int, Field(ge=1)] | None = None
    #: The job's datasets, one folder each, read-only (``data_loader_func``'s ``data_dir``, a
    #: script's ``$ZWDX_DATA_DIR``): there by ``ready``. None: the job names none.
    data_dir: Path | None = None

    # -- who speaks, to whom ---------------------------------------------------------------------
    #: When the job reached the GPU client (seconds since the epoch): the origin of the startup times.
    assigned_at: Seconds
    server: Annotated[str, StringConstraints(min_length=1, max_length=2048)]
    client_id: Id
    hostname: Text
    #: The rank's credential on every call it makes (``X-Zwdx-Rank-Key``).
    rank_key: SecretStr
    #: Seconds the rank's calls wait for a server that is away before they fail
    #: (``zwdx gpu-client --outage-tolerance``; ``gpu_client/outage.py``).
    outage_tolerance: Annotated[float, Field(gt=0, le=1e7)] = defaults.OUTAGE_TOLERANCE
    #: The CA file the server's certificate is verified against (a private CA, in the sandbox);
    #: None: the system's CAs.
    ca_file: Path | None = None
    #: The file the rank's output goes to (a standby process redirects itself there).
    log_path: Path | None = None
    #: Where the rank runs and as whom (``gpu_client.sandbox.rank_process.enter``); None: where it was started.
    sandbox: Sandbox | None = None

    # -- a script job (``gpu_client.rank.script``): what the runner does is chosen by ``job.kind`` ----
    #: This GPU client's ranks of the job, and its place among the job's GPU clients.
    local_world_size: Annotated[int, Field(ge=1, le=4096)] = 1
    group_rank: Count = 0
    group_world_size: Annotated[int, Field(ge=1, le=2**20)] = 1
    #: The GPUs of this client's ranks of the job, in local-rank order (a script's CUDA_VISIBLE_DEVICES).
    local_gpus: Annotated[list[Count], Field(max_length=4096)] = []
    #: A folder of this rank's own (the script's working dir is unpacked there), made by the rank.
    work_dir: Path | None = None

    @field_serializer("rank_key", when_used="json")
    def _reveal(self, secret: SecretStr) -> str:
        """The JSON line for the rank process carries the secret; ``repr`` and ``model_dump`` do not."""
        return secret.get_secret_value()

    def line(self) -> bytes:
        """The spec as one JSON line, for the rank process's stdin."""
        return self.model_dump_json().encode() + b"\n"

    @classmethod
    def read(cls, stream: IO[str]) -> RankSpec | None:
        """The spec from the next line of ``stream``; None at the end of input (nothing to run)."""
        line = stream.readline()
        if not line.strip():
            return None
        return cls.model_validate_json(line)

    def torch_environ(self) -> dict[str, str]:
        """The variables torch (and libraries built on it) read for a distributed rank."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}

    @property
    def own_rank(self) -> int:
        """The rank this process's key speaks for: a shadow's own (outside the world size), else
        ``rank``. A shadow's checkpointer restores as ``rank`` and writes nothing."""
        return self.rank if self.shadow is None else self.shadow

    # The job's options by the names the rank's code reads them: views of ``job``, not copies.
    @property
    def parallelism(self) -> Parallelism:
        return self.job.parallelism

    @property
    def kind(self) -> JobKind:
        return self.job.kind

    @property
    def script(self) -> Script | None:
        return self.job.script

    @property
    def diloco(self) -> Diloco | None:
        return self.job.diloco

    @property
    def pipeline(self) -> Pipeline | None:
        return self.job.pipeline

    @property
    def devices(self) -> Devices:
        return Devices.MIXED if self.job.mixed else Devices.SAME

    @property
    def global_batch(self) -> int | None:
        return self.job.mixed.global_batch if self.job.mixed else None

    @property
    def tp_plan(self) -> dict[str, TpStyle] | None:
        return self.job.tp.plan if self.job.tp else None

    @property
    def epochs(self) -> int | None:
        return self.job.training.epochs

    @property
    def checkpoint_every_epoch(self) -> bool:
        return self.job.recovery.checkpoint_every_epoch

    @property
    def max_restarts(self) -> int:
        return self.job.recovery.max_restarts

    @property
    def image(self) -> str | None:
        return self.job.resources.image

    @property
    def where(self) -> str:
        """This GPU client and its host, as messages to the submitter name them."""
        return f"gpu client {self.client_id} on host {self.hostname}"


#: The environment variable naming a rank process's channel: the file descriptor of a Unix
#: socket on which its GPU client sends the listening sockets its spec counts (``listeners``).
CHANNEL_ENV = "ZWDX_RANK_CHANNEL"

__all__ = ["RankSpec", "Sandbox", "CHANNEL_ENV"]
