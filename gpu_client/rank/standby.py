"""A rank process started ahead of its job, while its slot is idle.

``python -m gpu_client.sandbox.rank_process --standby DEVICE`` imports torch and what DDP and FSDP need, makes
the GPU's CUDA context and pays other first-use costs (``warm_up``), then waits for its
``RankSpec`` on stdin and runs that rank as a fresh rank process would. Saves seconds of every
job's start.
"""
from __future__ import annotations

import logging

log = logging.getLogger("gpu_client.rank.standby")

#: The line a standby writes to its slot's log once it waits for a rank (bench/overhead.py waits for it).
READY = "standby rank process ready"


def prepare(device: str, warmup: tuple[str, ...] = ("imports",)) -> None:
    """Everything a rank's first seconds would pay that does not depend on its job. ``warmup``:
    the optional parts (``Tuning.standby_warmup``, ``ZWDX_STANDBY_WARMUP``; see ``warm_up``); "none" skips them."""
    import time
    started = time.time()
    import torch
    import torch.distributed  # noqa: F401
    import torch.nn.parallel  # noqa: F401
    from torch.distributed.fsdp import fully_shard  # noqa: F401

    from . import checkpoint  # noqa: F401
    from gpu_client.rank.strategies import parallel  # noqa: F401
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        torch.empty(1, device=device)
    warm_up(torch.device(device), set(warmup))
    print(f"{READY} on {device} after {time.time() - started:.1f} s", flush=True)  # into the slot's standby log


def warm_up(device, parts: set[str]) -> None:
    """Pay while the slot is idle what a job's first seconds would otherwise pay. ``imports``:
    the modules DDP imports when it first wraps a model (torch._dynamo, about a second), and
    those of FSDP's checkpoints (torch.distributed.checkpoint's state dicts, which read every
    installed package's entry points as they load).
    Off by default, as they cost steady-state throughput on 2 x H200 (bench/README.md): ``kernels``
    (GPUs), the cuBLAS and cuDNN handles by a tiny bf16 forward and backward, 2.6%; ``nccl``,
    NCCL's one-time set-up by a DDP step in a process group of this process alone, measured
    only with ``kernels``: 2.8% together. Why a handle made early costs later is not known."""
    import torch
    import torch.distributed as dist
    cuda = device.type == "cuda"
    try:
        if "imports" in parts:
            import torch._dynamo  # noqa: F401
            import torch.distributed.checkpoint.state_dict  # noqa: F401  (FSDP's checkpoints: checkpoint.py)
        if "kernels" in parts and cuda:
            model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 14 * 14, 8))
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                model.to(device)(torch.randn(2, 3, 16, 16, device=device)).float().sum().backward()
            torch.cuda.synchronize(device)
        if "nccl" in parts:
            dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                                    **({"device_id": device} if cuda else {}))
            model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8).to(device),
                                                              device_ids=[device.index] if cuda else None)
            model(torch.randn(2, 8, device=device)).sum().backward()
    except Exception:  # a warm-up that fails only costs the job its first seconds
        log.warning("standby warm-up on %s failed", device, exc_info=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
