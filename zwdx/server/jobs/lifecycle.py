"""How a job moves after it is placed, apart from what its ranks report (``reports.py``):
clients vanish, placements do not start, users cancel, failing and suspect jobs settle.

Each function makes one move of ``model.Job`` (which writes it, once, however many servers or
threads race), says what must follow (``effects.Effects``: the GPU clients told ``job_cancel``,
slots freed, the dashboards and the scheduler woken) and has ``effects.apply`` do it. A job's
slots are freed only when the GPU client says its rank processes exited (or the client is
gone), so a rank's teardown is off the user's path and still no slot runs two jobs.
"""
from __future__ import annotations

import logging
import time
from typing import Collection

from ...protocol import ACTIVE, ClientStatus, EventKind, JobStatus, Parallelism, RankStatus
from ...protocol.job import Job as JobRecord, Suspect
from ...protocol.report import StepCheck
from .. import notify
from .effects import Ctx, Effects, Release, apply, stopping
from .model import Job
from .rules import NO_RENDEZVOUS, in_step, step_verdict

log = logging.getLogger(__name__)


def _ended(ctx: Ctx, handle: Job, reason: str) -> JobRecord:
    """The job stopped running (failed, cancelled, interrupted): stop its ranks, show it, and
    let the scheduler use its slots once they are free."""
    apply(ctx, Effects(stop=stopping(handle.record, reason), show=handle.record, kick=True))
    return handle.record


def fail(ctx: Ctx, job_id: str, reason: str) -> JobRecord | None:
    """Fail an active or waiting job and stop its ranks; None if it had ended already."""
    handle = Job.load(ctx.store, job_id)
    if handle is None or not handle.fail(reason):
        return None
    log.warning("job %s: failed: %s", job_id, reason)
    return _ended(ctx, handle, reason)


def cancel(ctx: Ctx, job_id: str, reason: str = "cancelled by the submitter") -> JobRecord | None:
    handle = Job.load(ctx.store, job_id)
    if handle is None or not handle.cancel(reason):
        return None
    log.info("job %s: cancelled", job_id)
    return _ended(ctx, handle, reason)


def interrupt(ctx: Ctx, job_id: str, reason: str) -> JobRecord | None:
    """A GPU client of the running job is gone: stop the other ranks and queue the job again
    as ``resuming`` (it goes on from its last checkpoint), or fail it after too many restarts."""
    handle = Job.load(ctx.store, job_id)
    moved = handle.interrupt(reason) if handle is not None else None
    if handle is None or moved is None:
        return None
    record = handle.record
    if moved == JobStatus.FAILED:
        log.warning("job %s: failed: %s", job_id, record.reason)
        return _ended(ctx, handle, record.reason or reason)
    ckpt = record.latest_checkpoint
    log.warning("job %s: interrupted (%s); resuming from %s", job_id, reason,
                f"checkpoint {ckpt.n} (epoch {ckpt.epoch})" if ckpt else "the start")
    return _ended(ctx, handle, f"job interrupted: {reason}")


def drop(ctx: Ctx, job: JobRecord, ranks: list[int], reason: str) -> bool:
    """A DILOCO job goes on without these workers (``Job.drop``); False when it cannot (it is no
    DILOCO job, or no other worker is left), and the caller does what it does for DDP and FSDP.
    True when there was nothing to drop (those ranks completed already)."""
    if job.spec.parallelism != Parallelism.DILOCO or job.status not in ACTIVE or job.spec.diloco is None:
        return False
    per = job.spec.diloco.ranks_per_worker  # a worker is all its ranks: one lost drops them all
    ranks = sorted({r - r % per + i for r in ranks for i in range(per)})
    ranks = [r for r in ranks if (state := job.ranks.get(str(r))) is None or state.status != RankStatus.COMPLETED]
    if not ranks:
        return True
    handle = Job(ctx.store, job)
    if not handle.drop(ranks, reason):
        return False
    log.warning("job %s: %s; rank(s) %s dropped, the other workers go on", job.id, reason, ranks)
    apply(ctx, Effects(show=handle.record, kick=True))
    return True


