import { cleanup, render, screen } from "@testing-library/react";
import { afterEach, describe, expect, it } from "vitest";
import Plan from "./Plan.jsx";

afterEach(cleanup);

const placement = [{ rank: 0, client_id: "gpu-a", hostname: "alpha", gpu_index: 0, kind: "cuda" }];

describe("the plan of an AUTO job", () => {
  it("says the mode the server chose and why", () => {
    const auto = { parallelism: "FSDP", reason: "FSDP: a replica needs 9.00 GiB, more than one slot", at: 1 };
    render(<Plan job={{ spec: { parallelism: "FSDP" }, placement, ranks: {}, auto }} />);
    const line = screen.getByTestId("auto-choice");
    expect(line).toHaveAttribute("data-mode", "FSDP");
    expect(line).toHaveTextContent("AUTO chose FSDP a replica needs 9.00 GiB, more than one slot");
  });

  it("says a waiting AUTO job's mode is chosen at placement, and nothing for a job of another mode", () => {
    render(<Plan job={{ spec: { parallelism: "AUTO" } }} />);
    expect(screen.getByTestId("auto-choice")).toHaveTextContent("chosen as the job is placed");
    cleanup();
    render(<Plan job={{ spec: { parallelism: "DDP" }, placement, ranks: {} }} />);
    expect(screen.queryByTestId("auto-choice")).toBeNull();
  });
});
