"""One rank of one job, in its own process: ``runner`` (python -m gpu_client.rank.runner) and
what it uses: rendezvous, reporter, checkpoints, metrics, failures, script jobs."""
