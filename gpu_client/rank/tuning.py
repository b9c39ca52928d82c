"""How a GPU client tunes its ranks' start: five switches a donor may set, each defaulting to what
was measured fastest (``rendezvous.py`` and ``standby.py`` say what each does and what it cost).

The agent's config holds them (``AgentConfig.tuning``), set by ``zwdx gpu-client`` flags or by
their ``ZWDX_*`` variables (``from_environ``: the edge); the launcher puts them into each rank
process's environment (``environ``), and the rank process reads them there once, at its start
(``gpu_client.sandbox.rank_process``), and hands them down. A rank container gets
``ZWDX_STANDBY_WARMUP`` only (``container.PASSED``)."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

#: Each field's variable.
VARIABLES = {"eager_nccl": "ZWDX_EAGER_NCCL", "nccl_connect": "ZWDX_NCCL_CONNECT", "warm_cuda": "ZWDX_WARM_CUDA",
             "ddp_init_sync": "ZWDX_DDP_INIT_SYNC", "standby_warmup": "ZWDX_STANDBY_WARMUP"}
#: ``standby_warmup``'s parts (``standby.warm_up``); ``none`` (or any other word) skips them.
WARMUPS = ("imports", "kernels", "nccl")


@dataclass(frozen=True)
class Tuning:
    eager_nccl: bool = False        # NCCL's communicator made in the join (device_id), not at the first collective
    nccl_connect: str = "runtime"   # "init": NCCL_RUNTIME_CONNECT=0, peers connected in the eager join
    warm_cuda: bool = False         # cuBLAS/cuDNN handles made while the rank joins
    ddp_init_sync: bool = False     # DDP checks the ranks' shapes and broadcasts rank 0's weights as it wraps
    standby_warmup: tuple[str, ...] = ("imports",)  # what a standby pays ahead (WARMUPS)

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> Tuning:
        """The switches as the ``ZWDX_*`` variables of ``env`` (this process's) set them."""
        env = os.environ if env is None else env

        def switch(field: str, default: str) -> str:
            return (env.get(VARIABLES[field]) or default).strip().lower()
        return cls(eager_nccl=switch("eager_nccl", "0") == "1",
                   nccl_connect="init" if switch("nccl_connect", "runtime") == "init" else "runtime",
                   warm_cuda=switch("warm_cuda", "0") == "1",
                   ddp_init_sync=switch("ddp_init_sync", "0") == "1",
                   standby_warmup=tuple(env.get(VARIABLES["standby_warmup"], "imports").split(",")))

    def environ(self) -> dict[str, str]:
        """The variables that carry these switches to a rank process."""
        return {VARIABLES["eager_nccl"]: "1" if self.eager_nccl else "0",
                VARIABLES["nccl_connect"]: self.nccl_connect,
                VARIABLES["warm_cuda"]: "1" if self.warm_cuda else "0",
                VARIABLES["ddp_init_sync"]: "1" if self.ddp_init_sync else "0",
                VARIABLES["standby_warmup"]: ",".join(self.standby_warmup)}


#: The switches' defaults (what a rank started without any gets).
DEFAULT_TUNING = Tuning()
