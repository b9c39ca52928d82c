// Test doubles: a fetch that answers from a route table, and a Socket.IO client socket the test drives.
import { vi } from "vitest";

/** routes: {"GET /api/v1/room": body | (request) => body | status(code, body)}; a route without
 * "?" matches any query, one ending in "*" any longer path. Returns the mock; .calls lists requests. */
export function mockFetch(routes) {
  const calls = [];
  const fetch = vi.fn(async (url, init = {}) => {
    const method = init.method || "GET";
    const path = String(url);
    calls.push({ method, path, headers: init.headers || {}, body: init.body });
    const key = Object.keys(routes).find((k) => {
      const [m, p] = k.split(" ");
      if (m !== method) return false;
      if (p.endsWith("*")) return path.startsWith(p.slice(0, -1));
      return p === (p.includes("?") ? path : path.split("?")[0]);
    });
    if (!key) return response(404, { error: { code: "not_found", message: `no route ${method} ${path}` } });
    let answer = routes[key];
    if (typeof answer === "function") answer = await answer({ method, path, headers: init.headers || {}, body: init.body });
    if (answer && answer.__status) return response(answer.__status, answer.body);
    return response(200, answer);
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
    for (const fn of this.handlers.get(event) || []) fn(...args);
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
