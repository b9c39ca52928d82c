import { describe, expect, it } from "vitest";
import { formatAgo, formatBytes, formatDuration, formatNumber } from "./format.js";

describe("formatting", () => {
  it("writes sizes in binary units", () => {
    expect(formatBytes(0)).toBe("0 B");
    expect(formatBytes(1536)).toBe("1.5 KiB");
    expect(formatBytes(80 * 1024 ** 3)).toBe("80.0 GiB");
    expect(formatBytes(null)).toBe("—");
  });

  it("writes durations at a useful precision", () => {
    expect(formatDuration(0.25)).toBe("250 ms");
    expect(formatDuration(12.34)).toBe("12.3 s");
    expect(formatDuration(125)).toBe("2 min 05 s");
    expect(formatDuration(3 * 3600 + 120)).toBe("3 h 02 min");
  });

  it("writes numbers with four significant digits", () => {
    expect(formatNumber(0.123456)).toBe("0.1235");
    expect(formatNumber(12)).toBe("12");
    expect(formatNumber(0.00001234)).toBe("1.23e-5");
    expect(formatNumber(undefined)).toBe("—");
  });

  it("says how long ago", () => {
    expect(formatAgo(100, 102)).toBe("just now");
    expect(formatAgo(100, 130)).toBe("30 s ago");
    expect(formatAgo(null)).toBe("never");
  });
});
