// Vitest setup: DOM matchers, a clean DOM and session per test, and stand-ins for what jsdom
// lacks (canvas for uPlot, ResizeObserver).
import "@testing-library/jest-dom/vitest";
import { cleanup, configure } from "@testing-library/react";
import { afterEach, expect, vi } from "vitest";
import { problems } from "./wire.js";

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

// findBy*/waitFor give up after 1 s by default: a loaded CI machine took longer to render a page
configure({ asyncUtilTimeout: 5000 });

globalThis.ResizeObserver ??= class {
  observe() {}
  disconnect() {}
};

afterEach(() => {
  // a fake that answered or emitted what the real server does not (wire.js) fails its test
  expect(problems.splice(0), "the fakes sent what the server does not (ui/src/test/wire.json)").toEqual([]);
  cleanup();
  window.sessionStorage.clear();
  vi.restoreAllMocks();
});
