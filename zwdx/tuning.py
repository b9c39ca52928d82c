"""How a GPU client tunes its ranks' start: five switches a donor may set, each defaulting to what
was measured fastest (``gpu_client/rank/rendezvous.py`` and ``standby.py`` say what each does and
what it cost; bench/README.md has the figures).

Declared here, beside the CLI that offers them, so that ``zwdx``'s parser builds without
``gpu_client`` (the server image has zwdx/ alone): ``add_arguments`` gives ``zwdx gpu-client`` its
flags, each defaulting to its ``ZWDX_*`` variable. The agent's config holds them
(``AgentConfig.tuning``); the launcher puts them into each rank process's environment
(``environ``), and the rank process reads them there once, at its start (``from_environ``). A rank
container gets ``ZWDX_STANDBY_WARMUP`` only (``container.PASSED``)."""
from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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

    @classmethod
    def from_arguments(cls, args: Any) -> Tuning:
        """The switches as ``add_arguments``'s flags parsed them."""
        return cls(eager_nccl=args.eager_nccl, nccl_connect=args.nccl_connect, warm_cuda=args.warm_cuda,
                   ddp_init_sync=args.ddp_init_sync, standby_warmup=tuple(args.standby_warmup.split(",")))

    def environ(self) -> dict[str, str]:
        """The variables that carry these switches to a rank process."""
        return {VARIABLES["eager_nccl"]: "1" if self.eager_nccl else "0",
                VARIABLES["nccl_connect"]: self.nccl_connect,
                VARIABLES["warm_cuda"]: "1" if self.warm_cuda else "0",
                VARIABLES["ddp_init_sync"]: "1" if self.ddp_init_sync else "0",
                VARIABLES["standby_warmup"]: ",".join(self.standby_warmup)}


#: The switches' defaults (what a rank started without any gets).
DEFAULT_TUNING = Tuning()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``zwdx gpu-client``'s flags for the switches, each defaulting to its ``ZWDX_*`` variable
    (read as the parser is made: the edge), else to what was measured fastest."""
    env = Tuning.from_environ()
    t = parser.add_argument_group("rank start", "how its ranks start (measure before changing: bench/README.md)")
    t.add_argument("--eager-nccl", action=argparse.BooleanOptionalAction, default=env.eager_nccl,
                   help="make NCCL's communicator as a rank joins (device_id), not at its first collective "
                        f"(default: ${VARIABLES['eager_nccl']}=1, else off)")
    t.add_argument("--nccl-connect", choices=("runtime", "init"), default=env.nccl_connect,
                   help="init: NCCL connects a rank's peers in an eager join (NCCL_RUNTIME_CONNECT=0) rather than at "
                        f"the first collective (default: ${VARIABLES['nccl_connect']}, else runtime)")
    t.add_argument("--warm-cuda", action=argparse.BooleanOptionalAction, default=env.warm_cuda,
                   help="make the cuBLAS and cuDNN handles while a rank joins "
                        f"(default: ${VARIABLES['warm_cuda']}=1, else off)")
    t.add_argument("--ddp-init-sync", action=argparse.BooleanOptionalAction, default=env.ddp_init_sync,
                   help="DDP checks the ranks' shapes and broadcasts rank 0's weights as it wraps "
                        f"(default: ${VARIABLES['ddp_init_sync']}=1, else off: every rank loads the same bundle)")
    t.add_argument("--standby-warmup", default=",".join(env.standby_warmup), metavar="PARTS",
                   help=f"what a standby rank process pays ahead, of {', '.join(WARMUPS)} (comma-separated; none: "
                        f"nothing) (default: ${VARIABLES['standby_warmup']}, else imports)")
