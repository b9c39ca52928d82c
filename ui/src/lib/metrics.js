// From a job's metric events to chart data.
//
// A metric event is {seq, kind: "metric", rank, step, data: {name: value}, ts}. Each name is one
// chart, each rank one line. Against steps a point is the value at that step; against epochs it
// is the mean of the values reported during that epoch. An event's epoch is its own "epoch"
// value, or the last one that rank reported (platform metrics carry none).
//
// A NaN or infinite value (a loss that diverged) arrives as the string "NaN", "Infinity" or
// "-Infinity" (JSON has no such numbers): its point is a gap in the curve (null, which uPlot
// leaves unjoined), while a step a rank did not report at all is joined over (undefined).
import { EventKind, SYSTEM_METRICS } from "./protocol.js";

/** How the server writes the numbers JSON cannot carry. */
export const NON_FINITE = ["NaN", "Infinity", "-Infinity"];

/** A reported value as a number (NaN and ±Infinity from their strings), or null if it is none. */
export function reportedNumber(value) {
  if (typeof value === "number") return value;
  return NON_FINITE.includes(value) ? Number(value) : null;
}

/** Metrics the platform reports itself, shown after the job's own. */
export const PLATFORM_METRICS = SYSTEM_METRICS;
/** Values that are axes, not curves. */
const AXES = new Set(["epoch", "step"]);

/**
 * name -> rank -> [{step, epoch, value, reported, seq, ts}], names in the order they first
 * appeared; `value` is null where the rank reported NaN or an infinity (`reported` holds it).
 */
export function metricPoints(events) {
  const byName = new Map();
  const epochOf = new Map();
  for (const ev of events) {
    if (ev.kind !== EventKind.METRIC || !ev.data) continue;
    const rank = ev.rank ?? 0;
    if (typeof ev.data.epoch === "number") epochOf.set(rank, ev.data.epoch);
    const epoch = epochOf.get(rank);
    for (const [name, raw] of Object.entries(ev.data)) {
      const reported = reportedNumber(raw);
      if (AXES.has(name) || reported === null) continue;
      if (!byName.has(name)) byName.set(name, new Map());
      const ranks = byName.get(name);
      if (!ranks.has(rank)) ranks.set(rank, []);
      const value = Number.isFinite(reported) ? reported : null;
      ranks.get(rank).push({ step: ev.step ?? 0, epoch, value, reported, seq: ev.seq, ts: ev.ts });
    }
  }
  return byName;
}

/** Metric names: the job's own first (in order of appearance), then the platform's. */
export function metricNames(points) {
  const names = [...points.keys()];
  const own = names.filter((n) => !PLATFORM_METRICS.includes(n));
  return [...own, ...PLATFORM_METRICS.filter((n) => points.has(n))];
}

export function hasEpochs(points) {
  for (const ranks of points.values()) {
    for (const pts of ranks.values()) if (pts.some((p) => p.epoch !== undefined)) return true;
  }
  return false;
}

function perRank(pts, mode) {
  const out = new Map();
  if (mode === "epoch") {
    const sums = new Map();
    for (const p of pts) {
      if (p.epoch === undefined) continue;
      const s = sums.get(p.epoch) || [0, 0];
      if (p.value !== null) {
        s[0] += p.value; // a non-finite value is no part of a mean; an epoch of nothing else is a gap
        s[1] += 1;
      }
      sums.set(p.epoch, s);
    }
    for (const [epoch, [sum, n]] of sums) out.set(epoch, n ? sum / n : null);
  } else {
    for (const p of pts) out.set(p.step, p.value); // the last report at a step wins
  }
  return out;
}

/**
 * uPlot data for one metric: {ranks: [r...], data: [xs, ys_r0, ys_r1, ...], points: n}. xs is
 * the sorted union of every rank's x values; a rank without a value at some x has undefined
 * there (joined over), one that reported NaN or an infinity null (a gap).
 */
export function chartData(ranks, mode = "step") {
  const order = [...ranks.keys()].sort((a, b) => a - b);
  const lines = order.map((r) => perRank(ranks.get(r), mode));
  const xs = [...new Set(lines.flatMap((l) => [...l.keys()]))].sort((a, b) => a - b);
  const ys = lines.map((l) => xs.map((x) => (l.has(x) ? l.get(x) : undefined)));
  const points = ys.reduce((n, y) => n + y.filter((v) => v != null).length, 0);
  return { ranks: order, data: [xs, ...ys], points };
}

/** The most recent value of each metric: name -> {value, step, rank, seq, ts}. */
export function latestValues(points) {
  const out = new Map();
  for (const [name, ranks] of points) {
    let best = null;
    for (const [rank, pts] of ranks) {
      const p = pts[pts.length - 1];
      if (p && (!best || p.seq > best.seq)) best = { ...p, rank };
    }
    if (best) out.set(name, best);
  }
  return out;
}

export function metricLabel(name) {
  if (name === "throughput") return "throughput (samples/s)";
  if (name === "gpu_utilization") return "GPU utilisation (%)";
  return name.replaceAll("_", " ");
}
