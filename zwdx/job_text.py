"""A job and a room as text, for a terminal (``zwdx jobs show``, ``zwdx room ...``): the
renderers ``jobs_cli`` prints, each a function of the server's documents."""
from __future__ import annotations

import math

from . import sizes
from .protocol.job import suspect_rank
from .protocol.spec import nest


def ago(ts: float | None, now: float) -> str:
    if not ts:
        return "-"
    s = max(0.0, now - ts)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.0f}{unit} ago"
    return f"{s:.0f}s ago"


def gib(n) -> str:
    """A size in the unit that reads best (``12.0 KiB``, ``3.2 GiB``): a small quota is not ``0.0 GiB``."""
    return sizes.human(n) if isinstance(n, (int, float)) and n else "-"


def number(v) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.6g}"
    return "-" if v is None else str(v)


#: How a slot keeps job code (``Isolation``'s values), in the dashboard's words.
ISOLATION_WORDS = {"docker": "container", "user": "per-job user", "process": "same user"}


def terms_line(terms: dict) -> str:
    """A container's image and limits (``protocol.gpu.Terms``) on one line."""
    return (f"image {terms.get('image')} ({terms.get('image_id') or '?'}), {terms.get('user')}, root "
            f"{terms.get('root_fs')}, capabilities {terms.get('capabilities')}, "
            f"{'no-new-privileges, ' if terms.get('no_new_privileges') else ''}seccomp {terms.get('seccomp')}, "
            f"memory {gib(terms.get('memory_bytes'))}, pids {terms.get('pids')}, /dev/shm "
            f"{gib(terms.get('shm_bytes'))}, work dir {terms.get('work_dir')}; network: {terms.get('network')}")


def facts(job: dict, spec: dict, now: float) -> list[tuple[str, object]]:
    """What the job is and where it stands: the first rows of ``zwdx jobs show``."""
    fields: list[tuple[str, object]] = [
        ("id", job["id"]), ("name", job.get("name") or ""), ("status", job["status"]),
        ("parallelism", spec.get("parallelism")), ("world size", job.get("world_size") or "-"),
        ("attempt", f"{job.get('attempt', 0)} ({job.get('restarts', 0)} restart(s))"),
        ("submitted", ago(job.get("created_at"), now)), ("started", ago(job.get("started_at"), now)),
        ("ended", ago(job.get("ended_at"), now)), ("final loss", number(job.get("final_loss")))]
    if spec.get("datasets"):
        fields.append(("datasets", ", ".join(f"{d['name']} ({d['url'] if d.get('url') else d['version'][:12]})"
                                             for d in spec["datasets"])))
    strategy = spec.get("strategy") or {}
    if strategy.get("type") == "mixed":
        placed = [e.get("reason") for e in job.get("timeline") or [] if e.get("status") == "starting"]
        fields.append(("devices", f"mixed, global batch {strategy.get('global_batch') or 'from data_loader_func'}"
                                  + (f" ({placed[-1]})" if placed and placed[-1] else "")))
    return fields


def notes(job: dict) -> list[tuple[str, object]]:
    """What AUTO chose, why it waits or ended, its warnings and its results."""
    fields: list[tuple[str, object]] = []
    if job.get("auto"):  # parallelism="AUTO": the mode chosen as it was placed, and why
        fields.append(("AUTO chose", job["auto"]["reason"]))
    if job.get("waiting_reason"):
        fields.append(("waiting because", job["waiting_reason"]))
    if job.get("reason"):
        fields.append(("reason", job["reason"]))
    fields += [("WARNING", warning) for warning in job.get("warnings") or []]
    fields += [(f"result: {name}", number(value)) for name, value in (job.get("results") or {}).items()]
    return fields