def shadows_gone(ctx: Ctx, job: JobRecord, ranks: list[int], why: str) -> list[int]:
    """DILOCO with ``verify``: those of ``ranks`` that are shadows (``zwdx.server.shadows``) are
    noted gone (``why``: failed, exited, their GPU client lost, named) and the job goes on as it
    was; the others (workers), returned. A DDP job's shadows run in step with it
    (``rules.in_step``): all of ``ranks`` are returned, each to be dealt with as any rank."""
    if in_step(job):
        return ranks
    ours = {r: s for r in ranks if (s := job.shadows.get(str(r))) is not None}
    fresh = {str(r): s.model_copy(update={"gone": why}) for r, s in ours.items()
             if s.gone is None and job.status in ACTIVE}  # a job that ended stops its shadows: nothing to say
    if fresh and (after := ctx.store.put_job_entries(job.id, "shadows", fresh)) is not None:
        now = time.time()
        texts = [f"diloco: shadow rank {r} (of rank {s.of}, gpu client {s.client_id}) is gone ({why}); the job goes "
                 f"on without it" for r, s in sorted(fresh.items(), key=lambda kv: int(kv[0]))]
        for text in texts:
            log.warning("job %s: %s", job.id, text)
        ctx.store.add_events(job.id, [{"kind": EventKind.LOG.value, "rank": None, "key": f"shadow-gone:{job.attempt}:{r}",
                                       "step": None, "data": {"text": text}, "ts": now}
                                      for r, text in zip(sorted(fresh, key=int), texts)])
        apply(ctx, Effects(show=after))
    return [r for r in ranks if r not in ours]


def ranks_exited(ctx: Ctx, client_id: str, job_id: str, exits: dict[str, int], attempt: int = 0) -> None:
    """A GPU client says its rank processes of this job (this attempt) are gone; free its slots.
    A DILOCO worker that died without a word is dropped, and the others go on."""
    handle = Job.load(ctx.store, job_id)
    if handle is None:
        return
    if handle.record.attempt != attempt:
        log.info("job %s: late exits of attempt %d from gpu-client %s ignored", job_id, attempt, client_id)
        return
    record = handle.record
    if record.shadows and not in_step(record):  # a DILOCO shadow's exit is noted; it makes the job neither
        # suspect nor short of a worker
        theirs = {r: c for r, c in exits.items() if str(r) in record.shadows}
        shadows_gone(ctx, record, [int(r) for r, c in theirs.items() if int(c) != 0],
                     f"its process exited ({', '.join(f'{r}: {c}' for r, c in theirs.items())})")
        exits = {r: c for r, c in exits.items() if r not in theirs}
    died = [int(rank) for rank, code in exits.items() if int(code) != 0 and str(rank) not in record.failures]
    if died and drop(ctx, record, died, f"rank process(es) {', '.join(map(str, died))} on gpu client {client_id} "
                                         f"exited ({', '.join(f'{r}: {exits[r]}' for r in exits)})"):
        handle.refresh()
    bad = handle.ranks_exited(exits)
    record = handle.record
    apply(ctx, Effects(release=(Release(job_id, client_id),), room=record.room_id, kick=True,
                       settle=bool(bad or record.failing_since or record.suspect_since)))


def not_started(ctx: Ctx, record: JobRecord, reason: str, clients: Collection[str]) -> JobRecord | None:
    """The job's placement did not start: its ranks are told to stop, its slots freed (a GPU
    client that never starts ranks never says they exited either), and it waits to be placed
    again on other GPU clients than ``clients``, or fails after ``START_TRIES`` such placements
    (``Job.not_started``). None if it moved on meanwhile."""
    handle = Job(ctx.store, record)
    moved = handle.not_started(reason, clients, ctx.settings.start_tries)
    if moved is None:
        return None
    log.warning("job %s: %s; %s", record.id, reason, "failed" if moved == JobStatus.FAILED else "placing it again")
    apply(ctx, Effects(stop=stopping(record, reason, record.attempt),  # the placement as it was
                       release=(Release(record.id),), show=handle.record, room=record.room_id, kick=True))
    return handle.record


