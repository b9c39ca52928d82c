"""The submitter's client.

    from zwdx import ZWDX
    zwdx = ZWDX("http://localhost:4461")
    result = zwdx.submit_job(model=Net(), data_loader_func=..., train_func=..., run=zwdx_run)
    model = zwdx.get_trained_model(result.job_id, Net())   # later, in any process of this user

``room_token`` is always a submitter token of the room (``zs_...``, from ``zwdx room create``;
the room's donor token, ``zd_...``, is for GPU clients and opens nothing here). The submitter
tokens of the rooms this user created or submitted to are remembered per server URL
(``zwdx.credentials``), so a job id alone opens its job. ``zwdx.tokens`` manages a room's tokens
(``zwdx.room_tokens``).

    client.py       ZWDX: the connection, rooms, submitting and waiting
    settings.py     the settings objects a job is submitted with (strategies, Resources, Training, Run)
    submission.py   submit_job's arguments as one spec; the earlier keywords' adapter
    follow.py       the wait loop (held polls, outages, progress, trackers, logs) and Ctrl-C
    results.py      Result (typed, and a dict), and the calls that read a job
    compat.py       the earlier project's surface: positional arguments, parse_args, get_logger
"""
from .client import ZWDX
from .follow import log_line
from .results import Result, ResultStatus
from .settings import (DDP, FSDP, TP, Auto, Diloco, Mixed, Pipeline, Recovery, Resources, Run, TensorParallel,
                       Training)

__all__ = ["ZWDX", "Result", "ResultStatus", "log_line", "DDP", "FSDP", "TP", "TensorParallel", "Pipeline", "Diloco",
           "Mixed", "Auto", "Resources", "Recovery", "Training", "Run"]
