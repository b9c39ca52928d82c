"""A torchrun script whose rank 1 raises: the job fails with its traceback."""
import torch.distributed as dist

dist.init_process_group("gloo")
print(f"rank {dist.get_rank()} up", flush=True)
if dist.get_rank() == 1:
    raise ValueError("boom on rank 1")
dist.barrier()  # rank 0 waits for rank 1, which is gone