def _start_overdue(ctx: Ctx, room_id: str | None) -> None:
    """Give up the placements of the room's starting jobs none of whose ranks reported running
    within ``START_TIMEOUT``."""
    timeout = ctx.settings.start_timeout
    if not timeout:
        return
    for record in ctx.store.list_jobs(room_id, statuses=[JobStatus.STARTING]):
        reason = Job(ctx.store, record).start_overdue(timeout)
        if reason is None:
            continue
        # Held against the GPU clients that never said they run it (a fake one, beside honest ones
        # whose ranks wait in the rendezvous for its); against all of them if each said so.
        held, mark = list(dict.fromkeys(p.client_id for p in record.placement or [])), f"{record.id}:{record.attempt}"
        silent = [c for c in held if mark not in ((ctx.store.get_client(c) or {}).get("running_jobs") or [])]
        why = f"gpu client(s) {', '.join(silent)} never said they run it" if silent else \
            f"each of gpu client(s) {', '.join(held)} said it runs it"
        not_started(ctx, record, f"{reason}; {why}", silent or held)


def settle_suspects(ctx: Ctx, room_id: str | None = None) -> None:
    """Fail the active jobs (of the room, when given) that are overdue (``Job.overdue``): their
    ranks raised and every rank reported, or their ranks lost their peers and no GPU client
    turned out lost."""
    assign_timeout = 2 * ctx.settings.reserve_timeout + 5.0
    for record in ctx.store.list_jobs(room_id, statuses=list(ACTIVE), unsettled=True):  # the others are not overdue
        handle = Job(ctx.store, record)
        offline: set[str] = set()
        if record.suspect_since is not None:
            offline = {p.client_id for p in record.placement or []
                       if (ctx.store.get_client(p.client_id) or {}).get("status") != ClientStatus.ONLINE.value}
        reason = handle.overdue(offline, ctx.settings.client_timeout, assign_timeout)
        if reason is not None and reason != NO_RENDEZVOUS and (verdict := step_verdict(record)) is not None:
            step_checked(ctx, record, *verdict)
        elif reason == NO_RENDEZVOUS and handle.unplace(f"placed again: {reason}"):
            log.warning("job %s: %s; placing it again", record.id, reason)
            apply(ctx, Effects(release=(Release(record.id),),  # no GPU client was told of it
                               show=handle.record, room=record.room_id, kick=True))
        elif reason is not None and fail(ctx, record.id, reason) and record.master is None:
            apply(ctx, Effects(release=(Release(record.id),)))  # no GPU client was told: none will say it exited
    _start_overdue(ctx, room_id)


def step_checked(ctx: Ctx, record: JobRecord, check: StepCheck | None, said: str) -> None:
    """A DDP job's attempt settled with step checks reported (``rules.step_verdict``): the ranks
    the believed one names (this attempt's, never another's) are suspects, their GPU clients not
    given the job again, and the job is placed again from its latest checkpoint (``interrupt``);
    none believed (``said`` why): it fails, nobody named."""
    if check is None:
        fail(ctx, record.id, said)
        return
    ranks = {p.rank for p in record.placement or []}
    where = f"step {check.step}, {check.where}"  # FSDP checks each rank's weight shard too: not a bucket
    named: dict[int, tuple[list[int], str]] = {
        int(r): ([], f"step check, {where}: {why}") for r, why in check.named.items() if int(r) in ranks}
    if named:
        name_suspects(ctx, record, named, dropped=False)
    who = f"rank(s) {', '.join(map(str, sorted(named)))} named" if named else "nobody named"
    interrupt(ctx, record.id, f"{_checks(record)}, {where}: the {check.what} disagreed, {who} ({said})")


def _checks(job: JobRecord) -> str:
    """What names a DDP or FSDP job's suspects in its log: "ddp step check", "fsdp step check"."""
    return f"{job.spec.parallelism.value.lower()} step check"


