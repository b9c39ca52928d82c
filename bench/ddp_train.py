"""The bare-torchrun side of the overhead benchmark: a plain DDP (or FSDP2, or TP) script running bench/workload.py.

    python -m torch.distributed.run --standalone --nproc_per_node=N bench/ddp_train.py \\
        --config '{"model": "cnn", ...}' --result /tmp/result.json

It does what the zwdx runner does around the same ``train``, and nothing else: NCCL (gloo on
CPU), DDP over the device (or, with ``"parallelism": "FSDP"`` in the config, FSDP2's
``fully_shard`` on each transformer block and then the root, with parameters in fp32 and
bf16 autocast in ``train``: the units and precision zwdx chooses for these models; or with
``"parallelism": "TP"`` the TP plan zwdx derives, applied by zwdx's own ``split``), the same
optimizer, and rank 0 saving the trained weights (as safetensors, gathered whole, as zwdx's
rank 0 gathers and uploads them). Rank 0 writes the figures as JSON.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # gpu_client, zwdx (TP)
import workload  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="workload config as JSON (see workload.config)")
    parser.add_argument("--result", required=True, help="rank 0 writes its figures here")
    args = parser.parse_args()
    cfg = json.loads(args.config)
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cuda = cfg["device_type"] == "cuda"
    device = torch.device(f"cuda:{local}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300),
                            **({"device_id": device} if cuda else {}))
    try:
        model, _ = workload.build(cfg)
        tp = cfg.get("parallelism", "DDP") == "TP"
        if cfg.get("parallelism", "DDP") == "FSDP":
            ddp = shard(model.to(device), device)
        elif tp:
            ddp = tensor_split(model.to(device), device)
        else:
            ddp = DistributedDataParallel(model.to(device), device_ids=[local] if cuda else None)
        optimizer = workload.optimizer(ddp.parameters(), cfg)
        data_loader, train = workload.functions(cfg)
        loader = data_loader(0, 1, device) if tp else data_loader(rank, world, device)  # a TP group: one replica
        result = train(ddp, loader, optimizer, rank, world, device)
        state = whole_state(ddp)  # every rank takes part (FSDP gathers the shards)
        if rank == 0:
            from safetensors.torch import save_file
            fd, path = tempfile.mkstemp(suffix=".safetensors")
            os.close(fd)
            save_file(state, path)
            os.unlink(path)
        dist.barrier()
        if rank == 0:
            result["ended_at"] = time.time()
            with open(args.result, "w") as fh:
                json.dump(result, fh)
    finally:
        dist.destroy_process_group()
    return 0


def shard(model, device):
    """FSDP2: each transformer block its own unit, then the root (none but the root for the cnn)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in [m for m in model.modules() if isinstance(m, workload.Block)]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def tensor_split(model, device):
    """TP over every rank: the plan zwdx derives (each block's MLP pair; the fused q/k/v stays
    whole), applied as zwdx's ranks apply it (``gpu_client.rank.strategies.tensor_parallel.split``)."""
    from torch.distributed.device_mesh import init_device_mesh

    from gpu_client.rank.strategies.tensor_parallel import split
    from zwdx import tp_plan
    split(model, init_device_mesh(device.type, (dist.get_world_size(),)), tp_plan.derive(model)[0])
    return model


def whole_state(model) -> dict:
    """The trained weights on CPU, whole (cloned as zwdx's runner does: a tied weight is saved twice)."""
    if isinstance(model, DistributedDataParallel):
        state = model.module.state_dict()
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}


if __name__ == "__main__":
    sys.exit(main())
