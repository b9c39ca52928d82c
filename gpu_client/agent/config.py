"""What a GPU client is told at its start (``zwdx gpu-client``'s flags, each also settable by a
``ZWDX_*`` variable there: ``zwdx/cli_gpu.py`` is the edge that reads the environment): one frozen
``AgentConfig``, which ``Agent`` takes whole."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zwdx import defaults

from gpu_client.rank.tuning import Tuning


@dataclass(frozen=True)
class AgentConfig:
    server: str                                  # the server's URL
    room_token: str                              # the room's donor token (a legacy room token works too)
    gpus_only: list[int] | None = None           # --gpus: the GPU indices offered (None: all)
    cpu: bool = False                            # --cpu / --cpu-slots: CPU slots instead of GPUs
    cpu_slots: int = 1
    advertise_addr: str | None = None            # where its peers reach it (None: the interface to the server)
    client_id: str | None = None                 # None: the id an earlier start on this work dir took
    threads: int | None = None                   # torch threads per CPU rank
    work_dir: str | None = None                  # None: ~/.zwdx/gpu_client
    max_jobs: int | None = None                  # burst mode: stop after this many jobs
    standby: bool = True                         # a rank process kept ready per slot
    isolation: str | None = None                 # docker, user or process (None: the strongest that holds)
    rank_uids: range | None = None               # --isolation user: the uids of per-job users
    rank_dir: str | None = None                  # where each job's sandbox goes
    ca_file: str | None = None                   # a private CA that signed the server's certificate
    dataset_cache_bytes: int | None = None       # None: defaults.DATASET_CACHE_BYTES
    fetch_policy: Any = None                     # fetch.FetchPolicy: what a job's dataset URL may reach
    confinement: Any = None                      # container.Confinement: --isolation docker's limits
    compile_cache: str | None = None             # keep torch.compile's caches per room under this folder
    modules_refresh: float | None = None         # least seconds between two looks at what ranks can import
    outage_tolerance: float = defaults.OUTAGE_TOLERANCE  # how long its ranks wait for a server that is away
    tuning: Tuning = field(default_factory=Tuning)       # the switches of its ranks' start (rank/tuning.py)
