import { act, screen, waitFor } from "@testing-library/react";
import userEvent from "@testing-library/user-event";
import { describe, expect, it, vi } from "vitest";
import { FakeSocket, mockFetch, sockets, status } from "../test/fakes.js";
import { ROOM, renderApp } from "../test/render.jsx";

vi.mock("socket.io-client", () => ({ io: (url, opts) => sockets[sockets.push(new FakeSocket(opts)) - 1] }));


describe("signing in", () => {
  it("sends a visitor without a token to the sign-in page", () => {
    mockFetch({});
    renderApp("/", { token: null });
    expect(screen.getByRole("heading", { name: "Sign in to a room" })).toBeInTheDocument();
  });

  it("shows an error for a bad token and keeps nothing", async () => {
    mockFetch({ "GET /api/v1/room": { ...ROOM } }, { token: "zr_good" }); // the server knows another token
    renderApp("/signin", { token: null });
    await userEvent.type(screen.getByLabelText("Submitter token"), "zr_wrong");
    await userEvent.click(screen.getByRole("button", { name: "Sign in" }));
    expect(await screen.findByTestId("signin-error")).toHaveTextContent("This token does not open any room");
    expect(window.sessionStorage.length).toBe(0);
  });

  it("refuses a donor token with the server's word for which token signs in, and keeps nothing", async () => {
    const said = "this is a donor token: it connects GPU clients (zwdx gpu-client) and opens nothing else; " +
      "submitting, reading jobs and the dashboard take the room's submitter token (zs_...)";
    mockFetch({ "GET /api/v1/room": (req) => (req.headers["X-Zwdx-Room-Token"] === "zd_donor"
      ? status(403, { error: { code: "forbidden", message: said } }) : { ...ROOM }) });
    renderApp("/signin", { token: null });
    await userEvent.type(screen.getByLabelText("Submitter token"), "zd_donor{Enter}");
    const error = await screen.findByTestId("signin-error");
    expect(error).toHaveTextContent("This token cannot open the dashboard: this is a donor token");
    expect(error).toHaveTextContent("the room's submitter token (zs_...)");
    expect(window.sessionStorage.length).toBe(0);
    expect(screen.getByRole("heading", { name: "Sign in to a room" })).toBeInTheDocument();
  });

  it("keeps a good token in the session and opens the room and its live connection with it", async () => {
    // the fake server answers only "zr_good", in the header: the room showing proves how it was sent
    mockFetch({ "GET /api/v1/room": { ...ROOM }, "GET /api/v1/jobs": { jobs: [] } }, { token: "zr_good" });
    const before = sockets.length;
    renderApp("/signin", { token: null });
    await userEvent.type(screen.getByLabelText("Submitter token"), "  zr_good {Enter}");
    expect(await screen.findByTestId("overview")).toBeInTheDocument();
    expect(screen.getByTestId("room-name")).toHaveTextContent("lab");
    expect(window.sessionStorage.getItem("zwdx.roomToken")).toBe("zr_good");
    await waitFor(() => expect(sockets.length).toBeGreaterThan(before)); // the page opens it once signed in
    act(() => sockets.at(-1).answer("zr_good")); // the /ui handshake, answered as the server does
    expect(screen.getByTestId("connection-state")).toHaveTextContent("live");
  });

  it("creates a room and shows its two tokens once, each with a copy button", async () => {
    mockFetch({
      "POST /api/v1/rooms": status(201, { id: "r2", name: "new-lab", created_at: 1, token: "zs_fresh",
                                          submitter_token: "zs_fresh", donor_token: "zd_fresh" }),
      "GET /api/v1/room": { ...ROOM, name: "new-lab" },
      "GET /api/v1/jobs": { jobs: [] },
    });
    const clipboard = { text: "", writeText: async (text) => { clipboard.text = text; }, readText: async () => clipboard.text };
    Object.defineProperty(navigator, "clipboard", { value: clipboard, configurable: true });
    renderApp("/signin", { token: null });
    await userEvent.type(screen.getByLabelText("Name"), "new-lab");
    await userEvent.click(screen.getByRole("button", { name: "Create room" }));
    expect(await screen.findByTestId("new-token")).toHaveTextContent("zs_fresh");
    expect(screen.getByTestId("new-donor-token")).toHaveTextContent("zd_fresh");
    // GPU clients take the donor's token from a file, never from the command line (every user reads one)
    expect(screen.getByText(/--room-token-file donor-token/)).toBeInTheDocument();
    expect(screen.getByTestId("created-room")).not.toHaveTextContent(/--room-token </);
    await userEvent.click(screen.getByRole("button", { name: "Copy donor token" }));
    expect(await navigator.clipboard.readText()).toBe("zd_fresh");
    await userEvent.click(screen.getByRole("button", { name: "Copy submitter token" }));
    expect(await navigator.clipboard.readText()).toBe("zs_fresh"); // what the user pastes
    expect(screen.getAllByRole("button", { name: "Copied" })).toHaveLength(2);
    await userEvent.click(screen.getByRole("button", { name: "Open the room" }));
    expect(await screen.findByTestId("no-clients")).toBeInTheDocument();
    expect(window.sessionStorage.getItem("zwdx.roomToken")).toBe("zs_fresh"); // the submitter's, never the donor's
  });

  it("signs out with a message when the live connection refuses the token", async () => {
    mockFetch({ "GET /api/v1/room": { ...ROOM }, "GET /api/v1/jobs": { jobs: [] } });
    renderApp("/");
    await screen.findByTestId("overview");
    act(() => sockets.at(-1).answer("zr_another_rooms")); // the room's token changed hands: refused
    expect(await screen.findByText(/The server refused the room token/)).toBeInTheDocument();
    expect(screen.getByRole("heading", { name: "Sign in to a room" })).toBeInTheDocument();
    await waitFor(() => expect(window.sessionStorage.getItem("zwdx.roomToken")).toBe(null));
  });
});
