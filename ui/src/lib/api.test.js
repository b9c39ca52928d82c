import { afterEach, describe, expect, it, vi } from "vitest";
import { ApiError, allEvents, api, request, setUnauthorizedHandler } from "./api.js";
import { clearToken, setToken } from "./session.js";
import { mockFetch, status } from "../test/fakes.js";

afterEach(() => setUnauthorizedHandler(null));

// The fake server (fakes.js) opens its routes only to the room token it is given, in the header,
// and refuses a token in the URL: what a call gets back says how the client sent it.
describe("the API client", () => {
  it("gets the room's answers with the session's token, and a refusal with another", async () => {
    mockFetch({ "GET /api/v1/jobs": { jobs: [{ id: "j1" }] } }, { token: "zr_secret" });
    setToken("zr_secret");
    expect(await api.jobs()).toEqual({ jobs: [{ id: "j1" }] });
    setToken("zr_other");
    await expect(api.jobs()).rejects.toMatchObject({ status: 401, message: "room token not recognised: no room has this token" });
  });

  it("creates a room for a visitor who holds no token", async () => {
    mockFetch({
      "POST /api/v1/rooms": ({ body }) => status(201, { id: "r", name: JSON.parse(body).name, token: "zr_new" }),
    }, { token: "zr_some_room" });
    clearToken();
    expect(await api.createRoom("lab")).toEqual({ id: "r", name: "lab", token: "zr_new" });
  });

  it("turns the server's error body into an ApiError and signs out on a refused token", async () => {
    setToken("zr_old");
    mockFetch({ "GET /api/v1/room": status(401, { error: { code: "unauthorized", message: "room token not recognised" } }) });
    const signedOut = [];
    setUnauthorizedHandler((message) => signedOut.push(message));
    const err = await request("/room").catch((e) => e);
    expect(err).toBeInstanceOf(ApiError);
    expect(err).toMatchObject({ status: 401, code: "unauthorized", message: "room token not recognised" });
    expect(signedOut).toEqual(["room token not recognised"]);
  });

  it("reads a job's events page by page, as long as the server says there is a next one", async () => {
    // the server ends a page early (a size bound), with fewer events than asked for: `next` says where to go on
    const served = Array.from({ length: 7 }, (_, i) => ({ seq: i + 1, kind: "log", data: { text: `${i}` } }));
    const fetch = mockFetch({ "GET /api/v1/jobs/j1/events*": ({ path }) => {
      const after = Number(new URL(path, "http://x").searchParams.get("after"));
      const events = served.filter((e) => e.seq > after).slice(0, 3);
      const last = events.length ? events[events.length - 1].seq : after;
      return { job_id: "j1", events, next: last < 7 ? last : null };
    } });
    expect((await allEvents("j1", 0, 5000)).map((e) => e.seq)).toEqual([1, 2, 3, 4, 5, 6, 7]);
    expect(fetch.calls.length).toBe(3);
  });

  it("says so when the server cannot be reached", async () => {
    globalThis.fetch = vi.fn(async () => {
      throw new TypeError("Failed to fetch");
    });
    await expect(api.jobs()).rejects.toMatchObject({ status: 0, code: "unreachable" });
  });
});
