"""What GPU clients and the server say to each other on the ``/gpu`` Socket.IO namespace.

    client -> server   register (Register -> RegisterAnswer), heartbeat (Heartbeat -> Ack),
                       ranks_exited (RanksExited -> Ack), unreachable (Unreachable -> Ack)
    server -> client   reserve_port (ReservePort -> PortOffer, a call to the rank-0 client),
                       job_assign (JobAssign), job_cancel (JobCancel)

The GPU client builds and reads these types; the server checks every payload with ``parse``
before a handler sees it, and answers a wrong one with ``Ack(ok=False, error=...)``.

Versions (``zwdx.protocol.base``): a GPU client connects with ``auth`` ``{"token", "protocol",
"zwdx"}``; a server of another protocol major refuses the connection, naming both versions and
which side to upgrade, and answers every register with its own. What a GPU client sends is
``Tolerant``: fields a newer client adds are ignored by an older server.

Credentials (``zwdx.protocol.tokens``): a GPU client connects with its room's donor token;
its first ``register`` is answered with a client secret, which every later ``register`` of that
client id must present; each ``JobAssign`` carries one rank key per rank it gives the client.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, StringConstraints, field_validator, model_validator

from .. import defaults
from .base import Answer, Bytes, ByValue, Count, Id, Name, RankKey, Seconds, Tolerant, no_controls
from .tokens import Secret
from .job import CheckpointEntry
from .spec import JobSpec, ModuleName
from .vocab import Isolation, SlotKind

Percent = Annotated[float, Field(ge=0, le=100)]
#: Bytes of memory a slot may claim: no machine's RAM is larger (a GPU's bound is tighter: ``Slot``).
Memory = Annotated[int, Field(ge=0, le=defaults.MAX_HOST_MEMORY)]
#: A short name a GPU client chose (versions, its machine's id): no control characters.
ShortName = Annotated[str, StringConstraints(max_length=64), AfterValidator(no_controls)]


class Terms(Tolerant):
    """The image and limits the ranks of a container-isolated slot run under (``--isolation
    docker``, ``gpu_client/sandbox/container.py``): what the donor set, shown on the dashboard and kept on
    each rank's state when it starts."""
    image: Name
    image_id: Name = ""
    allowed_images: Annotated[list[Name], Field(max_length=64)] = []
    user: Name = ""
    root_fs: Name = ""
    capabilities: Name = ""
    no_new_privileges: bool = True
    seccomp: Name = ""
    pids: Count
    memory_bytes: Bytes
    shm_bytes: Bytes = 0
    work_dir: Name = ""
    network: Name = ""


class Slot(Tolerant):
    """A GPU (or the CPU) a client offers, as it registers."""
    index: Count
    kind: Annotated[SlotKind, ByValue] = SlotKind.CUDA
    name: Name = ""
    memory_total: Memory = 0
    memory_free: Memory = 0
    utilization: Percent | None = None
    #: How job code on this slot is kept from the GPU client and other jobs (None: an older
    #: client, which did not say).
    isolation: Annotated[Isolation, ByValue] | None = None
    #: A container's image and limits (``isolation: docker``); None otherwise.
    terms: Terms | None = None

    @model_validator(mode="after")
    def _plausible(self) -> Slot:
        """What a slot claims is what a machine can have: no placement goes by a claim no
        hardware makes (one fake client claiming 5.9e20 bytes drew every job)."""
        if self.kind == SlotKind.CUDA and self.memory_total > defaults.MAX_GPU_MEMORY:
            raise ValueError(f"memory_total of a cuda slot must be at most {defaults.MAX_GPU_MEMORY} "
                             f"({defaults.MAX_GPU_MEMORY >> 30} GiB, more than any GPU has), got {self.memory_total}")
        if self.memory_free > self.memory_total:
            raise ValueError(f"memory_free must be at most memory_total ({self.memory_total}), got {self.memory_free}")
        return self


class SlotStats(Tolerant):
    """A slot's fresh figures, in every heartbeat."""
    index: Count
    memory_free: Memory = 0
    memory_total: Memory | None = None
    utilization: Percent | None = None

    @model_validator(mode="after")
    def _plausible(self) -> SlotStats:
        if self.memory_total is not None and self.memory_free > self.memory_total:
            raise ValueError(f"memory_free must be at most memory_total ({self.memory_total}), got {self.memory_free}")
        return self


