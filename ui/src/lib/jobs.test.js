import { describe, expect, it } from "vitest";
import { failuresInOrder, historyRows, jobDuration, jobMode, mergeJob, queueOf, queuePosition, resultText } from "./jobs.js";

const job = (id, seq, status, extra = {}) => ({ id, seq, status, created_at: seq, timeline: [{ status }], ...extra });

describe("the queue", () => {
  const jobs = [
    job("c", 3, "queued"),
    job("a", 1, "running"),
    job("d", 4, "completed"),
    job("b", 2, "queued"),
    job("e", 5, "resuming"),
  ];

  it("lists unfinished jobs in submission order with their place among the waiting", () => {
    expect(queueOf(jobs).map((j) => [j.id, j.position])).toEqual([
      ["a", null],
      ["b", 1],
      ["c", 2],
      ["e", 3],
    ]);
    expect(queuePosition(jobs, "c")).toBe(2);
    expect(queuePosition(jobs, "d")).toBe(null);
  });
});

describe("merging job updates", () => {
  it("keeps the copy with the longer timeline, whichever arrives last", () => {
    const running = job("a", 1, "running", { timeline: [{}, {}, {}] });
    const stale = job("a", 1, "queued", { timeline: [{}] });
    expect(mergeJob(running, stale).status).toBe("running");
    expect(mergeJob(stale, running).status).toBe("running");
  });

  it("drops a queue position once the job stops waiting", () => {
    const queued = job("a", 1, "queued", { queue_position: 2 });
    const started = job("a", 1, "starting", { timeline: [{}, {}] });
    expect(mergeJob(queued, started).queue_position).toBeUndefined();
  });
});

describe("history rows", () => {
  const rows = [
    { id: "a", name: "alpha", status: "completed", created_at: 1, final_loss: 0.5, mean_throughput: 100 },
    { id: "b", name: "beta", status: "failed", created_at: 2, final_loss: null, mean_throughput: 50 },
    { id: "c", name: "", status: "completed", created_at: 3, final_loss: 0.2, mean_throughput: null },
  ];

  it("sorts newest first by default", () => {
    expect(historyRows(rows).map((r) => r.id)).toEqual(["c", "b", "a"]);
  });

  it("sorts by a number either way, missing values last", () => {
    expect(historyRows(rows, { key: "final_loss", dir: "asc" }).map((r) => r.id)).toEqual(["c", "a", "b"]);
    expect(historyRows(rows, { key: "final_loss", dir: "desc" }).map((r) => r.id)).toEqual(["a", "c", "b"]);
    expect(historyRows(rows, { key: "mean_throughput", dir: "desc" }).map((r) => r.id)).toEqual(["a", "b", "c"]);
  });

  it("sorts by the result's value, and says what the result is", () => {
    const results = [
      { id: "x", result: { name: "loss", value: 0.4 } },
      { id: "y", result: null },
      { id: "z", result: { name: "accuracy", value: 0.94 } },
    ];
    expect(historyRows(results, { key: "result", dir: "desc" }).map((r) => r.id)).toEqual(["z", "x", "y"]);
    expect(resultText(results[2].result)).toBe("accuracy 0.94");
    expect(resultText(null)).toBe("—");
  });

  it("sorts by name, using the id for unnamed jobs", () => {
    expect(historyRows(rows, { key: "name", dir: "asc" }).map((r) => r.id)).toEqual(["a", "b", "c"]);
  });

  it("filters by status", () => {
    expect(historyRows(rows, { statuses: ["failed"] }).map((r) => r.id)).toEqual(["b"]);
    expect(historyRows(rows, { statuses: ["cancelled"] })).toEqual([]);
  });
});

describe("job duration", () => {
  it("runs from the first running moment to the end, or to now while running", () => {
    expect(jobDuration({ started_at: 10, running_at: 12, ended_at: 20 })).toBe(8);
    expect(jobDuration({ started_at: 10, running_at: 12 }, 15)).toBe(3);
    expect(jobDuration({ status: "queued" })).toBe(null);
  });
});

describe("failures", () => {
  it("come in the server's order, first failure first, then any others by rank", () => {
    const job = { failures: { 10: "c", 2: "b", 0: "a", 3: "d" }, failure_order: ["3", "2", "7"] };
    expect(failuresInOrder(job).map(([rank]) => rank)).toEqual(["3", "2", "0", "10"]);
    expect(failuresInOrder({ failures: { 1: "x", 0: "y" } })).toEqual([["0", "y"], ["1", "x"]]);
    expect(failuresInOrder({})).toEqual([]);
  });
});

describe("how a job trains", () => {
  it("names a script job's script and DILOCO's settings, else the parallelism", () => {
    expect(jobMode({ kind: "script", parallelism: "DDP", strategy: { type: "script", path: "train.py" } })).toBe("script train.py");
    expect(jobMode({ parallelism: "DILOCO", strategy: { type: "diloco", inner_steps: 500, compression: "int8" } })).toBe("DILOCO (H=500, int8)");
    expect(jobMode({ parallelism: "FSDP" })).toBe("FSDP");
    expect(jobMode({})).toBe("—");
  });
});
