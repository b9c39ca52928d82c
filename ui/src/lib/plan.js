// The plan of a job as the page draws it: which rank holds what (each rank's layout, as it
// reported it once its model was wrapped), grouped by GPU client; for a pipeline the stage
// order and the micro-batch schedule (which stage runs which micro-batch's forward or backward
// at each time step), computed here from the schedule, the micro-batches and the stages.
import { Parallelism, PipelineSchedule } from "./protocol.js";

/** The most stages and micro-batches a schedule diagram draws (beyond, it says so instead). */
export const MAX_DRAWN = { stages: 32, microbatches: 64 };

/** Each GPU client of the placement with its ranks in slot order, each with its layout (or null). */
export function planColumns(job) {
  const ranks = job.ranks || {};
  const clients = new Map();
  for (const p of job.placement || []) {
    if (!clients.has(p.client_id)) clients.set(p.client_id, { id: p.client_id, hostname: p.hostname, ranks: [] });
    clients.get(p.client_id).ranks.push({ ...p, layout: ranks[String(p.rank)]?.layout || null });
  }
  for (const c of clients.values()) c.ranks.sort((a, b) => a.gpu_index - b.gpu_index || a.rank - b.rank);
  return [...clients.values()];
}

/** A pipeline's stages in order, each with the rank that runs it and where (its GPU client's
 * host name, or its id where two clients share a host name): from the ranks' layouts, or rank i
 * as stage i while they have not said. */
export function stageOrder(job) {
  const placed = new Map((job.placement || []).map((p) => [p.rank, p]));
  const hosts = new Map((job.placement || []).map((p) => [p.client_id, p.hostname]));
  const byId = new Set(hosts.values()).size < hosts.size;
  const stages = [];
  for (let rank = 0; rank < (job.world_size || 0); rank++) {
    const layout = job.ranks?.[String(rank)]?.layout;
    const index = layout?.stage?.index ?? rank;
    const place = placed.get(rank);
    const client = (byId ? place?.client_id : place?.hostname || place?.client_id) || "";
    stages.push({ index, rank, layout: layout || null, client });
  }
  return stages.sort((a, b) => a.index - b.index);
}

/** The schedule's settings of a PIPELINE job: { schedule, stages, ranks, microbatches } (null
 * otherwise); stages: all of them, ranks x the stages each runs (interleaved: several). */
export function scheduleOf(job) {
  const spec = job.spec || {};
  if (spec.parallelism !== Parallelism.PIPELINE) return null;
  const settings = spec.strategy || {};
  const ranks = job.world_size || spec.resources?.world_size || 0;
  const told = Object.values(job.ranks || {}).find((s) => s.layout?.stage)?.layout.stage.of;
  const stages = told || ranks * (settings.stages_per_rank || 1);
  if (!stages || !ranks) return null;
  return {
    schedule: settings.schedule || PipelineSchedule.GPIPE,
    stages,
    ranks,
    microbatches: settings.microbatches || ranks,
  };
}

/** The order one stage runs its micro-batches' forwards (F) and backwards (B) in. GPipe: every
 * forward, then every backward. 1F1B: as many forwards as stages after it plus one (fewer if the
 * micro-batches run out), then a backward and a forward in turn, then the backwards left. */
export function stageOps(schedule, stages, microbatches, stage) {
  const ops = [];
  const f = (mb) => ops.push({ kind: "F", mb, stage });
  const b = (mb) => ops.push({ kind: "B", mb, stage });
  if (schedule === PipelineSchedule.ONE_F_ONE_B) {
    const warmup = Math.min(stages - stage, microbatches);
    for (let mb = 0; mb < warmup; mb++) f(mb);
    for (let mb = 0; mb < microbatches; mb++) {
      b(mb);
      if (mb + warmup < microbatches) f(mb + warmup);
    }
    return ops;
  }
  for (let mb = 0; mb < microbatches; mb++) f(mb);
  for (let mb = 0; mb < microbatches; mb++) b(mb);
  return ops;
}

