import { act, screen, within } from "@testing-library/react";
import { describe, expect, it, vi } from "vitest";
import { FakeSocket, mockFetch, sockets } from "../test/fakes.js";
import { ROOM, renderApp } from "../test/render.jsx";

vi.mock("socket.io-client", () => ({ io: (url, opts) => sockets[sockets.push(new FakeSocket(opts, url)) - 1] }));

const GiB = 1024 ** 3;
const gpuClient = (id, status, slots) => ({ id, hostname: `host-${id}`, status, last_seen: Date.now() / 1000, versions: { python: "3.11.7" }, slots });
const slot = (clientId, index, extra = {}) => ({
  id: `${clientId}:${index}`, index, kind: "cuda", name: "NVIDIA H100", memory_total: 80 * GiB,
  memory_free: 60 * GiB, utilization: 40, job_id: null, rank: null, ...extra,
});
const job = (id, seq, status, spec = {}) => ({
  id, seq, status, name: `job-${id}`, created_at: 1700000000 + seq, timeline: [{ status }],
  spec: { resources: { world_size: 2, memory_required: 8 * GiB, ...spec }, parallelism: "DDP", strategy: { type: "ddp" } },
  world_size: null,
});

describe("the room overview", () => {
  it("shows what the room uses of its quotas, and asks again when its jobs come and go", async () => {
    let jobs = 3;
    const fetch = mockFetch({
      "GET /api/v1/room": () => ({ ...ROOM, clients: [], usage: { jobs, jobs_limit: 100, artifact_bytes: 2 * GiB,
                                                                    artifact_bytes_limit: 0 } }),
      "GET /api/v1/jobs": { jobs: [job("j1", 1, "queued")] },
    });
    renderApp("/");
    expect(await screen.findByTestId("quota-jobs")).toHaveTextContent("3 / 100 jobs");
    expect(screen.getByTestId("quota-artifacts")).toHaveTextContent("2.0 GiB (no limit) stored");
    const asked = fetch.calls.filter((c) => c.path === "/api/v1/room").length;
    jobs = 4;
    await act(async () => sockets.at(-1).fire("job_update", job("j2", 2, "queued")));
    expect(await screen.findByText("4 / 100")).toBeInTheDocument();
    expect(fetch.calls.filter((c) => c.path === "/api/v1/room").length).toBeGreaterThan(asked);
  });

  it("lists the room's tokens by name and role, revoked and legacy ones too, never a secret", async () => {
    const token = (id, role, name, extra = {}) => ({ id, role, name, legacy: false, created_at: 1700000000,
                                                      rotated_at: null, revoked_at: null, own: false, ...extra });
    mockFetch({
      "GET /api/v1/room": { ...ROOM, clients: [] }, "GET /api/v1/jobs": { jobs: [] },
      "GET /api/v1/room/tokens": { tokens: [
        token("t1", "submitter", "old room token", { legacy: true }),
        token("t2", "submitter", "made with the room", { own: true }),
        token("t3", "donor", "lab donors", { rotated_at: 1700000100 }),
        token("t4", "donor", "a lost laptop", { revoked_at: 1700000200 }),
      ] },
    });
    renderApp("/");
    const rows = await screen.findAllByTestId("token-row");
    const cells = rows.map((r) => within(r).getAllByRole("cell").map((c) => c.textContent));
    expect(cells.map((c) => [c[0], c[1]])).toEqual([
      ["old room token t1", "legacy: submitter and donor"], ["made with the room t2", "submitter"],
      ["lab donors t3", "donor"], ["a lost laptop t4", "donor"]]);
    expect(cells[1][5]).toBe("signed in with it");
    expect(cells[2][3]).not.toBe("—");                                      // rotated
    expect(cells[3][4]).not.toBe("—");                                      // revoked
    expect(cells.slice(0, 3).map((c) => c[4])).toEqual(["—", "—", "—"]);   // the others are not
    expect(screen.getByTestId("legacy-token")).toHaveTextContent("zwdx room tokens rotate");
    expect(screen.getByTestId("tokens")).not.toHaveTextContent(/z[srd]_/);  // no secret, not even its prefix
  });

  it("says what to do when the room has no GPU clients and no jobs", async () => {
    mockFetch({ "GET /api/v1/room": { ...ROOM, clients: [] }, "GET /api/v1/jobs": { jobs: [] } });
    renderApp("/");
    expect(await screen.findByTestId("no-clients")).toHaveTextContent(/zwdx gpu-client --server \S+ --room-token-file donor-token/);
    expect(screen.getByTestId("no-jobs")).toBeInTheDocument();
  });

  it("shows clients online and offline, each GPU's memory and utilisation, and which job a slot runs", async () => {
    const clients = [
      { ...gpuClient("a", "online", [slot("a", 0, { job_id: "j1", rank: 0, isolation: "user" }), slot("a", 1, { isolation: "process" }), slot("a", 2, { isolation: "docker", terms: { image: "zwdx-gpu-client", pids: 512, memory_bytes: 2 ** 32, shm_bytes: 2 ** 31, root_fs: "read-only", capabilities: "none", network: "host" } })]),
        link: { rtt: 0.0123, up: 12.5e6, down: 117e6, measured_at: 1700000000 }, unreachable: ["b"] },
      gpuClient("b", "offline", [slot("b", 0)]),
    ];
    mockFetch({ "GET /api/v1/room": { ...ROOM, clients }, "GET /api/v1/jobs": { jobs: [job("j1", 1, "running")] } });
    renderApp("/");
    const cards = await screen.findAllByTestId("client");
    expect(cards.map((c) => c.dataset.status)).toEqual(["online", "offline"]);
    expect(screen.getByTestId("stat-online")).toHaveTextContent("1 GPU client online");
    const [busy, idle, boxed] = within(cards[0]).getAllByTestId("slot");
    expect(busy).toHaveTextContent("NVIDIA H100");
    expect(busy).toHaveTextContent("60.0 GiB free of 80.0 GiB");
    expect(busy).toHaveTextContent("40 %");
    expect(within(busy).getByRole("link")).toHaveAttribute("href", "/jobs/j1");
    expect(busy).toHaveTextContent("job-j1 rank 0");
    expect(idle).toHaveTextContent("idle");
    expect(within(busy).getByTestId("isolation")).toHaveTextContent("per-job user");
    expect(within(idle).getByTestId("isolation")).toHaveTextContent("same user");
    expect(within(boxed).getByTestId("isolation")).toHaveTextContent("container");
    expect(within(boxed).getByTestId("isolation")).toHaveAttribute("title", expect.stringContaining("zwdx-gpu-client · memory 4.0 GiB · pids 512"));
    expect(within(within(cards[1]).getByTestId("slot")).queryByTestId("isolation")).toBeNull(); // an older client: not told
    expect(within(cards[0]).getByTestId("link")).toHaveTextContent("↓ 936 Mbit/s ↑ 100 Mbit/s · rtt 12.3 ms");
    expect(within(cards[0]).getByTestId("unreachable")).toHaveTextContent("cannot reach b");
    expect(within(cards[1]).queryByTestId("link")).toBeNull(); // not measured: nothing shown
  });

  it("names a GPU slot gpu and the CPU slot of a client without GPUs cpu, and counts only online clients", async () => {
    const clients = [
      gpuClient("a", "online", [slot("a", 0)]),
      gpuClient("c", "online", [slot("c", 0, { kind: "cpu", name: "cpu", utilization: null })]),
      gpuClient("z", "offline", [slot("z", 0)]),
    ];
    mockFetch({ "GET /api/v1/room": { ...ROOM, clients }, "GET /api/v1/jobs": { jobs: [] } });
    renderApp("/");
    const cards = await screen.findAllByTestId("client");
    expect(cards.map((c) => c.dataset.status)).toEqual(["online", "online", "offline"]);
    expect(within(cards[0]).getByTestId("slot")).toHaveTextContent(/^gpu 0/);
    expect(within(cards[1]).getByTestId("slot")).toHaveTextContent(/^cpu 0/);
    expect(screen.getByTestId("stat-online")).toHaveTextContent("2 GPU clients online");
  });

  it("shows the memory the room offers, as the server counts it (a host's RAM once)", async () => {
    const totals = { clients_online: 2, hosts: 1, slots: 2, slots_busy: 0, memory_total: 16 * GiB, memory_free: 12 * GiB };
    mockFetch({ "GET /api/v1/room": { ...ROOM, clients: [], totals }, "GET /api/v1/jobs": { jobs: [] } });
    renderApp("/");
    expect(await screen.findByTestId("stat-memory")).toHaveTextContent("12.0 GiB free of 16.0 GiB");
    act(() => sockets.at(-1).fire("clients_update", { clients: [], totals: { ...totals, memory_free: 10 * GiB } }));
    expect(screen.getByTestId("stat-memory")).toHaveTextContent("10.0 GiB free of 16.0 GiB");
  });

  it("prunes the room's offline GPU clients with a button, shown only while some are offline", async () => {
    const clients = [gpuClient("a", "online", [slot("a", 0)]), gpuClient("b", "offline", [slot("b", 0)]),
      gpuClient("c", "offline", [slot("c", 0)])];
    const fetch = mockFetch({ "GET /api/v1/room": { ...ROOM, clients }, "GET /api/v1/jobs": { jobs: [] },
      "POST /api/v1/room/clients/prune": { pruned: ["b", "c"] } }, { token: "zr_good" });
    renderApp("/");
    const button = await screen.findByTestId("prune-clients");
    await act(async () => button.click());
    expect(await screen.findByTestId("pruned")).toHaveTextContent("2 offline GPU clients dropped");
    expect(fetch.calls.filter((c) => c.method === "POST" && c.path === "/api/v1/room/clients/prune")).toHaveLength(1);
    await act(async () => sockets.at(-1).fire("clients_update", { clients: [clients[0]] }));  // the list follows
    expect(screen.getAllByTestId("client")).toHaveLength(1);
    expect(screen.queryByTestId("prune-clients")).toBeNull();
  });

  it("updates utilisation and its sparkline from clients_update pushes", async () => {
    mockFetch({ "GET /api/v1/room": { ...ROOM, clients: [] }, "GET /api/v1/jobs": { jobs: [] } });
    renderApp("/");
    await screen.findByTestId("no-clients");
    const push = (util) =>
      act(() => sockets.at(-1).fire("clients_update", { clients: [gpuClient("a", "online", [slot("a", 0, { utilization: util })])] }));
    push(10);
    push(75);
    expect(screen.getByTestId("slot")).toHaveTextContent("75 %");
    expect(screen.getByRole("img", { name: "utilisation of NVIDIA H100" })).toHaveAttribute("data-samples", "2");
  });

  it("lists the queue in submission order with position, requested world size and memory", async () => {
    const jobs = [job("q2", 3, "queued", { world_size: null }), job("r", 1, "running"), job("q1", 2, "queued"), job("done", 0, "completed")];
    mockFetch({ "GET /api/v1/room": { ...ROOM, clients: [] }, "GET /api/v1/jobs": { jobs } });
    renderApp("/");
    const rows = await screen.findAllByTestId("queue-row");
    const cells = rows.map((r) => within(r).getAllByRole("cell").slice(0, 5).map((c) => c.textContent));
    expect(cells).toEqual([
      ["—", "job-r", "running", "2", "8.0 GiB"],
      ["1", "job-q1", "queued", "2", "8.0 GiB"],
      ["2", "job-q2", "queued", "all free", "8.0 GiB"],
    ]);
  });

  it("shows a job that arrives over Socket.IO without a reload", async () => {
    mockFetch({ "GET /api/v1/room": { ...ROOM, clients: [] }, "GET /api/v1/jobs": { jobs: [] } });
    renderApp("/");
    await screen.findByTestId("no-jobs");
    expect(sockets.at(-1).url).toBe("/ui");
    expect(sockets.at(-1).opts.auth).toEqual({ token: "zr_good" });
    act(() => sockets.at(-1).fire("job_update", job("new", 1, "queued")));
    expect(await screen.findByTestId("queue-row")).toHaveTextContent("job-new");
  });
});
