"""How a GPU client keeps job code away from itself and from other jobs: the job's folder
(``folder``), per-job users, process or container isolation, egress rules, compile caches."""
