"""One rank of one job, in its own process: ``runner`` (started by gpu_client.sandbox.rank_process) and
what it uses: rendezvous, reporter, checkpoints, metrics, failures, script jobs."""
