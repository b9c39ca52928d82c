// Every dashboard test runs: a `.skip`, `.only`, `.todo` (or a conditional skipIf/runIf) left in a
// test file passes silently, so it fails the run here (vitest's allowOnly: false catches `.only`
// too, where the file is collected).
import { readdirSync, readFileSync } from "node:fs";
import { dirname, join, relative } from "node:path";
import { fileURLToPath } from "node:url";
import { describe, expect, it } from "vitest";

const SRC = join(dirname(fileURLToPath(import.meta.url)), "..");
const SELF = fileURLToPath(import.meta.url);
const LEFT_OUT = /\b(?:describe|suite|it|test|bench|ctx|context)\s*\.\s*(?:skip|only|todo|skipIf|runIf)\b/;

function testFiles(dir) {
  return readdirSync(dir, { withFileTypes: true }).flatMap((entry) => {
    const path = join(dir, entry.name);
    if (entry.isDirectory()) return testFiles(path);
    return /\.test\.[jt]sx?$/.test(entry.name) && path !== SELF ? [path] : [];
  });
}

function leftOut(source) {
  return source.split("\n").flatMap((line, i) => (LEFT_OUT.test(line) ? [`${i + 1}: ${line.trim()}`] : []));
}

describe("the dashboard's tests", () => {
  it("finds the pattern it looks for", () => {
    const words = ["skip", "only", "todo"];
    for (const word of words) expect(leftOut(`  it.${word}("a test", () => {});`)).toHaveLength(1);
    expect(leftOut(`describe . skipIf(true)("x", () => {})`)).toHaveLength(1);
    expect(leftOut(`it("skips nothing: a word like skip or only", () => {});`)).toEqual([]);
  });

  it("leave no test out (.skip, .only, .todo, skipIf, runIf)", () => {
    const files = testFiles(SRC);
    expect(files.length).toBeGreaterThan(5);
    const found = files.flatMap((file) => leftOut(readFileSync(file, "utf8")).map((hit) => `${relative(SRC, file)}:${hit}`));
    expect(found).toEqual([]);
  });
});
