"""What a job's record says by itself, read without writing: whether it is overdue, which
DILOCO places are open. Pure functions of the record and the time, so that the moves
(``model.Job``) and the scheduler ask the same questions the same way."""
from __future__ import annotations

from typing import Collection, Mapping

from ...protocol import ACTIVE, JobStatus, Parallelism, RankStatus
from ...protocol.job import Job as JobRecord
from ...protocol.report import StepCheck
from ..placement.shadows import IN_STEP

#: Seconds the other ranks of a failing job get to report their own failure after the first one.
FAILURE_GRACE = 2.0

#: Why a starting job with no rendezvous ``assign_timeout`` after its placement is overdue:
#: settling places it again (``Job.unplace``).
NO_RENDEZVOUS = "no rendezvous address came from rank 0's gpu client (the server that placed the job stopped)"


def overdue(r: JobRecord, now: float, offline: Collection[str], client_timeout: float,
            assign_timeout: float) -> str | None:
    """Why this active job should fail now, or None:
    - a rank raised, and every rank reported (or exited), or ``FAILURE_GRACE`` is over
      (``client_timeout`` once a rank reported a DDP/FSDP step check: every rank's account counts);
    - a rank lost its peers, none of the job's GPU clients is ``offline`` (else it waits
      for them to be declared lost, and is interrupted), and ``client_timeout`` passed or
      every rank exited;
    - it is starting and no GPU client was told where to meet ``assign_timeout`` after it
      was placed (the server that placed it stopped)."""
    if r.status not in ACTIVE:
        return None
    if r.failing_since is not None:
        # a step check stops every rank at once, and each one's account counts: they get longer
        grace = client_timeout if in_step(r) and any(f.check for f in r.failures.values()) else FAILURE_GRACE
        if all_heard(r, r.failures) or r.failing_since < now - grace:
            return r.failing_reason or "a rank failed"
        return None
    if r.suspect_since is not None:
        if any(p.client_id in offline for p in r.placement or []):
            return None
        if r.suspect_since < now - client_timeout - 1.0 or all_heard(r, {}):
            return r.suspect_reason or "a rank lost its peers and no GPU client was lost"
        return None
    if r.status == JobStatus.STARTING and r.master is None and (r.started_at or now) < now - assign_timeout:
        return NO_RENDEZVOUS
    return None


def start_overdue(r: JobRecord, now: float, start_timeout: float) -> str | None:
    """Why this starting job's placement should be given up, or None: it was placed
    ``start_timeout`` seconds ago (0: never), its GPU clients were told where to meet, and no
    rank reported running (a GPU client that takes jobs and never starts them, or one too
    slow to: the others' ranks wait in their rendezvous for its)."""
    if not start_timeout or r.status != JobStatus.STARTING or r.master is None or r.ranks or \
            r.failing_since is not None or r.suspect_since is not None or \
            (r.started_at or now) >= now - start_timeout:
        return None
    return f"no rank reported running within {start_timeout:g} s of its placement"


def all_heard(r: JobRecord, failures: Mapping[str, object]) -> bool:
    """Every rank of the attempt exited, or is in ``failures`` (a DDP/FSDP job's shadows too: they run
    in step with it)."""
    ranks = (r.world_size or 0) + (len(r.shadows) if in_step(r) else 0)
    return all(str(i) in failures or str(i) in r.exits for i in range(ranks))


def in_step(r: JobRecord) -> bool:
    """Whether the job's shadows run in step with its workers (DDP's and FSDP's step checks): a
    shadow lost, exited or failed is then like any rank's. DILOCO's run apart: the job goes on without one."""
    return bool(r.shadows) and r.spec.parallelism in IN_STEP


def step_verdict(r: JobRecord) -> tuple[StepCheck | None, str] | None:
    """DDP or FSDP with ``verify``, once the attempt settles: None if no rank reported a step check; else
    the check held by a strict majority of the attempt's ranks (workers and shadows; so a strict
    majority of those that reported one too: a lone rank's account never names anyone while the
    others still train), with what was said; or None and why none is believed (the accounts
    differ). Identical accounts: the same step, check (``what``: gradients or weights), bucket and
    ``named``."""
    held: dict[tuple[int, str, int, tuple[tuple[str, str], ...]], list[int]] = {}
    accounts: dict[tuple[int, str, int, tuple[tuple[str, str], ...]], StepCheck] = {}
    for rank, failure in r.failures.items():
        if failure.check is not None:
            check = failure.check
            said_by: tuple[int, str, int, tuple[tuple[str, str], ...]] = (
                check.step, check.what, check.bucket, tuple(sorted(check.named.items())))
            held.setdefault(said_by, []).append(int(rank))
            accounts[said_by] = check
    if not held:
        return None
    ranks = (r.world_size or 0) + len(r.shadows)
    said = "; ".join(f"rank(s) {', '.join(map(str, sorted(who)))}: step {accounts[key].step}, bucket "
                     f"{accounts[key].bucket}, naming {', '.join(sorted(accounts[key].named, key=int)) or 'nobody'}"
                     for key, who in sorted(held.items(), key=lambda kv: (-len(kv[1]), sorted(kv[1]))))
    key, who = max(held.items(), key=lambda kv: len(kv[1]))
    if 2 * len(who) > ranks:
        return accounts[key], said
    return None, f"the ranks' accounts of the step check differ, and none is a strict majority's of the " \
                 f"{ranks} ranks ({said}); nobody is named"


def wanting(record: JobRecord) -> list[int]:
    """DILOCO: the dropped ranks of a running job that a new worker may join in place of (none
    placed in their place since they were dropped)."""
    if record.spec.parallelism != Parallelism.DILOCO or record.status != JobStatus.RUNNING or \
            not any(s.status == RankStatus.RUNNING for s in record.ranks.values()) or \
            record.spec.diloco is None or record.spec.diloco.ranks_per_worker > 1:  # a worker of several ranks: its place stays empty
        return []  # (with no worker still training, none would send the joiner the global weights)
    return [int(rank) for rank, state in sorted(record.ranks.items(), key=lambda kv: int(kv[0]))
            if state.status == RankStatus.DROPPED and not rejoined(record, int(rank))]


def rejoined(record: JobRecord, rank: int) -> bool:
    """DILOCO: a worker was placed in dropped rank ``rank``'s place since it was dropped (its
    key is the joiner's now)."""
    join, state = record.joins.get(str(rank)), record.ranks.get(str(rank))
    return join is not None and state is not None and join.placed_at >= (state.ended_at or 0)
