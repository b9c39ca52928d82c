// The job's plan: a column per GPU client, a box per rank with what it holds (its layout, as the
// rank reported it once its model was wrapped: role, one line, params, its modules folded); for
// a pipeline the stage order and the micro-batch schedule. Everything a rank reported is shown as
// text (React escapes it): it comes from a process beside the job's own code.
import { formatNumber } from "../lib/format.js";
import { MAX_DRAWN, pipelineSchedule, planColumns, scheduleOf, stageOrder } from "../lib/plan.js";
import { Parallelism, SlotKind } from "../lib/protocol.js";

const ROLE_WORDS = { replica: "replica", shard: "shard", stage: "stage", tp: "tensor parallel", "fsdp+tp": "FSDP + TP" };

function amount(n) {
  if (typeof n !== "number") return "";
  for (const [size, unit] of [[1e9, "B"], [1e6, "M"], [1e3, "K"]]) if (n >= size) return `${(n / size).toFixed(1)}${unit}`;
  return String(n);
}

function RankBox({ place }) {
  const { layout } = place;
  const where = `${place.kind === SlotKind.CPU ? "CPU" : "GPU"} ${place.gpu_index}`;
  return (
    <div className={`plan-rank role-${layout?.role || "unknown"}`} data-testid="plan-rank" data-rank={place.rank}
      data-role={layout?.role || ""}>
      <div className="plan-rank-head">
        <span className="rank-tag">rank {place.rank}</span>
        {layout && <span className="role-tag">{ROLE_WORDS[layout.role] || layout.role}</span>}
        <span className="muted small">{layout?.device || where}</span>
      </div>
      {layout ? (
        <>
          <div className="plan-text">{layout.text}</div>
          {typeof layout.params === "number" && (
            <div className="muted small" title={`${formatNumber(layout.params)} parameter elements on this rank`}>
              {amount(layout.params)} params
              {layout.batch ? ` · batch ${layout.batch}` : ""}
              {typeof layout.weight === "number" ? ` · weight ${formatNumber(layout.weight)}` : ""}
            </div>
          )}
          {layout.mesh && (
            <div className="muted small">
              mesh dp {layout.mesh.dp}/{layout.mesh.dp_size} · tp {layout.mesh.tp}/{layout.mesh.tp_size}
            </div>
          )}
          {layout.modules?.length > 0 && (
            <details className="plan-modules">
              <summary>{layout.modules.length} module{layout.modules.length === 1 ? "" : "s"}</summary>
              <ul className="mono small">
                {layout.modules.map((m, i) => (
                  <li key={i}>{m}</li>
                ))}
              </ul>
            </details>
          )}
        </>
      ) : (
        <div className="muted small">Says what it holds once its model is wrapped.</div>
      )}
    </div>
  );
}

function StageOrder({ job }) {
  const stages = stageOrder(job);
  return (
    <ol className="stage-order" data-testid="stage-order">
      {stages.map((s, i) => (
        <li key={s.rank} data-stage={s.index}>
          {i > 0 && <span className="stage-arrow" aria-hidden="true">→</span>}
          <span className="stage-box">
            <strong>stage {s.index}</strong> <span className="muted small">rank {s.rank} · {s.client}</span>
          </span>
        </li>
      ))}
    </ol>
  );
}

const CELL = { w: 26, h: 22, left: 64, top: 18 };

function Schedule({ settings }) {
  const { schedule, stages, ranks, microbatches } = settings;
  const interleaved = stages > ranks;
  if (stages > MAX_DRAWN.stages || microbatches > MAX_DRAWN.microbatches) {
    return (
      <p className="muted" data-testid="schedule">
        {schedule}: {stages} stages × {microbatches} micro-batches, too many to draw.
      </p>
    );
  }
  const { cells, steps, idle } = pipelineSchedule(schedule, stages, microbatches, ranks);
  const width = CELL.left + steps * CELL.w + 4;
  const height = CELL.top + ranks * CELL.h + 4;
  return (
    <figure className="schedule" data-testid="schedule" data-schedule={schedule} data-steps={steps}>
      <svg width={width} height={height} role="img"
        aria-label={`${schedule} schedule: ${stages} stages, ${microbatches} micro-batches, ${steps} steps`}>
        <text x={CELL.left} y={12} className="schedule-axis">time →</text>
        {Array.from({ length: ranks }, (_, r) => (
          <text key={r} x={4} y={CELL.top + r * CELL.h + 15} className="schedule-axis">
            {interleaved ? `rank ${r}` : `stage ${r}`}
          </text>
        ))}
        {cells.map((c) => (
          <g key={`${c.kind}${c.stage}:${c.mb}`} data-kind={c.kind} data-stage={c.stage} data-rank={c.rank} data-mb={c.mb}>
            <title>{`stage ${c.stage}, micro-batch ${c.mb}: ${c.kind === "F" ? "forward" : "backward"}`}</title>
            <rect x={CELL.left + c.t * CELL.w} y={CELL.top + c.rank * CELL.h} width={CELL.w - 2} height={CELL.h - 2}
              rx={3} className={`${c.kind === "F" ? "cell-forward" : "cell-backward"}${
                interleaved && Math.floor(c.stage / ranks) % 2 ? " cell-later" : ""}`} />
            <text x={CELL.left + c.t * CELL.w + (CELL.w - 2) / 2} y={CELL.top + c.rank * CELL.h + 14}
              textAnchor="middle" className="schedule-cell">{c.kind}{c.mb}</text>
          </g>
        ))}
      </svg>
      <figcaption className="muted small">
        {schedule}, {microbatches} micro-batches over {stages} stages
        {interleaved ? ` on ${ranks} ranks (rank r runs stages r, r + ${ranks}, …; a later stage's cells darker)` : ""}:{" "}
        {steps} steps of one forward (F) or backward (B) each, {Math.round(idle * 100)}% of the{" "}
        {interleaved ? "ranks'" : "stages'"} time idle (the bubble).
      </figcaption>
    </figure>
  );
}

// parallelism="AUTO": the mode the server chose as it placed the job, and why (the job's `auto`).
function AutoChoice({ job }) {
  if (job.auto) {
    return (
      <p data-testid="auto-choice" data-mode={job.auto.parallelism}>
        <strong>AUTO chose {job.auto.parallelism}</strong>{" "}
        <span className="muted">{job.auto.reason.replace(/^[^:]*: /, "")}</span>
      </p>
    );
  }
  if (job.spec?.parallelism !== Parallelism.AUTO) return null;
  return <p className="muted" data-testid="auto-choice">AUTO: the mode is chosen as the job is placed.</p>;
}

export default function Plan({ job }) {
  const columns = planColumns(job);
  if (!columns.length) {
    return (
      <>
        <AutoChoice job={job} />
        <p className="muted">Drawn once the job is placed: which rank holds what, where.</p>
      </>
    );
  }
  const settings = scheduleOf(job);
  return (
    <div data-testid="plan">
      <AutoChoice job={job} />
      <div className="plan">
        {columns.map((c) => (
          <div className="plan-client" key={c.id} data-testid="plan-client" data-client={c.id}>
            <div className="placement-host">
              <strong>{c.hostname || c.id}</strong> <span className="muted mono">{c.id}</span>
            </div>
            {c.ranks.map((p) => (
              <RankBox key={p.rank} place={p} />
            ))}
          </div>
        ))}
      </div>
      {settings && (
        <>
          <h3>Stage order</h3>
          <StageOrder job={job} />
          <h3>Micro-batch schedule</h3>
          <Schedule settings={settings} />
        </>
      )}
    </div>
  );
}
