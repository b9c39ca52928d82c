// Test doubles: a fake server behind fetch that answers from a route table, and a Socket.IO client
// socket the test drives. Tests assert what the page shows; the fake server may hold state (a job a
// POST cancelled) and, given a room token, refuses requests as the real one does.
import { vi } from "vitest";
import { checkAnswer, checkEvent } from "./wire.js";

const TOKEN_HEADER = "X-Zwdx-Room-Token";
const OPEN_ROUTES = ["POST /api/v1/rooms"]; // the only call the real server takes without a token

/** The real server's answer to a request without the room `token` in its header (or with the
 * token in the URL, which would end up in access logs): 401/400 as it words them, else null. */
function refusal(token, method, path, headers) {
  if (path.includes(token)) return status(400, { error: { code: "bad_request", message: "a room token in the URL" } });
  if (OPEN_ROUTES.includes(`${method} ${path.split("?")[0]}`)) return null;
  if (!headers[TOKEN_HEADER]) {
    return status(401, { error: { code: "unauthorized", message: `this call needs a room token in the ${TOKEN_HEADER} header` } });
  }
  if (headers[TOKEN_HEADER] !== token) {
    return status(401, { error: { code: "unauthorized", message: "room token not recognised: no room has this token" } });
  }
  return null;
}

/** routes: {"GET /api/v1/room": body | (request) => body | status(code, body)}; a route without
 * "?" matches any query, one ending in "*" any longer path. With `token`, the fake server opens
 * its routes only to that room token, in the header. Returns the mock; .calls lists requests. */
export function mockFetch(routes, { token = null } = {}) {
  const calls = [];
  const fetch = vi.fn(async (url, init = {}) => {
    const method = init.method || "GET";
    const path = String(url);
    calls.push({ method, path, headers: init.headers || {}, body: init.body });
    const refused = token && refusal(token, method, path, init.headers || {});
    if (refused) return response(refused.__status, refused.body);
    const key = Object.keys(routes).find((k) => {
      const [m, p] = k.split(" ");
      if (m !== method) return false;
      if (p.endsWith("*")) return path.startsWith(p.slice(0, -1));
      return p === (p.includes("?") ? path : path.split("?")[0]);
    });
    if (!key) return response(404, { error: { code: "not_found", message: `no route ${method} ${path}` } });
    let answer = routes[key];
    if (typeof answer === "function") answer = await answer({ method, path, headers: init.headers || {}, body: init.body });
    const [code, body] = answer && answer.__status ? [answer.__status, answer.body] : [200, answer];
    checkAnswer(method, path, code, body);
    return response(code, body);
  });
  fetch.calls = calls;
  globalThis.fetch = fetch;
  return fetch;
}

export const status = (code, body) => ({ __status: code, body });

function response(code, body) {
  return {
    ok: code >= 200 && code < 300,
    status: code,
    statusText: String(code),
    json: async () => body,
    blob: async () => new Blob([JSON.stringify(body)]),
  };
}

export class FakeSocket {
  constructor(opts, url) {
    this.opts = opts;
    this.url = url;
    this.handlers = new Map();
    this.active = true;
    this.connected = false;
  }
  on(event, fn) {
    if (!this.handlers.has(event)) this.handlers.set(event, []);
    this.handlers.get(event).push(fn);
    return this;
  }
  fire(event, ...args) {
    if (event === "connect") this.connected = true;
    if (event === "disconnect") this.connected = false;
    checkEvent(event, args[0]);
    for (const fn of this.handlers.get(event) || []) fn(...args);
  }
  /** The server's answer to this socket's handshake, as the real one gives it: connected when
   * its auth carries the room `token`, refused for good (socket.io-client stops retrying) if not. */
  answer(token) {
    if (this.opts?.auth?.token === token) {
      this.fire("connect");
    } else {
      this.active = false;
      this.fire("connect_error", new Error("room token not recognised: no room has this token"));
    }
  }
  connect() {
    this.reconnectAsked = true;
  }
  removeAllListeners() {
    this.handlers.clear();
  }
  disconnect() {
    this.closed = true;
  }
}

/** Sockets the app opened (io() is mocked to record them); the last is the live one. */
export const sockets = [];
