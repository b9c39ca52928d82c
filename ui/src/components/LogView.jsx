// The job's log lines, following the end while the user is at the end.
import { useEffect, useRef } from "react";
import { formatTime } from "../lib/format.js";

const SHOWN = 2000;

export default function LogView({ lines }) {
  const box = useRef(null);
  const atEnd = useRef(true);
  useEffect(() => {
    const el = box.current;
    if (el && atEnd.current) el.scrollTop = el.scrollHeight;
  }, [lines]);
  if (!lines.length) return <p className="muted">No log lines yet. What the ranks print shows up here.</p>;
  const shown = lines.slice(-SHOWN);
  return (
    <div
      className="logs"
      ref={box}
      data-testid="logs"
      onScroll={(e) => {
        const el = e.currentTarget;
        atEnd.current = el.scrollHeight - el.scrollTop - el.clientHeight < 20;
      }}
    >
      {lines.length > SHOWN && <div className="muted">… {lines.length - SHOWN} earlier lines not shown</div>}
      {shown.map((ev) => (
        <div className="log-line" key={ev.seq}>
          <span className="muted">{formatTime(ev.ts)}</span> <span className="rank-tag">{ev.rank === null || ev.rank === undefined ? "server" : `rank ${ev.rank}`}</span>{" "}
          {ev.data?.text}
        </div>
      ))}
    </div>
  );
}
