import { act, cleanup, screen, waitFor, within } from "@testing-library/react";
import userEvent from "@testing-library/user-event";
import { describe, expect, it, vi } from "vitest";
import { FakeSocket, mockFetch, sockets, status } from "../test/fakes.js";
import { ROOM, renderApp } from "../test/render.jsx";

vi.mock("socket.io-client", () => ({ io: (url, opts) => sockets[sockets.push(new FakeSocket(opts)) - 1] }));

const base = {
  id: "j1", room_id: "r1", name: "mnist", created_at: 1700000000, seq: 1,
  spec: { parallelism: "DDP", strategy: { type: "ddp" }, training: { epochs: 2 }, resources: { world_size: 2, memory_required: 0 },
    code: { bundle_size: 2048 } },
  placement: [
    { rank: 0, client_id: "gpu-a", hostname: "alpha", gpu_index: 0, gpu_name: "NVIDIA H100", kind: "cuda" },
    { rank: 1, client_id: "gpu-b", hostname: "beta", gpu_index: 1, gpu_name: "NVIDIA H100", kind: "cuda" },
  ],
  world_size: 2,
};
const running = {
  ...base, status: "running", started_at: 1700000001, running_at: 1700000002,
  timeline: [{ status: "queued", at: 1700000000 }, { status: "starting", at: 1700000001 }, { status: "running", at: 1700000002 }],
};
const metric = (seq, rank, step, data) => ({ seq, kind: "metric", rank, step, data, ts: 1700000003 + seq });

function routes(job, events = [], extra = {}) {
  return {
    "GET /api/v1/room": { ...ROOM },
    "GET /api/v1/jobs": { jobs: [job] },
    "GET /api/v1/jobs/j1": job,
    "GET /api/v1/jobs/j1/events*": { events },
    ...extra,
  };
}

