"""The bare-torchrun side of the overhead benchmark: a plain DDP script running bench/workload.py.

    python -m torch.distributed.run --standalone --nproc_per_node=N bench/ddp_train.py \\
        --config '{"model": "cnn", ...}' --result /tmp/result.json

It does what the zwdx runner does around the same ``train``, and nothing else: NCCL (gloo on
CPU), DDP over the device, the same optimizer, and rank 0 saving the trained weights (as
safetensors, as zwdx's rank 0 gathers and uploads them). Rank 0 writes the figures as JSON.
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
        ddp = DistributedDataParallel(model.to(device), device_ids=[local] if cuda else None)
        optimizer = workload.optimizer(ddp.parameters(), cfg)
        data_loader, train = workload.functions(cfg)
        loader = data_loader(rank, world, device)
        result = train(ddp, loader, optimizer, rank, world, device)
        if rank == 0:
            from safetensors.torch import save_file
            # cloned as zwdx's runner does (a tied weight is saved twice)
            state = {k: v.detach().cpu().contiguous().clone() for k, v in ddp.module.state_dict().items()}
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


if __name__ == "__main__":
    sys.exit(main())
