"""The donor side of zwdx: an agent that joins a room and runs ranks of jobs.

    agent      connect, register, heartbeat, receive jobs (the /gpu messages of zwdx.protocol.gpu)
    launcher   the rank processes: a standby per slot, each rank's RankSpec on its stdin
    runner     one process per rank: Trainer (setup: rendezvous, wrap; train; finish), report
    standby    a rank process started ahead: torch imported, first-use costs paid
    parallel   DDP / FSDP around the user's model, the optimizer rebuilt, the weights gathered
    checkpoint checkpoints of a job, written and read by its ranks
    failures   whether a rank's own code raised or it lost its peers; a package it lacks
    metrics    samples counted, the platform's metric series
    reporter   metrics, logs and results from a rank back to the server
    gpus       what this machine offers (pynvml), or one CPU slot
    host       which machine this is (GPU clients on one share its RAM), which modules it can import
"""