describe("the job page", () => {
  it("shows status, timeline and placement", async () => {
    mockFetch(routes(running));
    renderApp("/jobs/j1");
    const page = await screen.findByTestId("job-page");
    expect(page).toHaveAttribute("data-status", "running");
    const steps = within(screen.getByTestId("timeline")).getAllByRole("listitem");
    expect(steps.map((li) => li.dataset.status)).toEqual(["queued", "starting", "running"]);
    const placement = screen.getByTestId("placement");
    expect(placement).toHaveTextContent("alpha");
    expect(placement).toHaveTextContent("rank 0");
    expect(placement).toHaveTextContent("beta");
    expect(placement).toHaveTextContent("GPU 1");
  });

  it("shows the isolation, image and limits each rank ran under", async () => {
    const terms = { image: "zwdx-gpu-client:1.4", image_id: "sha256:abc", allowed_images: ["zwdx-gpu-client:1.4"], user: "uid 2000000+ (not root)", root_fs: "read-only", capabilities: "none", no_new_privileges: true, seccomp: "default", pids: 512, memory_bytes: 3 * 2 ** 30, shm_bytes: 2 ** 31, work_dir: "tmpfs /work", network: "host, egress only to the server and the job's peers" };
    const ranks = { 0: { status: "running", isolation: "docker", terms }, 1: { status: "running", isolation: "user" } };
    mockFetch(routes({ ...running, ranks }));
    renderApp("/jobs/j1");
    const kept = await screen.findAllByTestId("rank-isolation");
    expect(kept[0]).toHaveTextContent("container");
    expect(within(kept[0]).getByTestId("terms")).toHaveTextContent("zwdx-gpu-client:1.4 · memory 3.0 GiB · pids 512");
    expect(kept[1]).toHaveTextContent("per-job user");
    expect(within(kept[1]).queryByTestId("terms")).toBeNull(); // no container: no image, no limits
  });

  it("says the train function's default decides the epochs when none were submitted", async () => {
    mockFetch(routes({ ...running, spec: { ...running.spec, training: { epochs: null } } }));
    renderApp("/jobs/j1");
    const epochs = (await screen.findByText("Epochs")).closest("div");
    expect(epochs).toHaveTextContent("train_func's default");
  });

  it("grows its charts from job_events pushed over Socket.IO", async () => {
    mockFetch(routes(running, [metric(1, 0, 0, { loss: 2.3, epoch: 0 }), metric(2, 1, 0, { loss: 2.4, epoch: 0 })]));
    renderApp("/jobs/j1");
    await waitFor(() => expect(screen.getByTestId("chart-loss")).toHaveAttribute("data-points", "2"));
    act(() => sockets.at(-1).fire("job_events", { job_id: "j1", events: [metric(3, 0, 1, { loss: 1.7 }), metric(4, 0, 1, { throughput: 900 })] }));
    act(() => sockets.at(-1).fire("job_events", { job_id: "other", events: [metric(9, 0, 5, { loss: 9 })] }));
    expect(screen.getByTestId("chart-loss")).toHaveAttribute("data-points", "3");
    expect(screen.getByTestId("chart-throughput")).toBeInTheDocument();
    expect(screen.getByTestId("job-page")).toHaveAttribute("data-last-seq", "4");
    const loss = screen.getByTestId("latest-metrics").querySelector('[data-metric="loss"]');
    expect(loss).toHaveTextContent("1.7");
    await userEvent.click(screen.getByRole("button", { name: "by epoch" }));
    expect(screen.getByTestId("chart-loss")).toHaveAttribute("data-points", "2"); // one mean per rank for epoch 0
  });

  it("draws the plan live: each rank's layout in its GPU client's column, reported text shown as text", async () => {
    mockFetch(routes({ ...running, ranks: { 0: { status: "running" }, 1: { status: "running" } } }));
    renderApp("/jobs/j1");
    const boxes = await screen.findAllByTestId("plan-rank");
    expect(boxes.map((b) => b.dataset.role)).toEqual(["", ""]); // not said yet
    const layout = (rank, text) => ({ role: "replica", text, params: 1200000, device: `cuda:${rank}`, modules: ["conv1", "fc2"] });
    const ranks = { 0: { status: "running", layout: layout(0, "the whole model") }, 1: { status: "running", layout: layout(1, "<img src=x onerror=alert(1)>") } };
    act(() => sockets.at(-1).fire("job_update", { ...running, ranks }));
    const columns = screen.getAllByTestId("plan-client");
    expect(columns.map((c) => c.dataset.client)).toEqual(["gpu-a", "gpu-b"]);
    expect(within(columns[0]).getByTestId("plan-rank")).toHaveAttribute("data-role", "replica");
    expect(columns[0]).toHaveTextContent("the whole model");
    expect(columns[0]).toHaveTextContent("1.2M params");
    expect(columns[0]).toHaveTextContent("2 modules");
    expect(columns[1]).toHaveTextContent("<img src=x onerror=alert(1)>"); // text, not markup
    expect(columns[1].querySelector("img")).toBe(null);
    expect(screen.queryByTestId("schedule")).toBe(null); // DDP: no pipeline
  });

  it("draws a pipeline's stage order and its micro-batch schedule", async () => {
    const stage = (index) => ({ status: "running", layout: { role: "stage", text: `stage ${index} of 2`, stage: { index, of: 2 } } });
    const pipe = { ...running, spec: { ...running.spec, parallelism: "PIPELINE", strategy: { type: "pipeline", schedule: "1f1b", microbatches: 4 } },
      ranks: { 0: stage(0), 1: stage(1) } };
    mockFetch(routes(pipe));
    renderApp("/jobs/j1");
    const order = await screen.findByTestId("stage-order");
    expect([...order.querySelectorAll("li")].map((li) => li.dataset.stage)).toEqual(["0", "1"]);
    expect(order).toHaveTextContent("stage 0 rank 0 · alpha→stage 1 rank 1 · beta");
    const schedule = screen.getByTestId("schedule");
    expect(schedule).toHaveAttribute("data-schedule", "1f1b");
    expect(schedule.querySelectorAll('[data-kind="F"]').length).toBe(8);
    expect(schedule.querySelectorAll('[data-kind="B"]').length).toBe(8);
    expect(schedule).toHaveAttribute("data-steps", "10");
  });

  it("draws an interleaved pipeline's schedule a row a rank, each rank running its stages", async () => {
    const stage = (index) => ({ status: "running", layout: { role: "stage", text: `stages ${index}, ${index + 2} of 4`,
      stage: { index, of: 4, virtual: [index, index + 2] } } });
    const pipe = { ...running, ranks: { 0: stage(0), 1: stage(1) }, spec: { ...running.spec, parallelism: "PIPELINE",
      strategy: { type: "pipeline", schedule: "interleaved1f1b", microbatches: 4, stages_per_rank: 2 } } };
    mockFetch(routes(pipe));
    renderApp("/jobs/j1");
    const schedule = await screen.findByTestId("schedule");
    expect(schedule).toHaveTextContent("rank 1");
    expect(schedule.querySelectorAll('[data-kind="F"]').length).toBe(16); // 4 stages x 4 micro-batches
    for (const cell of schedule.querySelectorAll("[data-stage]")) {
      expect(Number(cell.dataset.stage) % 2).toBe(Number(cell.dataset.rank));
    }
  });

  it("follows status changes and shows the log lines", async () => {
    mockFetch(routes(running, [{ seq: 1, kind: "log", rank: 0, data: { text: "epoch 0: loss 1.03" }, ts: 1700000004 },
      { seq: 2, kind: "log", rank: null, data: { text: "diloco round 1" }, ts: 1700000005 }]));  // the server's own line
    renderApp("/jobs/j1");
    expect(await screen.findByTestId("logs")).toHaveTextContent("epoch 0: loss 1.03");
    const tags = [...screen.getByTestId("logs").querySelectorAll(".rank-tag")].map((tag) => tag.textContent);
    expect(tags).toEqual(["rank 0", "server"]);
    const done = {
      ...running, status: "completed", ended_at: 1700000012, final_loss: 0.52913, weights_artifact: "w1",
      timeline: [...running.timeline, { status: "completed", at: 1700000012 }],
    };
    act(() => sockets.at(-1).fire("job_update", done));
    expect(screen.getByTestId("job-page")).toHaveAttribute("data-status", "completed");
    expect(screen.getByText("0.5291")).toBeInTheDocument();
    expect(screen.getByText("10.0 s")).toBeInTheDocument(); // running_at to ended_at
    expect(screen.queryByRole("button", { name: "Cancel job" })).toBe(null);
    expect(screen.getByTestId("download-weights")).toBeInTheDocument();
  });

  it("shows every failing rank's traceback, the first failure first", async () => {
    const failed = {
      ...running, status: "failed", ended_at: 1700000009, reason: "rank 1 failed: ValueError: bad batch",
      failures: {
        1: "Traceback (most recent call last):\nValueError: bad batch",
        0: "RuntimeError: Connection closed by peer",
        2: "rank process exited with code 1",
      },
      failure_order: ["1", "0", "2"],
      timeline: [...running.timeline, { status: "failed", at: 1700000009, reason: "rank 1 failed" }],
    };
    mockFetch(routes(failed));
    renderApp("/jobs/j1");
    const failure = await screen.findByTestId("failure");
    expect(failure).toHaveTextContent("rank 1 failed: ValueError: bad batch");
    const ranks = within(failure).getAllByRole("group"); // <details>
    expect(ranks.map((d) => d.querySelector("summary").textContent)).toEqual(["rank 1", "rank 0", "rank 2"]);
    expect(ranks[0]).toHaveTextContent("ValueError: bad batch");
  });

  it("names the DILOCO workers found dishonest and the result's warnings, and shows none when there are none", async () => {
    const named = {
      ...running,
      suspects: { 2: { client_id: "gpu-c", rounds: [3, 4, 5], reason: "its pseudo-gradient's norm is 41.0x the round's median", at: 1700000004 } },
      warnings: ["the ranks' final weights differ: rank(s) 0, 1 hold aaaa; rank(s) 2 hold bbbb"],
    };
    mockFetch(routes(named));
    renderApp("/jobs/j1");
    const box = await screen.findByTestId("suspects");
    expect(box).toHaveTextContent("rank 2 (GPU client gpu-c), rounds 3, 4, 5: its pseudo-gradient's norm is 41.0x");
    expect(box).toHaveTextContent("the ranks' final weights differ: rank(s) 0, 1 hold aaaa");
    expect(box).toHaveTextContent("41.0x the round's median; dropped");
    cleanup();
    // Named once the job completed, by its final weights: no rounds, and not dropped.
    const atEnd = { ...named, suspects: { 1: { client_id: "gpu-b", rounds: [], reason: "its final weights are not the server's global weights", at: 1700000005 } } };
    mockFetch(routes(atEnd));
    renderApp("/jobs/j1");
    const end = await screen.findByTestId("suspects");
    expect(end).toHaveTextContent("rank 1 (GPU client gpu-b), at the end: its final weights are not the server's global weights");
    expect(end).not.toHaveTextContent("dropped");
    cleanup();
    // Rank 1 named in attempt 0 and again, another GPU client, in attempt 1: both kept, in order.
    const twice = { ...named, suspects: {
      "1@1": { rank: 1, attempt: 1, client_id: "gpu-d", rounds: [], reason: "step check, step 1, bucket 0: far", at: 1700000007 },
      1: { rank: 1, attempt: 0, client_id: "gpu-b", rounds: [], reason: "step check, step 4, bucket 0: far", at: 1700000006 } } };
    mockFetch(routes(twice));
    renderApp("/jobs/j1");
    const both = await screen.findByTestId("suspects");
    const items = within(both).getAllByRole("listitem").map((li) => li.textContent);
    expect(items).toEqual([
      "rank 1 (GPU client gpu-b), at the end: step check, step 4, bucket 0: far",
      "rank 1 (GPU client gpu-d), at the end, attempt 1: step check, step 1, bucket 0: far"]);
    cleanup();
    mockFetch(routes(running));
    renderApp("/jobs/j1");
    await screen.findByTestId("job-page");
    expect(screen.queryByTestId("suspects")).toBe(null);
  });

  it("cancels after a confirmation", async () => {
    let job = running; // the fake server's job: a POST to cancel cancels it
    mockFetch({
      ...routes(running),
      "GET /api/v1/jobs/j1": () => job,
      "POST /api/v1/jobs/j1/cancel": () => {
        job = { ...running, status: "cancelled", ended_at: 1700000005, reason: "cancelled by the submitter",
          timeline: [...running.timeline, { status: "cancelled", at: 1700000005, reason: "cancelled by the submitter" }] };
        return job;
      },
    }, { token: "zr_good" });
    renderApp("/jobs/j1");
    await userEvent.click(await screen.findByRole("button", { name: "Cancel job" }));
    expect(screen.getByRole("button", { name: "Yes, cancel it" })).toBeInTheDocument();
    expect(screen.getByTestId("job-page")).toHaveAttribute("data-status", "running");
    expect(job.status).toBe("running"); // nothing sent before the confirmation
    await userEvent.click(screen.getByRole("button", { name: "Yes, cancel it" }));
    await waitFor(() => expect(screen.getByTestId("job-page")).toHaveAttribute("data-status", "cancelled"));
    expect(screen.getByText("cancelled by the submitter")).toBeInTheDocument();
    expect(screen.queryByRole("button", { name: "Cancel job" })).toBe(null);
    expect(job.status).toBe("cancelled");
  });

  it("says when a job is not in this room", async () => {
    mockFetch({ "GET /api/v1/room": { ...ROOM }, "GET /api/v1/jobs": { jobs: [] },
      "GET /api/v1/jobs/nope": status(404, { error: { code: "not_found", message: "no job nope in this room" } }),
      "GET /api/v1/jobs/nope/events*": status(404, { error: { code: "not_found", message: "no job" } }) });
    renderApp("/jobs/nope");
    expect(await screen.findByText("No such job")).toBeInTheDocument();
  });

  it("fetches the events it missed after the connection comes back", async () => {
    let served = [metric(1, 0, 0, { loss: 2 })];
    const askedAfter = []; // what the fake server was asked for: events after this seq
    mockFetch(routes(running, [], { "GET /api/v1/jobs/j1/events*": ({ path }) => {
      const after = Number(new URL(path, "http://x").searchParams.get("after"));
      askedAfter.push(after);
      return { events: served.filter((e) => e.seq > after) };
    } }), { token: "zr_good" });
    renderApp("/jobs/j1");
    const socket = sockets.at(-1);
    act(() => socket.fire("connect"));
    await waitFor(() => expect(screen.getByTestId("chart-loss")).toHaveAttribute("data-points", "1"));
    act(() => socket.fire("disconnect", "transport close"));
    expect(screen.getByTestId("connection-lost")).toHaveTextContent("reconnecting");
    served = [...served, metric(2, 0, 1, { loss: 1.5 }), metric(3, 0, 2, { loss: 1.1 })];
    act(() => socket.fire("connect"));
    await waitFor(() => expect(screen.getByTestId("chart-loss")).toHaveAttribute("data-points", "3"));
    expect(screen.queryByTestId("connection-lost")).toBe(null);
    expect(screen.getByTestId("latest-metrics").querySelector('[data-metric="loss"]')).toHaveTextContent("1.1");
    expect(askedAfter.at(-1)).toBe(1); // only what it missed
  });

  // The job as the fake server has it now: ``current()``, changed by the test.
  const serveJob = (current) => mockFetch({
    "GET /api/v1/room": { ...ROOM },
    "GET /api/v1/jobs": () => ({ jobs: current().status === "running" ? [current()] : [] }),
    "GET /api/v1/jobs/j1": () => current(),
    "GET /api/v1/jobs/j1/events*": { events: [] },
  });

  it("catches up on a change made between its first fetch and its first connection", async () => {
    let current = running;
    serveJob(() => current);
    renderApp("/jobs/j1");
    const socket = sockets.at(-1);
    await screen.findByTestId("job-page");
    // the job ends before the dashboard's connection has joined the room: no update will come
    current = { ...running, status: "completed", ended_at: 1700000010,
      timeline: [...running.timeline, { status: "completed", at: 1700000010 }] };
    act(() => socket.fire("connect"));
    await waitFor(() => expect(screen.getByTestId("job-page")).toHaveAttribute("data-status", "completed"));
  });

  it("learns that the job ended while the connection was down", async () => {
    let current = running;
    serveJob(() => current);
    renderApp("/jobs/j1");
    const socket = sockets.at(-1);
    act(() => socket.fire("connect"));
    await screen.findByTestId("job-page");
    act(() => socket.fire("disconnect", "transport close"));
    current = { ...running, status: "completed", ended_at: 1700000010,
      timeline: [...running.timeline, { status: "completed", at: 1700000010 }] };
    act(() => socket.fire("connect"));
    await waitFor(() => expect(screen.getByTestId("job-page")).toHaveAttribute("data-status", "completed"));
  });
});