class Running(Tolerant):
    """An attempt of a job whose ranks this client still runs."""
    job_id: Id
    attempt: Count = 0


class Link(Tolerant):
    """A GPU client's link to the server, as it measured it (``gpu_client/agent/link.py``): the
    shortest round trip of a few small requests, and the bytes per second of one timed transfer
    each way (a lower bound on a slow-starting link)."""
    rtt: Annotated[float, Field(ge=0, le=600)]
    up: Annotated[float, Field(ge=0, le=1e13)]
    down: Annotated[float, Field(ge=0, le=1e13)]
    #: When (the client's clock, seconds since the epoch).
    measured_at: Annotated[float, Field(ge=0)]


class Register(Tolerant):
    """The first thing a connected GPU client says (and again after every reconnect)."""
    client_id: Id
    hostname: Name = ""
    #: The machine (GPU clients of one machine share its RAM); None: a host of its own.
    host_id: Annotated[str, StringConstraints(min_length=1, max_length=64), AfterValidator(no_controls)] | None = None
    slots: Annotated[list[Slot], Field(max_length=256)] = []
    versions: Annotated[dict[ShortName, ShortName], Field(max_length=64)] = {}
    #: Top-level modules it can import (None: not told, so not checked).
    modules: Annotated[list[ModuleName], Field(max_length=defaults.MAX_CLIENT_MODULES)] | None = None
    advertise_addr: Annotated[str, StringConstraints(max_length=255), AfterValidator(no_controls)] | None = None
    #: The port on ``advertise_addr`` where it answers its peers' reachability probes (``Peer``);
    #: None: an older client, which is not probed.
    reach_port: Annotated[int, Field(ge=1, le=65535)] | None = None
    #: Its link to the server (None: not measured).
    link: Link | None = None
    running: Annotated[list[Running], Field(max_length=1024)] = []
    #: The secret the first ``register`` of this client id was answered with; None the first time.
    client_secret: Secret | None = None

    @field_validator("slots")
    @classmethod
    def _one_slot_per_index(cls, slots: list[Slot]) -> list[Slot]:
        indexes = [s.index for s in slots]
        if len(set(indexes)) != len(indexes):
            raise ValueError(f"each slot needs its own index, got {indexes}")
        return slots


class RegisterAnswer(Answer):
    ok: bool
    room_id: str | None = None
    heartbeat_interval: float | None = None
    #: Issued at the client id's first register, shown only here: keep it (file 0600) and send it
    #: with every later register of this id.
    client_secret: str | None = None
    error: str | None = None
    #: Why it was refused, for the agent: ``client_secret`` when the id is registered already
    #: and the secret sent is not its own (an agent that lost its secret registers under a new id).
    code: str | None = None
    #: The server's protocol (``zwdx.protocol.base.PROTOCOL``) and zwdx version (None: a server
    #: from before versions were exchanged, protocol 1.0).
    protocol: str | None = None
    zwdx: str | None = None


class Heartbeat(Tolerant):
    slots: Annotated[list[SlotStats], Field(max_length=256)] = []
    running: Annotated[list[Running], Field(max_length=1024)] = []


class Ack(Answer):
    """The answer to a heartbeat or a report: ok, or why not."""
    ok: bool
    error: str | None = None


class HeartbeatAnswer(Ack):
    """The answer to a heartbeat. ``heartbeat_interval``: beat at this interval from now on; sent
    when the server changes the pace it asks for (it stretches the interval as its GPU clients
    grow in number: ``HEARTBEAT_RATE``), absent otherwise."""
    heartbeat_interval: Annotated[float, Field(gt=0, le=3600)] | None = None


class RanksExited(Tolerant):
    """The client's rank processes of one attempt of a job are gone: rank -> exit code."""
    job_id: Id
    attempt: Count = 0
    exits: Annotated[dict[RankKey, Annotated[int, Field(ge=-255, le=255)]], Field(min_length=1, max_length=1024)]


