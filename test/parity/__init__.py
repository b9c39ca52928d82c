"""The parity suite: every mode trains what one process would (issue 30). zoo.py: the models;
harness.py: the reference in one process, the job, the comparison; test_parity*.py: the modes;
run.py: the same as a table, for a user's own platform."""
