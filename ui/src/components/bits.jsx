// Small shared pieces: status badges, notices, the copy button.
import { useState } from "react";

export function StatusBadge({ status }) {
  return <span className={`badge badge-${status}`}>{status}</span>;
}

/** A message box: kind is "error", "empty", "info" or "warning". */
export function Notice({ kind = "info", title, children, testId }) {
  return (
    <div className={`notice notice-${kind}`} role={kind === "error" ? "alert" : "status"} data-testid={testId}>
      {title && <strong>{title}</strong>}
      {children && <div>{children}</div>}
    </div>
  );
}

export function CopyButton({ text, label = "Copy" }) {
  const [copied, setCopied] = useState(null);
  const copy = async () => {
    try {
      await navigator.clipboard.writeText(text);
      setCopied("Copied");
    } catch {
      setCopied("Select and copy it by hand");
    }
    setTimeout(() => setCopied(null), 2500);
  };
  return (
    <button type="button" className="button-secondary" onClick={copy}>
      {copied || label}
    </button>
  );
}

export function Loading({ what }) {
  return <p className="muted">Loading {what}…</p>;
}
