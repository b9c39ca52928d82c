import { describe, expect, it } from "vitest";
import { interleavedOps, pipelineSchedule, planColumns, scheduleOf, stageOps, stageOrder } from "./plan.js";

const row = (cells, stage) =>
  cells
    .filter((c) => c.stage === stage)
    .sort((a, b) => a.t - b.t)
    .map((c) => `${c.t}:${c.kind}${c.mb}`)
    .join(" ");

describe("the micro-batch schedule", () => {
  it("runs GPipe's forwards down the stages, then the backwards back up", () => {
    const { cells, steps, idle } = pipelineSchedule("gpipe", 2, 3);
    expect(row(cells, 0)).toBe("0:F0 1:F1 2:F2 5:B0 6:B1 7:B2");
    expect(row(cells, 1)).toBe("1:F0 2:F1 3:F2 4:B0 5:B1 6:B2");
    expect(steps).toBe(8);
    expect(idle).toBeCloseTo(1 - 12 / 16);
  });

  it("runs 1F1B's backwards as soon as they can, so a stage holds fewer micro-batches", () => {
    expect(stageOps("1f1b", 2, 4, 0).map((o) => `${o.kind}${o.mb}`).join(" ")).toBe("F0 F1 B0 F2 B1 F3 B2 B3");
    expect(stageOps("1f1b", 2, 4, 1).map((o) => `${o.kind}${o.mb}`).join(" ")).toBe("F0 B0 F1 B1 F2 B2 F3 B3");
    const { cells, steps } = pipelineSchedule("1f1b", 2, 4);
    expect(row(cells, 1)).toBe("1:F0 2:B0 3:F1 4:B1 5:F2 6:B2 7:F3 8:B3");
    expect(row(cells, 0)).toBe("0:F0 1:F1 3:B0 4:F2 5:B1 6:F3 7:B2 9:B3");
    expect(steps).toBe(10);
  });

  it("does every micro-batch's forward and backward on every stage once, each after what it needs", () => {
    for (const schedule of ["gpipe", "1f1b"]) {
      for (const [stages, mbs] of [[1, 1], [3, 2], [4, 8], [5, 5]]) {
        const { cells } = pipelineSchedule(schedule, stages, mbs);
        expect(cells.length).toBe(2 * stages * mbs);
        const at = new Map(cells.map((c) => [`${c.kind}${c.stage}:${c.mb}`, c.t]));
        expect(at.size).toBe(cells.length);
        for (const c of cells) {
          if (c.kind === "F" && c.stage > 0) expect(at.get(`F${c.stage - 1}:${c.mb}`)).toBeLessThan(c.t);
          if (c.kind === "B") {
            expect(at.get(`F${c.stage}:${c.mb}`)).toBeLessThan(c.t);
            if (c.stage < stages - 1) expect(at.get(`B${c.stage + 1}:${c.mb}`)).toBeLessThan(c.t);
          }
        }
        const steps = new Set(cells.map((c) => `${c.stage}@${c.t}`));
        expect(steps.size).toBe(cells.length); // one operation a stage a step
      }
    }
  });

  it("orders interleaved 1F1B's operations on each rank as torch's ScheduleInterleaved1F1B does", () => {
    const ops = (r, w, v, m) => interleavedOps(r, w, v, m).map((o) => `${o.kind}${o.mb}s${o.stage}`).join(" ");
    // torch 2.13's pipeline_order for these, its idle steps left out
    expect(ops(0, 2, 2, 4)).toBe("F0s0 F1s0 F0s2 F1s2 F2s0 B0s2 F3s0 B1s2 F2s2 B0s0 F3s2 B1s0 B2s2 B3s2 B2s0 B3s0");
    expect(ops(1, 2, 2, 4)).toBe("F0s1 F1s1 F0s3 B0s3 F1s3 B1s3 F2s1 B0s1 F3s1 B1s1 F2s3 B2s3 F3s3 B3s3 B2s1 B3s1");
    expect(ops(1, 2, 2, 2)).toBe("F0s1 F1s1 F0s3 B0s3 F1s3 B1s3 B0s1 B1s1");
    expect(ops(2, 3, 2, 6)).toBe(
      "F0s2 F1s2 F2s2 F0s5 B0s5 F1s5 B1s5 F2s5 B2s5 F3s2 B0s2 F4s2 B1s2 F5s2 B2s2 F3s5 B3s5 F4s5 B4s5 F5s5 B5s5 B3s2 B4s2 B5s2",
    );
  });

  it("runs interleaved stages on their ranks, each operation once and after what it needs", () => {
    for (const [stages, ranks, mbs] of [[4, 2, 4], [4, 2, 2], [6, 3, 6], [6, 2, 4]]) {
      const { cells, steps } = pipelineSchedule("interleaved1f1b", stages, mbs, ranks);
      expect(cells.length).toBe(2 * stages * mbs);
      const at = new Map(cells.map((c) => [`${c.kind}${c.stage}:${c.mb}`, c.t]));
      expect(at.size).toBe(cells.length);
      for (const c of cells) {
        expect(c.stage % ranks).toBe(c.rank);
        if (c.kind === "F" && c.stage > 0) expect(at.get(`F${c.stage - 1}:${c.mb}`)).toBeLessThan(c.t);
        if (c.kind === "B" && c.stage < stages - 1) expect(at.get(`B${c.stage + 1}:${c.mb}`)).toBeLessThan(c.t);
      }
      expect(new Set(cells.map((c) => `${c.rank}@${c.t}`)).size).toBe(cells.length);
      expect(steps).toBeLessThan(2 * stages * mbs); // the simulation ended: no operation waits forever
    }
  });

  it("draws nothing for a pipeline of no stage", () => {
    expect(pipelineSchedule("gpipe", 0, 4).cells).toEqual([]);
  });
});

