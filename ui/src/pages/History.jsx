// Past jobs: name, duration, result (final loss, else the first numeric result), world size,
// parallelism, mean throughput; sortable, filterable.
import { useCallback, useEffect, useMemo, useState } from "react";
import { Link } from "react-router-dom";
import { api } from "../lib/api.js";
import { formatDuration, formatNumber, formatTime } from "../lib/format.js";
import { FINISHED, HISTORY_COLUMNS, historyRows, isFinished, jobLabel, resultText } from "../lib/jobs.js";
import { useLive } from "../lib/LiveProvider.jsx";
import { Loading, Notice, StatusBadge } from "../components/bits.jsx";

function cell(row, key) {
  switch (key) {
    case "created_at":
      return formatTime(row.created_at);
    case "name":
      return (
        <>
          <Link to={`/jobs/${row.id}`}>{jobLabel(row)}</Link>
          {row.name ? <span className="mono muted small job-id"> {row.id}</span> : null}
        </>
      );
    case "status":
      return <StatusBadge status={row.status} />;
    case "duration":
      return formatDuration(row.duration);
    case "mean_throughput":
      return row.mean_throughput == null ? "—" : `${formatNumber(row.mean_throughput)} samples/s`;
    case "result":
      return resultText(row.result, formatNumber);
    default:
      return row[key] ?? "—";
  }
}

export default function History() {
  const { jobs } = useLive();
  const [rows, setRows] = useState(null);
  const [error, setError] = useState(null);
  const [statuses, setStatuses] = useState([]);
  const [sort, setSort] = useState({ key: "created_at", dir: "desc" });

  const load = useCallback(() => api.history().then((r) => setRows(r.jobs), setError), []);
  // Reload when a job finishes (job_update over Socket.IO), not on a timer.
  const finishedCount = useMemo(() => Object.values(jobs).filter(isFinished).length, [jobs]);
  useEffect(() => {
    load();
  }, [load, finishedCount]);

  const shown = useMemo(() => historyRows(rows || [], { statuses, ...sort }), [rows, statuses, sort]);
  const toggleStatus = (s) => setStatuses((cur) => (cur.includes(s) ? cur.filter((x) => x !== s) : [...cur, s]));
  const sortBy = (key) =>
    setSort((cur) => (cur.key === key ? { key, dir: cur.dir === "asc" ? "desc" : "asc" } : { key, dir: "desc" }));

  return (
    <div data-testid="history">
      <header className="page-head">
        <h1>History</h1>
        <div className="filters" role="group" aria-label="filter by status">
          {FINISHED.map((s) => (
            <label key={s} className="chip">
              <input type="checkbox" checked={statuses.includes(s)} onChange={() => toggleStatus(s)} /> {s}
            </label>
          ))}
        </div>
      </header>
      {error && <Notice kind="error" title="Cannot load the history">{error.message}</Notice>}
      {rows === null && !error && <Loading what="the history" />}
      {rows !== null && !rows.length && (
        <Notice kind="empty" title="No finished jobs yet" testId="no-history">
          Jobs show up here once they complete, fail or are cancelled.
        </Notice>
      )}
      {rows !== null && rows.length > 0 && (
        <table className="table history" data-testid="history-table">
          <thead>
            <tr>
              {HISTORY_COLUMNS.map((c) => (
                <th key={c.key} aria-sort={sort.key === c.key ? (sort.dir === "asc" ? "ascending" : "descending") : "none"}>
                  <button type="button" className="sort" onClick={() => sortBy(c.key)}>
                    {c.label}
                    <span className="sort-mark">{sort.key === c.key ? (sort.dir === "asc" ? "▲" : "▼") : ""}</span>
                  </button>
                </th>
              ))}
            </tr>
          </thead>
          <tbody>
            {shown.map((row) => (
              <tr key={row.id} data-testid="history-row" data-status={row.status}>
                {HISTORY_COLUMNS.map((c) => (
                  <td key={c.key}>{cell(row, c.key)}</td>
                ))}
              </tr>
            ))}
            {!shown.length && (
              <tr>
                <td colSpan={HISTORY_COLUMNS.length} className="muted">
                  No job with the chosen status.
                </td>
              </tr>
            )}
          </tbody>
        </table>
      )}
    </div>
  );
}