class ReservePort(Answer):
    """Asked of the rank-0 client: a port for the job's rendezvous."""
    job_id: str


class PortOffer(Tolerant):
    """Its answer: where the other ranks reach rank 0."""
    addr: Annotated[str, StringConstraints(min_length=1, max_length=255)]
    port: Annotated[int, Field(ge=1, le=65535)]


class Peer(Answer):
    """Another GPU client of a DDP/FSDP job, where its reachability probe answers: each client
    of the job connects to every other's before its ranks start (``gpu_client/agent/reach.py``)."""
    client_id: str
    hostname: str = ""
    addr: str
    port: int


class Unreachable(Tolerant):
    """A GPU client of a DDP/FSDP job could not open TCP to these peers of it: the job fails at
    once (its ranks would wait for the collective timeout), naming the pairs, and the scheduler
    keeps the pairs apart (``zwdx/server/reach.py``)."""
    job_id: Id
    attempt: Count = 0
    #: peer client id -> what the connection said (timeout, no route to host, ...)
    peers: Annotated[dict[Id, Annotated[str, StringConstraints(max_length=300)]], Field(min_length=1, max_length=1024)]


class RankPlace(Answer):
    """One of the job's ranks that a client runs, on which of its slots, and its rank key: the
    rank's only credential, good for this rank of this attempt from this client while the job
    runs (the agent hands it to the rank process in its ``RankSpec``)."""
    rank: int
    gpu_index: int
    kind: SlotKind = SlotKind.CUDA
    key: str
    #: DILOCO with ``verify``: this rank is a shadow that runs worker ``shadow_of``'s rank again
    #: (``zwdx.verify``): its ``RankSpec.rank`` is that worker's, its key this rank's.
    shadow_of: int | None = None


class JobAssign(Answer):
    """Everything a GPU client needs to start its ranks of one attempt of a job: the job's
    ``spec`` as stored (``zwdx.protocol.spec``) and what the server decided for this attempt
    (placement, rendezvous, resolved timeouts), so the client derives nothing. The agent turns it
    into one ``RankSpec`` per rank (``zwdx.protocol.rank``)."""
    job_id: str
    attempt: int = 0
    spec: JobSpec
    ranks: list[RankPlace]
    world_size: int
    master_addr: str
    master_port: int
    backend: Literal["nccl", "gloo"]
    #: The checkpoint a resumed attempt goes on from (None: from the start).
    checkpoint: CheckpointEntry | None = None
    #: Seconds a collective waits: the spec's, else the server's ``COLLECTIVE_TIMEOUT``.
    collective_timeout: Annotated[float, Field(gt=0)]
    #: This client's place among the job's GPU clients (torchrun's node rank), and how many there are.
    group_rank: int = 0
    group_world_size: int = 1
    #: TP and FSDP+TP: the ranks of one TP group, resolved (the job's ranks on each GPU client).
    tp_size: int | None = None
    #: The job's GPU clients, rank 0's first, for the reachability probe (empty: none to probe,
    #: as for DILOCO, which syncs through the server).
    peers: list[Peer] = []
    #: DILOCO: the ranks join a running job in dropped workers' places (they start from the
    #: global weights another worker sends at its next round).
    joining: bool = False
    #: Where the server saw every GPU client of the placement connect from, and this one's own
    #: advertised address: where a rank in a container may reach its peers' rendezvous and
    #: collective ports (``zwdx/server/reach.py``, ``gpu_client/sandbox/container.py``).
    addresses: list[str] = []


class JobCancel(Answer):
    """Stop the ranks of this job (of this attempt only, when given)."""
    job_id: str
    attempt: int | None = None
    reason: str = ""


class Refresh(Answer):
    """A waiting job needs these modules, which this client did not list when it registered: look
    again (a package installed since), and register again if the list changed."""
    modules: list[str]
    reason: str = ""


__all__ = ["Slot", "SlotStats", "Running", "Link", "Register", "Peer", "Unreachable", "RegisterAnswer", "Heartbeat", "Ack",
           "HeartbeatAnswer", "RanksExited",
           "ReservePort", "PortOffer", "RankPlace", "JobAssign", "JobCancel", "Refresh", "Seconds"]
