// Tells the user when the live connection is down; Socket.IO reconnects by itself.
import { useLive } from "../lib/LiveProvider.jsx";

export default function ConnectionBanner() {
  const { connection, error } = useLive();
  if (connection === "reconnecting") {
    return (
      <div className="banner banner-warning" role="alert" data-testid="connection-lost">
        Connection to the server lost — reconnecting… What you see may be out of date.
        {error && <span className="muted"> ({error})</span>}
      </div>
    );
  }
  if (connection === "connecting" && error) {
    return (
      <div className="banner banner-warning" role="alert" data-testid="connection-lost">
        Cannot reach the server yet — retrying… <span className="muted">({error})</span>
      </div>
    );
  }
  return null;
}

export function ConnectionDot() {
  const { connection } = useLive();
  const text = { online: "live", connecting: "connecting", reconnecting: "reconnecting", refused: "refused" }[connection];
  return (
    <span className={`conn conn-${connection}`} data-testid="connection-state" title="Socket.IO connection">
      <span className="dot" /> {text}
    </span>
  );
}
