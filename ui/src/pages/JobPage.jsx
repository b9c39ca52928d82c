// One job: status and timeline, live metric charts, placement, its plan (what each rank holds), logs,
// failures, cancel, weights.
import { useEffect, useMemo, useState } from "react";
import { Link, useParams } from "react-router-dom";
import { api } from "../lib/api.js";
import { lastSeq } from "../lib/events.js";
import { formatBytes, formatDuration, formatNumber, formatTime } from "../lib/format.js";
import { WAITING, failuresInOrder, isFinished, jobDuration, jobMode, queuePosition } from "../lib/jobs.js";
import { EventKind, JobStatus } from "../lib/protocol.js";
import { useLive } from "../lib/LiveProvider.jsx";
import { chartData, hasEpochs, latestValues, metricLabel, metricNames, metricPoints } from "../lib/metrics.js";
import { useJobEvents } from "../lib/useJobEvents.js";
import Chart from "../components/Chart.jsx";
import LogView from "../components/LogView.jsx";
import Placement from "../components/Placement.jsx";
import Plan from "../components/Plan.jsx";
import Timeline from "../components/Timeline.jsx";
import { Loading, Notice, StatusBadge } from "../components/bits.jsx";

function Metrics({ events }) {
  const points = useMemo(() => metricPoints(events), [events]);
  const epochs = hasEpochs(points);
  const [mode, setMode] = useState("step");
  const xMode = epochs ? mode : "step";
  const names = metricNames(points);
  const charts = useMemo(() => names.map((n) => [n, chartData(points.get(n), xMode)]), [points, xMode]); // eslint-disable-line react-hooks/exhaustive-deps
  const latest = latestValues(points);
  if (!names.length) return <p className="muted">No metrics yet. Curves appear as soon as the ranks report them.</p>;
  return (
    <>
      <div className="toolbar">
        <table className="table latest" data-testid="latest-metrics">
          <thead>
            <tr>
              <th>Metric</th>
              <th>Latest</th>
              <th>Step</th>
              <th>Rank</th>
              <th>Reported</th>
            </tr>
          </thead>
          <tbody>
            {names.map((n) => {
              const p = latest.get(n);
              return (
                <tr key={n} data-metric={n} data-seq={p.seq}>
                  <td>{metricLabel(n)}</td>
                  <td className="mono">{Number.isFinite(p.reported) ? formatNumber(p.reported) : String(p.reported)}</td>
                  <td>{p.step}</td>
                  <td>{p.rank}</td>
                  <td className="muted">{formatTime(p.ts)}</td>
                </tr>
              );
            })}
          </tbody>
        </table>
        {epochs && (
          <div className="segmented" role="group" aria-label="x axis">
            {["step", "epoch"].map((m) => (
              <button key={m} type="button" aria-pressed={xMode === m} onClick={() => setMode(m)}>
                by {m}
              </button>
            ))}
          </div>
        )}
      </div>
      <div className="charts">
        {charts.map(([name, c]) => (
          <Chart
            key={name}
            testId={`chart-${name}`}
            title={metricLabel(name)}
            data={c.data}
            labels={c.ranks.map((r) => `rank ${r}`)}
            xLabel={xMode === "epoch" ? "epoch (mean)" : "step"}
          />
        ))}
      </div>
    </>
  );
}

function Failure({ job }) {
  const failures = failuresInOrder(job);
  if (job.status !== JobStatus.FAILED && !failures.length) return null;
  return (
    <section className="card failure" data-testid="failure">
      <h2>Failure</h2>
      {job.reason && <p className="failure-reason">{job.reason}</p>}
      {failures.map(([rank, tb]) => (
        <details key={rank} open>
          <summary>rank {rank}</summary>
          <pre className="traceback">{tb}</pre>
        </details>
      ))}
    </section>
  );
}

// What to know about the result: warnings (the ranks' final weights differ, the weights that came
// back are not theirs) and the ranks the server named dishonest (zwdx/server/suspects.py), in
// every attempt: an entry's key is its rank, or "<rank>@<attempt>" after the first naming there.
function Suspects({ job }) {
  const suspects = Object.entries(job.suspects || {})
    .map(([key, s]) => [key, { ...s, rank: s.rank ?? Number(key.split("@")[0]), attempt: s.attempt ?? 0 }])
    .sort(([, a], [, b]) => a.attempt - b.attempt || a.rank - b.rank);
  const warnings = job.warnings || [];
  if (!suspects.length && !warnings.length) return null;
  return (
    <section className="card failure" data-testid="suspects">
      <h2>Trust</h2>
      {warnings.map((w) => <p key={w} className="failure-reason">{w}</p>)}
      <ul>
        {suspects.map(([key, s]) => (
          <li key={key}>
            rank {s.rank} (GPU client {s.client_id || "?"}),{" "}
            {s.rounds?.length ? `rounds ${s.rounds.join(", ")}` : "at the end"}
            {s.attempt ? `, attempt ${s.attempt}` : ""}: {s.reason}
            {s.rounds?.length ? "; dropped" : ""}
          </li>
        ))}
      </ul>
    </section>
  );
}

