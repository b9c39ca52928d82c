import { afterEach, describe, expect, it, vi } from "vitest";
import { ApiError, api, request, setUnauthorizedHandler, TOKEN_HEADER } from "./api.js";
import { setToken } from "./session.js";
import { mockFetch, status } from "../test/fakes.js";

afterEach(() => setUnauthorizedHandler(null));

describe("the API client", () => {
  it("sends the room token from the session in a header, never in the URL", async () => {
    setToken("zr_secret");
    const fetch = mockFetch({ "GET /api/v1/jobs": { jobs: [] } });
    await api.jobs();
    expect(fetch.calls[0].headers[TOKEN_HEADER]).toBe("zr_secret");
    expect(fetch.calls[0].path).not.toContain("zr_secret");
  });

  it("creates rooms without a token", async () => {
    setToken("zr_secret");
    const fetch = mockFetch({ "POST /api/v1/rooms": { id: "r", name: "lab", token: "zr_new" } });
    expect((await api.createRoom("lab")).token).toBe("zr_new");
    expect(fetch.calls[0].headers[TOKEN_HEADER]).toBeUndefined();
    expect(JSON.parse(fetch.calls[0].body)).toEqual({ name: "lab" });
  });

  it("turns the server's error body into an ApiError and reports a refused token", async () => {
    setToken("zr_old");
    mockFetch({ "GET /api/v1/room": status(401, { error: { code: "unauthorized", message: "room token not recognised" } }) });
    const onUnauthorized = vi.fn();
    setUnauthorizedHandler(onUnauthorized);
    const err = await request("/room").catch((e) => e);
    expect(err).toBeInstanceOf(ApiError);
    expect(err).toMatchObject({ status: 401, code: "unauthorized", message: "room token not recognised" });
    expect(onUnauthorized).toHaveBeenCalledWith("room token not recognised");
  });

  it("says so when the server cannot be reached", async () => {
    globalThis.fetch = vi.fn(async () => {
      throw new TypeError("Failed to fetch");
    });
    await expect(api.jobs()).rejects.toMatchObject({ status: 0, code: "unreachable" });
  });
});
