import { describe, expect, it } from "vitest";
import { SPARK_SAMPLES, initialLive, liveReducer } from "./live.js";

const client = (status, utilization, free = 6) => ({
  id: "c1",
  status,
  slots: [{ id: "c1:0", index: 0, memory_total: 8, memory_free: free, utilization }],
});

describe("the live room state", () => {
  it("is loading until the first clients answer, then keeps a bounded sample history per slot", () => {
    expect(initialLive.clients).toBe(null);
    let state = initialLive;
    for (let i = 0; i < SPARK_SAMPLES + 5; i++) {
      state = liveReducer(state, { type: "clients", clients: [client("online", i)], at: i });
    }
    const h = state.slotHistory["c1:0"];
    expect(h.util).toHaveLength(SPARK_SAMPLES);
    expect(h.util.at(-1)).toBe(SPARK_SAMPLES + 4);
    expect(h.mem.at(-1)).toBe(25); // 2 of 8 bytes in use
  });

  it("adds no samples for offline clients", () => {
    const state = liveReducer(initialLive, { type: "clients", clients: [client("offline", 50)], at: 1 });
    expect(state.clients).toHaveLength(1);
    expect(state.slotHistory).toEqual({});
  });

  it("lays a push of what changed over the list it holds", () => {
    const named = (id, status) => ({ id, status, slots: [] });
    let state = liveReducer(initialLive, { type: "clients", clients: [named("a", "online"), named("b", "online"), named("e", "online")], at: 1 });
    state = liveReducer(state, {
      type: "clients", full: false, clients: [named("b", "lost"), named("c", "online")], removed: ["a"], at: 2,
    });
    expect(state.clients.map((c) => [c.id, c.status])).toEqual([["b", "lost"], ["e", "online"], ["c", "online"]]);
    state = liveReducer(state, { type: "clients", clients: [named("d", "online")], at: 3 }); // a whole list replaces
    expect(state.clients.map((c) => c.id)).toEqual(["d"]);
  });

  it("keeps the newest copy of a job whatever order updates arrive in", () => {
    const running = { id: "j", status: "running", timeline: [{}, {}, {}] };
    const queued = { id: "j", status: "queued", timeline: [{}] };
    let state = liveReducer(initialLive, { type: "job", job: running });
    state = liveReducer(state, { type: "jobs", jobs: [queued] });
    expect(state.jobs.j.status).toBe("running");
  });
});
