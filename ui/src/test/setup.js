// Vitest setup: DOM matchers, a clean DOM and session per test, and stand-ins for what jsdom
// lacks (canvas for uPlot, ResizeObserver).
import "@testing-library/jest-dom/vitest";
import { cleanup } from "@testing-library/react";
import { afterEach, vi } from "vitest";

vi.mock("uplot", () => {
  class FakePlot {
    static instances = [];
    constructor(opts, data, el) {
      this.opts = opts;
      this.data = data;
      this.el = el;
      FakePlot.instances.push(this);
    }
    setData(data) {
      this.data = data;
    }
    setSize() {}
    destroy() {
      this.destroyed = true;
    }
  }
  return { default: FakePlot };
});

globalThis.ResizeObserver ??= class {
  observe() {}
  disconnect() {}
};

afterEach(() => {
  cleanup();
  window.sessionStorage.clear();
  vi.restoreAllMocks();
});
