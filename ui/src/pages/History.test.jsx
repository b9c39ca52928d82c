import { act, screen, waitFor, within } from "@testing-library/react";
import userEvent from "@testing-library/user-event";
import { describe, expect, it, vi } from "vitest";
import { FakeSocket, mockFetch, sockets } from "../test/fakes.js";
import { ROOM, renderApp } from "../test/render.jsx";

vi.mock("socket.io-client", () => ({ io: (url, opts) => sockets[sockets.push(new FakeSocket(opts)) - 1] }));

const row = (id, statusName, extra) => ({
  id, name: `train-${id}`, status: statusName, created_at: 1700000000, duration: 10, final_loss: 0.5,
  result: { name: "loss", value: 0.5 }, world_size: 2, parallelism: "DDP", mean_throughput: 100, ...extra,
});
const rows = [
  row("alpha", "completed", { created_at: 1700000001, final_loss: 0.3, result: { name: "loss", value: 0.3 }, mean_throughput: 1200 }),
  row("beta", "failed", { created_at: 1700000002, final_loss: null, result: null, mean_throughput: 80 }),
  row("gamma", "cancelled", { created_at: 1700000003, final_loss: 0.9, result: { name: "loss", value: 0.9 }, parallelism: "FSDP", duration: null }),
];
const cellOf = (r, i) => within(r).getAllByRole("cell")[i];
const names = () => screen.getAllByTestId("history-row").map((r) => within(cellOf(r, 1)).getByRole("link").textContent);

describe("the history", () => {
  it("lists past jobs newest first with name, duration, result, world size, parallelism and throughput", async () => {
    mockFetch({ "GET /api/v1/room": { ...ROOM }, "GET /api/v1/jobs": { jobs: [] }, "GET /api/v1/dashboard/history": { jobs: rows } });
    renderApp("/history");
    await screen.findByTestId("history-table");
    expect(names()).toEqual(["train-gamma", "train-beta", "train-alpha"]);
    const alpha = screen.getAllByTestId("history-row")[2];
    expect(alpha).toHaveTextContent("10.0 s");
    expect(cellOf(alpha, 4)).toHaveTextContent(/^loss 0\.3$/);
    expect(alpha).toHaveTextContent("1200 samples/s");
    expect(alpha).toHaveTextContent("DDP");
    expect(within(alpha).getByRole("link", { name: "train-alpha" })).toHaveAttribute("href", "/jobs/alpha");
    expect(cellOf(alpha, 1)).toHaveTextContent("train-alpha alpha"); // the name, and the id beside it
  });

  it("shows the first numeric result of a job without a loss, and the id of a job without a name", async () => {
    const dict = row("0f3a9c", "completed", { name: "", final_loss: null, result: { name: "accuracy", value: 0.94 } });
    mockFetch({ "GET /api/v1/room": { ...ROOM }, "GET /api/v1/jobs": { jobs: [] }, "GET /api/v1/dashboard/history": { jobs: [dict] } });
    renderApp("/history");
    const [only] = await screen.findAllByTestId("history-row");
    expect(cellOf(only, 4)).toHaveTextContent(/^accuracy 0\.94$/);
    expect(cellOf(only, 1)).toHaveTextContent(/^0f3a9c$/);
    expect(within(only).getByRole("link", { name: "0f3a9c" })).toHaveAttribute("href", "/jobs/0f3a9c");
  });

  it("sorts by a clicked column, both ways", async () => {
    mockFetch({ "GET /api/v1/room": { ...ROOM }, "GET /api/v1/jobs": { jobs: [] }, "GET /api/v1/dashboard/history": { jobs: rows } });
    renderApp("/history");
    await screen.findByTestId("history-table");
    await userEvent.click(screen.getByRole("button", { name: /Result/ }));
    expect(names()).toEqual(["train-gamma", "train-alpha", "train-beta"]);
    expect(screen.getByRole("columnheader", { name: /Result/ })).toHaveAttribute("aria-sort", "descending");
    await userEvent.click(screen.getByRole("button", { name: /Result/ }));
    expect(names()).toEqual(["train-alpha", "train-gamma", "train-beta"]);
    await userEvent.click(screen.getByRole("button", { name: /Mean throughput/ }));
    expect(names()).toEqual(["train-alpha", "train-gamma", "train-beta"]);
  });

  it("filters by status", async () => {
    mockFetch({ "GET /api/v1/room": { ...ROOM }, "GET /api/v1/jobs": { jobs: [] }, "GET /api/v1/dashboard/history": { jobs: rows } });
    renderApp("/history");
    await screen.findByTestId("history-table");
    await userEvent.click(screen.getByRole("checkbox", { name: "failed" }));
    expect(names()).toEqual(["train-beta"]);
    await userEvent.click(screen.getByRole("checkbox", { name: "completed" }));
    expect(names()).toEqual(["train-beta", "train-alpha"]);
  });

  it("says when nothing has finished yet, and reloads when a job finishes", async () => {
    let served = [];
    mockFetch({ "GET /api/v1/room": { ...ROOM }, "GET /api/v1/jobs": { jobs: [] }, "GET /api/v1/dashboard/history": () => ({ jobs: served }) });
    renderApp("/history");
    expect(await screen.findByTestId("no-history")).toBeInTheDocument();
    served = [rows[0]];
    act(() => sockets.at(-1).fire("job_update", { id: "alpha", seq: 1, status: "completed", timeline: [{}, {}, {}, {}] }));
    await waitFor(() => expect(names()).toEqual(["train-alpha"]));
  });
});
