import { describe, expect, it } from "vitest";
import { lastSeq, mergeEvents } from "./events.js";

const ev = (seq) => ({ seq, kind: "metric", data: { loss: seq } });

describe("merging a job's events", () => {
  it("appends new events in order", () => {
    expect(mergeEvents([ev(1), ev(2)], [ev(3), ev(4)]).map((e) => e.seq)).toEqual([1, 2, 3, 4]);
  });

  it("keeps each event once when REST and Socket.IO deliver the same ones, out of order", () => {
    const live = mergeEvents([], [ev(5), ev(6)]);
    const merged = mergeEvents(live, [ev(1), ev(2), ev(3), ev(4), ev(5)]);
    expect(merged.map((e) => e.seq)).toEqual([1, 2, 3, 4, 5, 6]);
    expect(lastSeq(merged)).toBe(6);
  });

  it("returns the same array when nothing arrives", () => {
    const held = [ev(1)];
    expect(mergeEvents(held, [])).toBe(held);
  });
});
