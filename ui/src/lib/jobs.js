// Jobs as the dashboard sees them: which are finished, the queue, merging live updates, history.

import { FINISHED, JobKind, WAITING } from "./protocol.js";

export { FINISHED, WAITING };

export const isFinished = (job) => FINISHED.includes(job?.status);

/**
 * Which of two copies of a job is newer. Every status change appends to the timeline, so the
 * copy with the longer timeline wins; on a tie the incoming copy (fresher) wins, but a
 * queue_position only the REST answer carries is kept.
 */
export function mergeJob(existing, incoming) {
  if (!existing) return incoming;
  const a = existing.timeline?.length || 0;
  const b = incoming.timeline?.length || 0;
  if (b < a) return existing;
  const merged = { ...existing, ...incoming };
  if (!WAITING.includes(incoming.status)) delete merged.queue_position;
  return merged;
}

/** Jobs in submission order (the store's seq, then creation time). */
export function bySubmission(jobs) {
  return [...jobs].sort((x, y) => (x.seq ?? 0) - (y.seq ?? 0) || (x.created_at ?? 0) - (y.created_at ?? 0));
}

/** Unfinished jobs in submission order; waiting ones get their 1-based place in the queue. */
export function queueOf(jobs) {
  let position = 0;
  return bySubmission(jobs)
    .filter((j) => !isFinished(j))
    .map((j) => ({ ...j, position: WAITING.includes(j.status) ? ++position : null }));
}

export function queuePosition(jobs, jobId) {
  return queueOf(jobs).find((j) => j.id === jobId)?.position ?? null;
}

/**
 * The failing ranks' [rank, traceback] pairs, first failure first: the server's failure_order
 * (ranks whose own code raised before those that only lost their peers), then any others by rank.
 */
export function failuresInOrder(job) {
  const failures = job.failures || {};
  const order = (job.failure_order || []).map(String).filter((rank) => rank in failures);
  const rest = Object.keys(failures).filter((rank) => !order.includes(rank)).sort((a, b) => Number(a) - Number(b));
  return [...order, ...rest].map((rank) => [rank, failures[rank]]);
}

/** How long a job ran: from its first running moment (or its start) to its end (or now). */
export function jobDuration(job, now = Date.now() / 1000) {
  const start = job.running_at || job.started_at;
  if (!start) return null;
  return (job.ended_at || now) - start;
}

export const HISTORY_COLUMNS = [
  { key: "created_at", label: "Submitted" },
  { key: "name", label: "Job" },
  { key: "status", label: "Status" },
  { key: "duration", label: "Duration" },
  { key: "result", label: "Result" },
  { key: "world_size", label: "World size" },
  { key: "parallelism", label: "Parallelism" },
  { key: "mean_throughput", label: "Mean throughput" },
];

/** How a job trains, in words: its parallelism, a script job's script, DILOCO's inner steps and compression. */
export function jobMode(spec = {}) {
  const strategy = spec.strategy || {};
  if (spec.kind === JobKind.SCRIPT) return `script ${strategy.path ?? ""}`.trim();
  if (spec.parallelism === "DILOCO") {
    return `DILOCO (H=${strategy.inner_steps}, ${strategy.compression})`;
  }
  return spec.parallelism ?? "—";
}

/** What a history row shows as its job: the name the submitter gave it, else its id. */
export const jobLabel = (row) => row.name || row.id;

/** A history row's headline figure, "accuracy 0.94": its final loss, else its first numeric result. */
export function resultText(result, format = String) {
  return result ? `${result.name} ${format(result.value)}` : "—";
}

/** History rows whose status is in `statuses` (all when empty), sorted by `key`; missing values last. */
export function historyRows(rows, { statuses = [], key = "created_at", dir = "desc" } = {}) {
  const sign = dir === "asc" ? 1 : -1;
  const value = (row) => (key === "name" ? jobLabel(row) : key === "result" ? row.result?.value : row[key]);
  return rows
    .filter((row) => statuses.length === 0 || statuses.includes(row.status))
    .sort((x, y) => {
      const a = value(x);
      const b = value(y);
      const aMissing = a === null || a === undefined;
      const bMissing = b === null || b === undefined;
      if (aMissing || bMissing) return aMissing === bMissing ? 0 : aMissing ? 1 : -1;
      if (typeof a === "string" || typeof b === "string") return sign * String(a).localeCompare(String(b));
      return sign * (a - b);
    });
}
