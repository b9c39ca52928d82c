"""Every decision about a job the server makes, and what follows from it.

    rules.py      what the record says by itself (overdue? which DILOCO places are open?)
    model.py      ``Job``: the record's moves, each one guarded store write (rq's ``Job``)
    effects.py    ``Effects``: what a move asks of the world, and ``apply``, the one place doing it
    placing.py    what a job says while it waits, its assignment, a placement let go
    lifecycle.py  fail, cancel, interrupt, drop, exits, placements that did not start, settling
    reports.py    what ranks and registering GPU clients report

The HTTP and Socket.IO handlers parse and authorize, then call one function of this package.
"""
from __future__ import annotations

from .effects import Effects, Release, apply, tell_clients
from .lifecycle import cancel, client_lost, drop, fail, interrupt, name_suspects, not_started, ranks_exited, \
    settle_suspects, shadows_gone, step_checked
from .model import Job
from .placing import assign, let_go, placed, said, wait
from .reports import checkpoint_committed, forget_ranks_gone, job_line, not_wanted, outputs_uploaded, rank_completed, \
    rank_failed, rank_layout, rank_started, report
from .rules import FAILURE_GRACE, NO_RENDEZVOUS, in_step, rejoined, wanting

__all__ = ["Effects", "FAILURE_GRACE", "Job", "NO_RENDEZVOUS", "Release", "apply", "assign", "cancel",
           "checkpoint_committed", "client_lost", "drop", "fail", "forget_ranks_gone", "in_step", "interrupt", "job_line", "let_go", "name_suspects",
           "not_started",
           "not_wanted", "outputs_uploaded", "placed",
           "rank_completed", "rank_failed", "rank_layout", "rank_started", "ranks_exited", "rejoined", "report", "said",
           "settle_suspects", "shadows_gone", "step_checked", "tell_clients", "wait", "wanting"]