describe("the plan's columns and stages", () => {
  const job = {
    world_size: 3,
    spec: { parallelism: "PIPELINE", strategy: { type: "pipeline", schedule: "1f1b", microbatches: null } },
    placement: [
      { rank: 0, client_id: "b", hostname: "beta", gpu_index: 1 },
      { rank: 1, client_id: "a", hostname: "alpha", gpu_index: 0 },
      { rank: 2, client_id: "b", hostname: "beta", gpu_index: 0 },
    ],
    ranks: {
      0: { status: "running", layout: { role: "stage", text: "s2", stage: { index: 2, of: 3 } } },
      1: { status: "running", layout: { role: "stage", text: "s0", stage: { index: 0, of: 3 } } },
      2: { status: "running" },
    },
  };

  it("puts each rank in its GPU client's column, in slot order, with its layout", () => {
    const columns = planColumns(job);
    expect(columns.map((c) => [c.hostname, c.ranks.map((r) => r.rank)])).toEqual([
      ["beta", [2, 0]],
      ["alpha", [1]],
    ]);
    expect(columns[0].ranks[1].layout.text).toBe("s2");
    expect(columns[0].ranks[0].layout).toBe(null);
  });

  it("orders the stages as the ranks said, a rank that has not said as its own index", () => {
    expect(stageOrder(job).map((s) => [s.index, s.rank, s.client])).toEqual([
      [0, 1, "alpha"],
      [2, 0, "beta"],
      [2, 2, "beta"],
    ]);
  });

  it("names a stage's GPU client by its id where two clients share a host name", () => {
    const twins = { ...job, placement: job.placement.map((p) => ({ ...p, hostname: "vm" })) };
    expect(stageOrder(twins).map((s) => s.client)).toEqual(["a", "b", "b"]);
  });

  it("takes the schedule from the job's settings, a micro-batch per stage by default", () => {
    expect(scheduleOf(job)).toEqual({ schedule: "1f1b", stages: 3, ranks: 3, microbatches: 3 });
    const interleaved = { ...job, world_size: 2, ranks: {},
      spec: { parallelism: "PIPELINE", strategy: { type: "pipeline", schedule: "interleaved1f1b", stages_per_rank: 3, microbatches: 4 } } };
    expect(scheduleOf(interleaved)).toEqual({ schedule: "interleaved1f1b", stages: 6, ranks: 2, microbatches: 4 });
    expect(scheduleOf({ ...job, spec: { parallelism: "DDP" } })).toBe(null);
  });
});