def suspect_lines(job: dict) -> list[str]:
    """Each suspect rank, when and why it was named."""
    lines = []
    named = sorted(((suspect.get("attempt", 0), suspect_rank(key, suspect), suspect)
                    for key, suspect in (job.get("suspects") or {}).items()), key=lambda t: t[:2])
    for attempt, rank, suspect in named:
        rounds = suspect.get("rounds") or []  # none: named at the end, by its final weights
        when = f"rounds {', '.join(map(str, rounds))}" if rounds else "at the end"
        when += f", attempt {attempt}" if attempt else ""
        lines.append(f"SUSPECT: rank {rank} (gpu client {suspect.get('client_id') or '?'}), {when}: "
                     f"{suspect.get('reason')}{'; dropped from the job' if rounds else ''}")
    return lines


def shadow_lines(job: dict) -> list[str]:
    """DILOCO's spot checks: each shadow, the worker it runs again and what the comparisons found.
    DDP's step checks: each shadow and its worker (a disagreement stops the attempt: the suspects
    and the restarts say what was found)."""
    lines = []
    ddp = ((job.get("spec") or {}).get("strategy") or {}).get("type") == "ddp"
    for rank, shadow in sorted((job.get("shadows") or {}).items(), key=lambda kv: int(kv[0])):
        agreed, disagreed = shadow.get("agreed") or [], sorted(shadow.get("disagreed") or {}, key=int)
        found = "its gradients checked against the worker's at every step" if ddp else \
            f"agreed in {len(agreed)} round(s)" + (f", disagreed in round(s) {', '.join(disagreed)}" if disagreed else "")
        gone = f"; gone: {shadow['gone']}" if shadow.get("gone") else ""
        lines.append(f"SHADOW: rank {rank} runs rank {shadow.get('of')} again (gpu client "
                     f"{shadow.get('client_id') or '?'}): {found}{gone}")
    return lines


def plan_lines(job: dict) -> list[str]:
    """The job's plan as text (what the job page draws): each rank's layout, as it reported it
    once its model was wrapped, and for a pipeline the stage order and its schedule."""
    ranks, where = job.get("ranks") or {}, {p["rank"]: p for p in job.get("placement") or []}
    said = sorted(((int(rank), state["layout"]) for rank, state in ranks.items() if state.get("layout")))
    if not said:
        return []
    lines = ["", "plan:", *(layout_line(rank, layout, where.get(rank) or {}) for rank, layout in said)]
    stages = sorted((layout["stage"]["index"], rank) for rank, layout in said if layout.get("stage"))
    if stages:
        settings = nest(job.get("spec") or {}).get("strategy") or {}
        count = said[0][1]["stage"]["of"] if said[0][1].get("stage") else len(stages)
        lines.append("  stages: " + " -> ".join(f"{index} (rank {rank})" for index, rank in stages)
                     + f"; schedule {settings.get('schedule', 'gpipe')}, "
                       f"{settings.get('microbatches') or count} micro-batches a batch")
    return lines


def layout_line(rank: int, layout: dict, place: dict) -> str:
    params = f", {layout['params']:,} params" if isinstance(layout.get("params"), int) else ""
    return (f"  rank {rank} on {place.get('hostname') or place.get('client_id') or '?'} "
            f"({layout.get('device') or 'slot ' + str(place.get('gpu_index', '?'))}), {layout['role']}: "
            f"{layout['text']}{params}")


def placement_rows(job: dict, batch: dict | None) -> tuple[list[list], list[str]]:
    """The ranks' table: rows and headers (a mixed-devices job's with each rank's batch)."""
    ranks = job.get("ranks") or {}
    rows = []
    for p in job.get("placement") or []:
        state = ranks.get(str(p["rank"]), {})
        rows.append([p["rank"], p.get("hostname") or "", p["client_id"], p.get("gpu_index"), p.get("gpu_name") or "",
                     state.get("status", "-"), ISOLATION_WORDS.get(state.get("isolation"), "-"),
                     *([batch.get(p["rank"], "-")] if batch is not None else [])])
    return rows, ["RANK", "HOST", "GPU CLIENT", "SLOT", "GPU", "STATUS", "ISOLATION",
                  *(["BATCH"] if batch is not None else [])]
