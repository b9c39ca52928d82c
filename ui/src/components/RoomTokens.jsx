// The room's tokens (GET /room/tokens): name, role, when made, rotated, revoked; never a secret.
// Making, revoking and rotating them is `zwdx room tokens ...` (or the SDK's zwdx.tokens).
import { useEffect, useState } from "react";
import { api } from "../lib/api.js";
import { formatTime } from "../lib/format.js";
import { Loading, Notice } from "./bits.jsx";

const ROLE = {
  submitter: "submits, reads jobs, opens the dashboard",
  donor: "connects GPU clients, nothing else",
};

export default function RoomTokens() {
  const [tokens, setTokens] = useState(null);
  const [error, setError] = useState(null);
  useEffect(() => {
    let current = true;
    api.tokens().then(
      (answer) => current && setTokens(answer.tokens),
      (err) => current && setError(err.message),
    );
    return () => {
      current = false;
    };
  }, []);
  if (error) return <Notice kind="error" title="Cannot list the room's tokens">{error}</Notice>;
  if (tokens === null) return <Loading what="tokens" />;
  return (
    <>
      <table className="table" data-testid="tokens">
        <thead>
          <tr>
            <th>Name</th>
            <th>Role</th>
            <th>Made</th>
            <th>Rotated</th>
            <th>Revoked</th>
            <th />
          </tr>
        </thead>
        <tbody>
          {tokens.map((t) => (
            <tr key={t.id} data-testid="token-row" className={t.revoked_at ? "muted" : ""}>
              <td>
                {t.name || <span className="muted">(no name)</span>} <span className="mono muted small">{t.id}</span>
              </td>
              <td title={t.legacy ? "a token of a room made before tokens had roles" : ROLE[t.role]}>
                {t.legacy ? "legacy: submitter and donor" : t.role}
              </td>
              <td>{formatTime(t.created_at)}</td>
              <td>{t.rotated_at ? formatTime(t.rotated_at) : "—"}</td>
              <td>{t.revoked_at ? formatTime(t.revoked_at) : "—"}</td>
              <td className="small">{t.own ? "signed in with it" : ""}</td>
            </tr>
          ))}
        </tbody>
      </table>
      {tokens.some((t) => t.legacy && !t.revoked_at) && (
        <Notice kind="warning" title="A legacy token is in use" testId="legacy-token">
          It opens this room both as a submitter and as a GPU client. Rotate it into a submitter and a donor token:{" "}
          <code>zwdx room tokens rotate ID</code>, then give the donor token to the GPU clients.
        </Notice>
      )}
      <p className="muted small">
        Make, revoke or rotate them with <code>zwdx room tokens create|revoke|rotate</code> (or the SDK&apos;s{" "}
        <code>zwdx.tokens</code>); a revoked token opens nothing, and the connections made with it close.
      </p>
    </>
  );
}