def name_suspects(ctx: Ctx, job: JobRecord, named: dict[int, tuple[list[int], str]], dropped: bool = True,
                  what: str | None = None) -> None:
    """These ranks are suspects (rank -> the rounds they were flagged in, why): kept in the job's
    ``suspects`` with their GPU client and its donor token, their clients not given the job
    again (``avoid``), said in the job's log (``what`` found them: by default the mode's check);
    DILOCO workers ``dropped`` (``zwdx.server.suspects``)."""
    store, now = ctx.store, time.time()
    job = store.get_job(job.id) or job  # the suspects named so far, whose entries stay
    clients = {p.rank: p.client_id for p in job.placement or []}
    clients.update({int(r): j.client_id for r, j in job.joins.items()})
    tokens = {r: (store.get_client(clients[r]) or {}).get("token_id") if clients.get(r) else None for r in named}
    entries = {job.suspect_key(r): Suspect(rank=r, attempt=job.attempt, client_id=clients.get(r), token_id=tokens[r],
                                           rounds=rounds, reason=reason, at=now)
               for r, (rounds, reason) in named.items()}
    if store.put_job_entries(job.id, "suspects", entries) is None:
        return
    avoid = sorted(set(job.avoid) | {e.client_id for e in entries.values() if e.client_id})
    store.set_job(job.id, {"avoid": avoid})
    what = what or (_checks(job) if in_step(job) else "diloco")
    texts = []
    for r, (rounds, reason) in sorted(named.items()):
        revoke = f"; `zwdx room tokens revoke {tokens[r]}` keeps its donor out of the room" if tokens[r] else ""
        when = f", in rounds {', '.join(map(str, rounds))} in a row" if len(rounds) > 1 else \
            f", in round {rounds[0]}" if rounds else ""
        texts.append(f"{what}: rank {r} (gpu client {clients.get(r)}) is a suspect: {reason}{when}; "
                     f"{'it is dropped and ' if dropped else ''}its client is not given this job again{revoke}")
        log.warning("job %s: %s", job.id, texts[-1])
    notify.events_added(job, store.add_events(job.id, [{
        "kind": EventKind.LOG.value, "rank": None, "key": f"{what.replace(' ', '-')}-suspect:{job.attempt}:{r}",
        "step": None, "data": {"text": text}, "ts": now} for r, text in zip(sorted(named), texts)]))
    fresh = store.get_job(job.id)
    if dropped and not drop(ctx, fresh, sorted(named), f"named a suspect ({'; '.join(r for _, r in named.values())})"):
        log.warning("job %s: the suspect(s) %s could not be dropped (no other worker left)", job.id, sorted(named))
    notify.job_changed(store.get_job(job.id))


def client_lost(ctx: Ctx, client_id: str, reason: str) -> None:
    """A GPU client disconnected or went silent for too long: its ranks are gone."""
    client = ctx.store.get_client(client_id)
    if client is None:
        return
    ctx.store.update_client(client_id, {"status": ClientStatus.OFFLINE.value, "sid": None, "lost_after": None,
                                        "lost_at": time.time()})
    log.warning("gpu-client %s: lost (%s)", client_id, reason)
    for job_id in {s["job_id"] for s in ctx.store.list_slots(client["room_id"], client_id) if s["job_id"]}:
        why = f"gpu client {client_id} ({client.get('hostname')}) lost: {reason}"
        job = ctx.store.get_job(job_id)
        ranks = [p.rank for p in (job.placement or []) if p.client_id == client_id] if job else []
        if job is not None and job.shadows and not in_step(job):
            workers = shadows_gone(ctx, job, ranks, why)
            if not workers:  # only shadows: the job goes on as it was
                apply(ctx, Effects(release=(Release(job_id, client_id),)))
                continue
            ranks = workers
        if job is None or not drop(ctx, job, ranks, why):
            interrupt(ctx, job_id, why)
        apply(ctx, Effects(release=(Release(job_id, client_id),)))
    apply(ctx, Effects(room=client["room_id"], joined_or_left=True, kick=True))