/** The order one rank runs its stages' operations in with interleaved 1F1B (rank r runs stages
 * r, r + ranks, ...), as torch's ScheduleInterleaved1F1B orders them: the micro-batches go in
 * rounds of `ranks`; a warmup of forwards (a round per stage after its first, two more for each
 * rank after it), then a forward and a backward in turn, then the backwards left; forwards go
 * through the rank's stages first to last, backwards last to first, a round at a time. */
export function interleavedOps(rank, ranks, perRank, microbatches) {
  const rounds = Math.max(1, Math.floor(microbatches / ranks));
  const perRound = Math.floor(microbatches / rounds);
  const total = perRank * microbatches;
  const warmup = Math.min((perRank - 1) * perRound + 2 * (ranks - 1 - rank), total);
  const forwardStage = (op) => (Math.floor(op / perRound) % perRank) * ranks + rank;
  const backwardStage = (op) => (perRank - 1 - (Math.floor((op - warmup) / perRound) % perRank)) * ranks + rank;
  const nextF = new Map();
  const nextB = new Map();
  const take = (next, stage) => {
    const mb = next.get(stage) || 0;
    next.set(stage, mb + 1);
    return mb;
  };
  const ops = [];
  for (let op = 0; op < total + warmup; op++) {
    if (op < total) {
      const stage = forwardStage(op);
      ops.push({ kind: "F", stage, mb: take(nextF, stage) });
    }
    if (op >= warmup) {
      const stage = backwardStage(op);
      ops.push({ kind: "B", stage, mb: take(nextB, stage) });
    }
  }
  return ops;
}

/** The schedule on a grid of unit time steps, a row a rank: every rank takes its next operation
 * as soon as what it needs is done (a forward needs the stage before's forward of that
 * micro-batch; a backward its own forward and the stage after's backward), one operation a step.
 * `stages`: all of them; `ranks`: how many run them (fewer: interleaved, rank r runs stages r,
 * r + ranks, ...). Returns { cells: [{ rank, stage, t, kind, mb }], steps, idle } (idle: the
 * share of the ranks' steps without an operation: the bubble). */
export function pipelineSchedule(schedule, stages, microbatches, ranks = stages) {
  if (!(stages >= 1 && microbatches >= 1 && ranks >= 1) || stages % ranks) return { cells: [], steps: 0, idle: 0 };
  const interleaved = schedule === PipelineSchedule.INTERLEAVED_ONE_F_ONE_B && stages > ranks;
  const queues = Array.from({ length: ranks }, (_, r) =>
    interleaved ? interleavedOps(r, ranks, stages / ranks, microbatches)
      : stages === ranks ? stageOps(schedule, stages, microbatches, r) : [],
  );
  const next = new Array(ranks).fill(0);
  const done = new Map(); // "F2:1" -> the step after which it is done
  const finished = (kind, stage, mb, t) => {
    const at = done.get(`${kind}${stage}:${mb}`);
    return at !== undefined && at <= t;
  };
  const cells = [];
  const total = queues.reduce((n, q) => n + q.length, 0);
  let t = 0;
  while (cells.length < total && t < 4 * total + 4) {
    const now = [];
    for (let r = 0; r < ranks; r++) {
      const op = queues[r][next[r]];
      if (!op) continue;
      const s = op.stage;
      const ready =
        op.kind === "F"
          ? s === 0 || finished("F", s - 1, op.mb, t)
          : finished("F", s, op.mb, t) && (s === stages - 1 || finished("B", s + 1, op.mb, t));
      if (ready) now.push({ rank: r, stage: s, t, kind: op.kind, mb: op.mb });
    }
    for (const c of now) {
      next[c.rank] += 1;
      done.set(`${c.kind}${c.stage}:${c.mb}`, t + 1);
      cells.push(c);
    }
    t += 1;
  }
  const steps = cells.reduce((m, c) => Math.max(m, c.t + 1), 0);
  return { cells, steps, idle: steps ? 1 - cells.length / (steps * ranks) : 0 };
}
