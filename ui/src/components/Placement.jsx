// Which rank runs where: one box per GPU client, one tile per GPU with its rank, and how its
// slot kept it (a container's image and limits, as the rank's state recorded them at its start).
import { formatIsolation, formatTerms } from "../lib/format.js";
import { SlotKind } from "../lib/protocol.js";

export function groupPlacement(placement) {
  const clients = new Map();
  for (const p of placement || []) {
    if (!clients.has(p.client_id)) clients.set(p.client_id, { id: p.client_id, hostname: p.hostname, gpus: [] });
    clients.get(p.client_id).gpus.push(p);
  }
  for (const c of clients.values()) c.gpus.sort((a, b) => a.gpu_index - b.gpu_index);
  return [...clients.values()];
}

export default function Placement({ placement, ranks }) {
  const clients = groupPlacement(placement);
  if (!clients.length) return <p className="muted">Not placed yet: ranks get GPUs when the job starts.</p>;
  return (
    <div className="placement" data-testid="placement">
      {clients.map((c) => (
        <div className="placement-client" key={c.id}>
          <div className="placement-host">
            <strong>{c.hostname || c.id}</strong> <span className="muted mono">{c.id}</span>
          </div>
          <div className="placement-gpus">
            {c.gpus.map((g) => (
              <div className={`placement-gpu kind-${g.kind}`} key={`${g.gpu_index}-${g.rank}`}>
                <span className="rank-tag">rank {g.rank}</span>
                <span>
                  {g.kind === SlotKind.CPU ? "CPU" : "GPU"} {g.gpu_index}
                </span>
                <span className="muted small">{g.gpu_name}</span>
                <Kept state={(ranks || {})[String(g.rank)]} />
              </div>
            ))}
          </div>
        </div>
      ))}
    </div>
  );
}

function Kept({ state }) {
  if (!state || !state.isolation) return null;
  return (
    <span className="small" data-testid="rank-isolation">
      <span className="isolation-tag" title="how the rank was kept from its GPU client and other jobs">
        {formatIsolation(state.isolation)}
      </span>
      {state.terms && (
        <span className="muted mono" data-testid="terms">
          {" "}
          {formatTerms(state.terms)}
        </span>
      )}
    </span>
  );
}
