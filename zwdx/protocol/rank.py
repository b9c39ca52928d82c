"""What a GPU client's agent hands each rank process it starts: one ``RankSpec``, once.

The agent writes it as one JSON line on the rank process's stdin, to a standby process (started
ahead, torch imported) and to a fresh one alike; when the job's bundle is still being fetched
(``bundle_pending``) a second line, ``ready``, follows once it is on disk (end of input: it could
not be fetched). Nothing else travels: no ``ZWDX_*`` environment variables. The environment keeps
only what libraries read themselves (``OMP_NUM_THREADS``, ``GLOO_SOCKET_IFNAME`` /
``NCCL_SOCKET_IFNAME``, ``PYTHONUNBUFFERED``); the rank process sets torch's ``RANK``,
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
"""
from __future__ import annotations

from typing import IO, Annotated, Literal

from pydantic import Field, SecretStr, StringConstraints, field_serializer

from .base import ByValue, Count, Id, Message, Seconds, Text
from .job import CheckpointEntry
from .vocab import Parallelism

#: Where a rank's tensors live: the CPU, or one GPU of this machine.
Device = Annotated[str, StringConstraints(pattern=r"^(cpu|cuda:[0-9]{1,3})$")]
Path = Annotated[str, StringConstraints(min_length=1, max_length=4096)]


class RankSpec(Message):
    """Everything one rank process needs to run its rank of one attempt of a job."""

    # -- which rank of which job -----------------------------------------------------------------
    job_id: Id
    attempt: Count
    rank: Count
    #: Its index among this GPU client's ranks of the job.
    local_rank: Count
    world_size: Annotated[int, Field(ge=1, le=2**20)]

    # -- how the ranks meet and train ------------------------------------------------------------
    master_addr: Annotated[str, StringConstraints(min_length=1, max_length=255)]
    master_port: Annotated[int, Field(ge=1, le=65535)]
    #: The addresses of the job's GPU clients (``JobAssign.peers``).
    peers: Annotated[list[Annotated[str, StringConstraints(max_length=255)]], Field(max_length=4096)] = []
    backend: Literal["nccl", "gloo"]
    device: Device
    parallelism: Annotated[Parallelism, ByValue]
    #: As submitted; None: the train function's own default (1 if it declares none).
    epochs: Annotated[int, Field(ge=1)] | None
    #: Seconds a collective may wait for its peers.
    collective_timeout: Annotated[float, Field(gt=0, le=1e7)]
    #: The checkpoint to go on from (a resumed attempt), or None.
    checkpoint: CheckpointEntry | None
    checkpoint_every_epoch: bool
    #: torch threads of this rank.
    threads: Annotated[int, Field(ge=1, le=4096)]

    # -- the job's code --------------------------------------------------------------------------
    bundle_path: Path
    #: True: the agent is still fetching it, and says ``ready`` on stdin once it is there.
    bundle_pending: bool

    # -- who speaks, to whom ---------------------------------------------------------------------
    #: When the job reached the GPU client (seconds since the epoch): the origin of the startup times.
    assigned_at: Seconds
    server: Annotated[str, StringConstraints(min_length=1, max_length=2048)]
    client_id: Id
    hostname: Text
    #: The rank's credential on every call it makes (``X-Zwdx-Rank-Key``).
    rank_key: SecretStr
    #: The file the rank's output goes to (a standby process redirects itself there).
    log_path: Path | None = None

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
    def where(self) -> str:
        """This GPU client and its host, as messages to the submitter name them."""
        return f"gpu client {self.client_id} on host {self.hostname}"


__all__ = ["RankSpec"]
