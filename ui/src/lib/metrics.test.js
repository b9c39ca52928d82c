import { describe, expect, it } from "vitest";
import { chartData, hasEpochs, latestValues, metricNames, metricPoints } from "./metrics.js";

let seq = 0;
const metric = (rank, step, data) => ({ seq: ++seq, kind: "metric", rank, step, data, ts: 1000 + seq });

describe("metric points and chart data", () => {
  const events = [
    metric(0, 0, { loss: 2.0, epoch: 0 }),
    metric(1, 0, { loss: 2.2, epoch: 0 }),
    metric(0, 1, { loss: 1.0, epoch: 0 }),
    metric(0, 1, { throughput: 500 }), // platform metric, no epoch of its own
    { seq: ++seq, kind: "log", rank: 0, data: { text: "epoch 0: loss 1.0" } },
    metric(0, 2, { loss: 0.5, epoch: 1, accuracy: 0.9 }),
    metric(1, 2, { loss: 0.7, epoch: 1 }),
  ];

  it("makes one chart per metric, own metrics before the platform's, epoch is an axis not a curve", () => {
    const points = metricPoints(events);
    expect(metricNames(points)).toEqual(["loss", "accuracy", "throughput"]);
    expect(hasEpochs(points)).toBe(true);
  });

  it("aligns ranks on the union of steps, joining over a step a rank reported nothing at", () => {
    const { ranks, data, points } = chartData(metricPoints(events).get("loss"), "step");
    expect(ranks).toEqual([0, 1]);
    expect(data).toEqual([
      [0, 1, 2],
      [2.0, 1.0, 0.5],
      [2.2, undefined, 0.7],
    ]);
    expect(points).toBe(5);
  });

  it("shows a NaN or infinite value (sent as a string) as a gap, and keeps it as the latest value", () => {
    const diverged = [
      metric(0, 0, { loss: 2.0, epoch: 0 }),
      metric(0, 1, { loss: "NaN", epoch: 0 }),
      metric(0, 2, { loss: 1.0, epoch: 0 }),
      metric(0, 3, { loss: "Infinity", epoch: 1 }),
      metric(0, 4, { loss: "-Infinity", note: "text is no metric" }),
    ];
    const points = metricPoints(diverged);
    expect(metricNames(points)).toEqual(["loss"]);
    const { data, points: drawn } = chartData(points.get("loss"), "step");
    expect(data).toEqual([[0, 1, 2, 3, 4], [2.0, null, 1.0, null, null]]);
    expect(drawn).toBe(2);
    expect(chartData(points.get("loss"), "epoch").data).toEqual([[0, 1], [1.5, null]]);
    expect(latestValues(points).get("loss")).toMatchObject({ value: null, step: 4 });
    expect(Object.is(latestValues(points).get("loss").reported, -Infinity)).toBe(true);
  });

  it("averages each epoch by rank when plotted against epochs", () => {
    const { data } = chartData(metricPoints(events).get("loss"), "epoch");
    expect(data).toEqual([
      [0, 1],
      [1.5, 0.5],
      [2.2, 0.7],
    ]);
  });

  it("gives platform metrics the epoch their rank last reported", () => {
    const { data } = chartData(metricPoints(events).get("throughput"), "epoch");
    expect(data).toEqual([[0], [500]]);
  });

  it("keeps the last report when a rank reports a step twice", () => {
    const again = [metric(0, 3, { loss: 9 }), metric(0, 3, { loss: 4 })];
    expect(chartData(metricPoints(again).get("loss")).data).toEqual([[3], [4]]);
  });

  it("knows each metric's latest value and where it came from", () => {
    const latest = latestValues(metricPoints(events));
    expect(latest.get("loss")).toMatchObject({ value: 0.7, rank: 1, step: 2 });
    expect(latest.get("accuracy")).toMatchObject({ value: 0.9, rank: 0 });
  });

  it("has no epoch axis when no event names an epoch", () => {
    expect(hasEpochs(metricPoints([metric(0, 0, { loss: 1 })]))).toBe(false);
  });
});
