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

/** The schedule's settings of a PIPELINE job: { schedule, stages, microbatches } (null otherwise). */
export function scheduleOf(job) {
  const spec = job.spec || {};
  if (spec.parallelism !== Parallelism.PIPELINE) return null;
  const told = Object.values(job.ranks || {}).find((s) => s.layout?.stage)?.layout.stage.of;
  const stages = told || job.world_size || spec.world_size || 0;
  if (!stages) return null;
  const settings = spec.pipeline || {};
  return {
    schedule: settings.schedule || PipelineSchedule.GPIPE,
    stages,
    microbatches: settings.microbatches || stages,
  };
}

/** The order one stage runs its micro-batches' forwards (F) and backwards (B) in. GPipe: every
 * forward, then every backward. 1F1B: as many forwards as stages after it plus one (fewer if the
 * micro-batches run out), then a backward and a forward in turn, then the backwards left. */
export function stageOps(schedule, stages, microbatches, stage) {
  const ops = [];
  const f = (mb) => ops.push({ kind: "F", mb });
  const b = (mb) => ops.push({ kind: "B", mb });
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

/** The schedule on a grid of unit time steps: every stage takes its next operation as soon as
 * what it needs is done (a forward needs the stage before's forward of that micro-batch; a
 * backward its own forward and the stage after's backward), one operation a step.
 * Returns { cells: [{ stage, t, kind, mb }], steps, idle } (idle: the share of empty cells). */
export function pipelineSchedule(schedule, stages, microbatches) {
  if (!(stages >= 1 && microbatches >= 1)) return { cells: [], steps: 0, idle: 0 };
  const queues = Array.from({ length: stages }, (_, s) => stageOps(schedule, stages, microbatches, s));
  const next = new Array(stages).fill(0);
  const done = new Map(); // "F2:1" -> the step after which it is done
  const finished = (kind, stage, mb, t) => {
    const at = done.get(`${kind}${stage}:${mb}`);
    return at !== undefined && at <= t;
  };
  const cells = [];
  const total = 2 * stages * microbatches;
  let t = 0;
  while (cells.length < total && t < 4 * total + 4) {
    const now = [];
    for (let s = 0; s < stages; s++) {
      const op = queues[s][next[s]];
      if (!op) continue;
      const ready =
        op.kind === "F"
          ? s === 0 || finished("F", s - 1, op.mb, t)
          : finished("F", s, op.mb, t) && (s === stages - 1 || finished("B", s + 1, op.mb, t));
      if (ready) now.push({ stage: s, t, kind: op.kind, mb: op.mb });
    }
    for (const c of now) {
      next[c.stage] += 1;
      done.set(`${c.kind}${c.stage}:${c.mb}`, t + 1);
      cells.push(c);
    }
    t += 1;
  }
  const steps = cells.reduce((m, c) => Math.max(m, c.t + 1), 0);
  return { cells, steps, idle: steps ? 1 - cells.length / (steps * stages) : 0 };
}