function Actions({ job, putJob }) {
  const [confirming, setConfirming] = useState(false);
  const [error, setError] = useState(null);
  const [downloading, setDownloading] = useState(false);

  const cancel = async () => {
    setError(null);
    try {
      putJob(await api.cancel(job.id));
    } catch (err) {
      setError(err.message);
    }
    setConfirming(false);
  };

  const download = async () => {
    setError(null);
    setDownloading(true);
    try {
      const blob = await (await api.weights(job.id)).blob();
      const url = URL.createObjectURL(blob);
      const a = document.createElement("a");
      a.href = url;
      a.download = `${job.name || job.id}.safetensors`;
      document.body.appendChild(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 30000);
    } catch (err) {
      setError(err.message);
    }
    setDownloading(false);
  };

  return (
    <div className="actions">
      {!isFinished(job) &&
        (confirming ? (
          <>
            <span>Cancel this job? Its ranks are stopped.</span>
            <button type="button" className="button-danger" onClick={cancel}>
              Yes, cancel it
            </button>
            <button type="button" className="button-secondary" onClick={() => setConfirming(false)}>
              Keep it
            </button>
          </>
        ) : (
          <button type="button" className="button-danger" onClick={() => setConfirming(true)}>
            Cancel job
          </button>
        ))}
      {job.weights_artifact && (
        <button type="button" onClick={download} disabled={downloading} data-testid="download-weights">
          {downloading ? "Downloading…" : "Download trained weights (.safetensors)"}
        </button>
      )}
      {error && <Notice kind="error">{error}</Notice>}
    </div>
  );
}

function Facts({ job, position }) {
  const spec = job.spec || {};
  const resources = spec.resources || {};
  const facts = [
    ["Parallelism", jobMode(spec)],
    ["World size", `${job.world_size ?? "—"} (requested ${resources.world_size ?? "all free"})`],
    ["Epochs", spec.training?.epochs ?? "train_func's default"],
    ["Memory per rank", resources.memory_required ? formatBytes(resources.memory_required) : "any"],
    ["Backend", job.backend || "—"],
    ["Bundle", formatBytes(spec.code?.bundle_size)],
    ["Submitted", formatTime(job.created_at)],
    ["Duration", formatDuration(jobDuration(job))],
    ["Final loss", formatNumber(job.final_loss)],
  ];
  if (position) facts.unshift(["Queue position", position]);
  for (const [k, v] of Object.entries(job.results || {})) {
    if (k !== "final_loss") facts.push([k, typeof v === "number" ? formatNumber(v) : String(v)]);
  }
  return (
    <dl className="facts">
      {facts.map(([k, v]) => (
        <div key={k}>
          <dt>{k}</dt>
          <dd>{v ?? "—"}</dd>
        </div>
      ))}
    </dl>
  );
}

export default function JobPage() {
  const { jobId } = useParams();
  const { jobs, putJob } = useLive();
  const [loadError, setLoadError] = useState(null);
  const { events, error: eventsError } = useJobEvents(jobId);
  const logs = useMemo(() => events.filter((e) => e.kind === EventKind.LOG), [events]);
  const metricEvents = useMemo(() => events.filter((e) => e.kind === EventKind.METRIC), [events]);

  useEffect(() => {
    setLoadError(null);
    api.job(jobId).then(putJob, setLoadError);
  }, [jobId, putJob]);

  const job = jobs[jobId];
  if (loadError && !job) {
    return (
      <Notice kind="error" title={loadError.status === 404 ? "No such job" : "Cannot load the job"}>
        {loadError.status === 404 ? `There is no job ${jobId} in this room.` : loadError.message}{" "}
        <Link to="/">Back to the room</Link>
      </Notice>
    );
  }
  if (!job) return <Loading what={`job ${jobId}`} />;
  const waiting = WAITING.includes(job.status);
  const position = waiting ? queuePosition(Object.values(jobs), job.id) ?? job.queue_position : null;

  return (
    <div data-testid="job-page" data-status={job.status} data-last-seq={lastSeq(events)}>
      <header className="page-head">
        <h1>{job.name || `Job ${job.id}`}</h1>
        <StatusBadge status={job.status} />
        <span className="mono muted">{job.id}</span>
      </header>
      {waiting && (
        <Notice kind="info" title={`${job.status === JobStatus.QUEUED ? "Queued" : "Resuming"}${position ? `, position ${position} in the queue` : ""}`}>
          {job.waiting_reason || "Waiting for free slots."}
        </Notice>
      )}
      <Actions job={job} putJob={putJob} />
      <div className="grid-2">
        <section className="card">
          <h2>Job</h2>
          <Facts job={job} position={position} />
        </section>
        <section className="card">
          <h2>Timeline</h2>
          <Timeline timeline={job.timeline} />
        </section>
      </div>
      <Failure job={job} />
      <Suspects job={job} />
      <section className="card">
        <h2>Metrics</h2>
        {eventsError && <Notice kind="error">Cannot load the job's events: {eventsError.message}</Notice>}
        <Metrics events={metricEvents} />
      </section>
      <section className="card">
        <h2>Placement</h2>
        <Placement placement={job.placement} ranks={job.ranks} />
      </section>
      <section className="card">
        <h2>Plan</h2>
        <Plan job={job} />
      </section>
      <section className="card">
        <h2>Logs</h2>
        <LogView lines={logs} />
      </section>
    </div>
  );
}
