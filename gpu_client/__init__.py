"""The donor side of zwdx: an agent that joins a room and runs ranks of jobs, one folder per
process that runs the code:

    agent/     the GPU client's own process: connect, register, heartbeat, receive jobs (the /gpu
               messages of zwdx.protocol.gpu), its work dir, datasets, the launcher of rank processes
    sandbox/   how job code is kept away from the agent and from other jobs: the job's folder,
               per-job users, containers, egress rules, compile caches
    rank/      one process per rank: runner (Trainer: rendezvous, wrap, train, finish), reporter,
               checkpoints, metrics, failures, script jobs, the standby warm-up
    rank/strategies/  DDP / FSDP (parallel), TP, PIPELINE, mixed devices, DILOCO, LoRA
    gpus       what this machine offers (pynvml), or one CPU slot (the agent's slots, a rank's metrics)
    outage     the HTTP session that waits out a server that is away (agent, sandbox and rank)
"""
