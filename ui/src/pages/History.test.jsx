import { act, screen, waitFor, within } from "@testing-library/react";
import userEvent from "@testing-library/user-event";
import { describe, expect, it, vi } from "vitest";
import { FakeSocket, mockFetch, sockets } from "../test/fakes.js";
import { ROOM, renderApp } from "../test/render.jsx";

vi.mock("socket.io-client", () => ({ io: (url, opts) => sockets[sockets.push(new FakeSocket(opts)) - 1] }));

const row = (id, statusName, extra) => ({
  id, name: id, status: statusName, created_at: 1700000000, duration: 10, final_loss: 0.5, world_size: 2,
  parallelism: "DDP", mean_throughput: 100, ...extra,
});
const rows = [
  row("alpha", "completed", { created_at: 1700000001, final_loss: 0.3, mean_throughput: 1200 }),
  row("beta", "failed", { created_at: 1700000002, final_loss: null, mean_throughput: 80 }),
  row("gamma", "cancelled", { created_at: 1700000003, final_loss: 0.9, parallelism: "FSDP", duration: null }),
];
const names = () => screen.getAllByTestId("history-row").map((r) => within(r).getAllByRole("cell")[1].textContent);

describe("the history", () => {
  it("lists past jobs newest first with duration, final loss, world size, parallelism and throughput", async () => {
    mockFetch({ "GET /api/v1/room": { ...ROOM }, "GET /api/v1/jobs": { jobs: [] }, "GET /api/v1/dashboard/history": { jobs: rows } });
    renderApp("/history");
    await screen.findByTestId("history-table");
    expect(names()).toEqual(["gamma", "beta", "alpha"]);
    const alpha = screen.getAllByTestId("history-row")[2];
    expect(alpha).toHaveTextContent("10.0 s");
    expect(alpha).toHaveTextContent("0.3");
    expect(alpha).toHaveTextContent("1200 samples/s");
    expect(alpha).toHaveTextContent("DDP");
    expect(within(alpha).getByRole("link", { name: "alpha" })).toHaveAttribute("href", "/jobs/alpha");
  });

  it("sorts by a clicked column, both ways", async () => {
    mockFetch({ "GET /api/v1/room": { ...ROOM }, "GET /api/v1/jobs": { jobs: [] }, "GET /api/v1/dashboard/history": { jobs: rows } });
    renderApp("/history");
    await screen.findByTestId("history-table");
    await userEvent.click(screen.getByRole("button", { name: /Final loss/ }));
    expect(names()).toEqual(["gamma", "alpha", "beta"]);
    expect(screen.getByRole("columnheader", { name: /Final loss/ })).toHaveAttribute("aria-sort", "descending");
    await userEvent.click(screen.getByRole("button", { name: /Final loss/ }));
    expect(names()).toEqual(["alpha", "gamma", "beta"]);
    await userEvent.click(screen.getByRole("button", { name: /Mean throughput/ }));
    expect(names()).toEqual(["alpha", "gamma", "beta"]);
  });

  it("filters by status", async () => {
    mockFetch({ "GET /api/v1/room": { ...ROOM }, "GET /api/v1/jobs": { jobs: [] }, "GET /api/v1/dashboard/history": { jobs: rows } });
    renderApp("/history");
    await screen.findByTestId("history-table");
    await userEvent.click(screen.getByRole("checkbox", { name: "failed" }));
    expect(names()).toEqual(["beta"]);
    await userEvent.click(screen.getByRole("checkbox", { name: "completed" }));
    expect(names()).toEqual(["beta", "alpha"]);
  });

  it("says when nothing has finished yet, and reloads when a job finishes", async () => {
    let served = [];
    mockFetch({ "GET /api/v1/room": { ...ROOM }, "GET /api/v1/jobs": { jobs: [] }, "GET /api/v1/dashboard/history": () => ({ jobs: served }) });
    renderApp("/history");
    expect(await screen.findByTestId("no-history")).toBeInTheDocument();
    served = [rows[0]];
    act(() => sockets.at(-1).fire("job_update", { id: "alpha", seq: 1, status: "completed", timeline: [{}, {}, {}, {}] }));
    await waitFor(() => expect(names()).toEqual(["alpha"]));
  });
});
