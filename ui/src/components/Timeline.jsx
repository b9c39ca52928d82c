// A job's status changes with their times (and the offset from submission).
import { formatDuration, formatTime } from "../lib/format.js";
import { StatusBadge } from "./bits.jsx";

export default function Timeline({ timeline }) {
  const start = timeline?.[0]?.at;
  return (
    <ol className="timeline" data-testid="timeline">
      {(timeline || []).map((t, i) => (
        <li key={i} data-status={t.status}>
          <StatusBadge status={t.status} />
          <span className="mono">{formatTime(t.at)}</span>
          {i > 0 && <span className="muted">+{formatDuration(t.at - start)}</span>}
          {t.reason && <span className="muted">{t.reason}</span>}
        </li>
      ))}
    </ol>
  );
}
