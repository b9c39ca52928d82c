// The server's REST API (/api/v1). Errors arrive as {"error": {"code", "message"}} and are thrown
// as ApiError; a 401 on a request that carried the room token signs the browser out.
import { getToken } from "./session.js";

export const API_PREFIX = "/api/v1";
export const TOKEN_HEADER = "X-Zwdx-Room-Token";

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.code = code;
  }
}

let onUnauthorized = null;

/** Called with the server's message when a request with the room token gets a 401. */
export function setUnauthorizedHandler(handler) {
  onUnauthorized = handler;
}

export async function request(path, { method = "GET", body, token = getToken(), raw = false, signal } = {}) {
  const headers = {};
  if (token) headers[TOKEN_HEADER] = token;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let resp;
  try {
    resp = await fetch(`${API_PREFIX}${path}`, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      signal,
    });
  } catch (err) {
    if (err?.name === "AbortError") throw err;
    throw new ApiError(0, "unreachable", "Cannot reach the zwdx server. Is it running?");
  }
  if (!resp.ok) {
    let payload = null;
    try {
      payload = await resp.json();
    } catch {
      // not JSON: keep the HTTP status
    }
    const error = payload?.error || {};
    const err = new ApiError(resp.status, error.code || `http_${resp.status}`,
      error.message || `${resp.status} ${resp.statusText || "error"}`);
    if (resp.status === 401 && token && onUnauthorized) onUnauthorized(err.message);
    throw err;
  }
  return raw ? resp : resp.json();
}

const job = (id) => `/jobs/${encodeURIComponent(id)}`;

export const api = {
  createRoom: (name) => request("/rooms", { method: "POST", body: { name }, token: null }),
  room: (token) => request("/room", token ? { token } : {}),
  jobs: (statuses) => request(statuses ? `/jobs?status=${statuses.join(",")}` : "/jobs"),
  job: (id) => request(job(id)),
  events: (id, after = 0, limit = 5000) => request(`${job(id)}/events?after=${after}&limit=${limit}`),
  cancel: (id) => request(`${job(id)}/cancel`, { method: "POST" }),
  weights: (id) => request(`${job(id)}/weights`, { raw: true }),
  history: (statuses) => request(`/dashboard/history${statuses ? `?status=${statuses.join(",")}` : ""}`),
  tokens: () => request("/room/tokens"),
  pruneClients: () => request("/room/clients/prune", { method: "POST", body: {} }),
};

/** Every event of a job after `after`, page by page (`next` null: the last page). */
export async function allEvents(id, after = 0, pageSize = 5000) {
  const out = [];
  for (;;) {
    const { events, next } = await api.events(id, after, pageSize);
    out.push(...events);
    if (!events.length || next === null || (next === undefined && events.length < pageSize)) return out;
    after = next ?? events[events.length - 1].seq;
  }
}
