"""A torchrun script that runs until a GPU client is lost, then, restarted (as torchrun restarts its
workers), says which restart it is and ends; rank 0 leaves that in $ZWDX_OUTPUT_DIR."""
import os
import time

import torch.distributed as dist

dist.init_process_group("gloo")
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"rank {dist.get_rank()} restart {restart} world {dist.get_world_size()} "
      f"max restarts {os.environ['TORCHELASTIC_MAX_RESTARTS']}", flush=True)
if restart == 0:
    while True:  # until a peer is lost: the collective fails and so does this script
        dist.barrier()
        time.sleep(0.2)
if dist.get_rank() == 0:
    with open(os.path.join(os.environ["ZWDX_OUTPUT_DIR"], "restart.txt"), "w") as fh:
        fh.write(f"{restart}\n")
dist.destroy_process_group()
