// The room at a glance: GPU clients and their slots (live), and the job queue.
import { Link } from "react-router-dom";
import { useEffect, useState } from "react";
import { api } from "../lib/api.js";
import { useAuth } from "../lib/auth.jsx";
import { useLive } from "../lib/LiveProvider.jsx";
import { formatAgo, formatBytes, formatIsolation, formatLink, formatNumber, formatTerms, formatTime } from "../lib/format.js";
import { queueOf } from "../lib/jobs.js";
import { ClientStatus, SlotKind } from "../lib/protocol.js";
import RoomTokens from "../components/RoomTokens.jsx";
import Sparkline from "../components/Sparkline.jsx";
import { Loading, Notice, StatusBadge } from "../components/bits.jsx";

function useNow(intervalMs = 1000) {
  const [now, setNow] = useState(() => Date.now() / 1000);
  useEffect(() => {
    const id = setInterval(() => setNow(Date.now() / 1000), intervalMs);
    return () => clearInterval(id);
  }, [intervalMs]);
  return now;
}

function SlotRow({ slot, history, jobs }) {
  const used = slot.memory_total ? (slot.memory_total - slot.memory_free) / slot.memory_total : 0;
  const hasUtil = slot.utilization !== null && slot.utilization !== undefined;
  const job = slot.job_id ? jobs[slot.job_id] : null;
  const samples = history || { t: [], util: [], mem: [] };
  return (
    <tr data-testid="slot">
      <td className="mono">
        {slot.kind === SlotKind.CPU ? "cpu" : "gpu"} {slot.index}
      </td>
      <td>
        {slot.name || "—"}
        {slot.isolation && (
          <span
            className="isolation-tag"
            data-testid="isolation"
            title={slot.terms ? `a container per rank: ${formatTerms(slot.terms)}` : "how job code here is kept from the GPU client and other jobs"}
          >
            {formatIsolation(slot.isolation)}
          </span>
        )}
      </td>
      <td>
        <div className="membar" title={`${Math.round(used * 100)} % used`}>
          <div style={{ width: `${Math.round(used * 100)}%` }} />
        </div>
        <span className="small">
          {formatBytes(slot.memory_free)} free of {formatBytes(slot.memory_total)}
        </span>
      </td>
      <td>
        <div className="util">
        {hasUtil ? (
          <>
            <span className="util-value">{formatNumber(slot.utilization)} %</span>
            <Sparkline xs={samples.t} ys={samples.util} label={`utilisation of ${slot.name}`} />
          </>
        ) : (
          <>
            <span className="muted small util-value" title="CPU slots report no utilisation; the line is memory in use">
              n/a · mem {Math.round(used * 100)} %
            </span>
            <Sparkline xs={samples.t} ys={samples.mem} color="#868e96" label={`memory in use on ${slot.name}`} />
          </>
        )}
        </div>
      </td>
      <td>
        {slot.job_id ? (
          <Link to={`/jobs/${slot.job_id}`}>
            {job?.name || slot.job_id} <span className="rank-tag">rank {slot.rank}</span>
          </Link>
        ) : (
          <span className="muted">idle</span>
        )}
      </td>
    </tr>
  );
}

function Clients({ clients, slotHistory, jobs, now }) {
  if (clients === null) return <Loading what="GPU clients" />;
  if (!clients.length) {
    return (
      <Notice kind="empty" title="No GPU clients in this room yet" testId="no-clients">
        Lend a GPU by running, on the machine that has it, with the room&apos;s donor token (<code>zd_…</code>) in a
        file only you can read (a command line is visible to every user of the machine):
        <pre className="cmd">zwdx gpu-client --server {window.location.origin} --room-token-file donor-token</pre>
      </Notice>
    );
  }
  const sorted = [...clients].sort((a, b) => (a.status === b.status ? a.id.localeCompare(b.id) : a.status === ClientStatus.ONLINE ? -1 : 1));
  return sorted.map((c) => (
    <div className={`card client client-${c.status}`} key={c.id} data-testid="client" data-status={c.status}>
      <div className="client-head">
        <span className={`dot dot-${c.status}`} />
        <strong>{c.hostname || c.id}</strong>
        <span className="mono muted">{c.id}</span>
        <span className={`badge badge-${c.status}`}>{c.status}</span>
        <span className="muted small">last seen {formatAgo(c.last_seen, now)}</span>
        {c.link && (
          <span className="muted small" data-testid="link" title="its link to the server, measured as it registered">
            {formatLink(c.link)}
          </span>
        )}
        <span className="muted small right">
          {Object.entries(c.versions || {})
            .map(([k, v]) => `${k} ${v}`)
            .join(" · ")}
        </span>
      </div>
      {c.unreachable?.length > 0 && (
        <div className="muted small" data-testid="unreachable">
          cannot reach {c.unreachable.join(", ")}: DDP/FSDP jobs keep them apart (DILOCO goes anywhere)
        </div>
      )}
      <table className="slots">
        <thead>
          <tr>
            <th>Slot</th>
            <th>Name</th>
            <th>Memory</th>
            <th>Utilisation</th>
            <th>Job</th>
          </tr>
        </thead>
        <tbody>
          {(c.slots || []).map((s) => (
            <SlotRow key={s.id} slot={s} history={slotHistory[s.id]} jobs={jobs} />
          ))}
        </tbody>
      </table>
    </div>
  ));
}

function Queue({ jobs }) {
  const queue = queueOf(Object.values(jobs));
  if (!queue.length) {
    return (
      <Notice kind="empty" title="No jobs queued or running" testId="no-jobs">
        Submit one from Python: <code>ZWDX(server_url).submit_job(model=..., room_token=...)</code>. Finished jobs
        are in the <Link to="/history">history</Link>.
      </Notice>
    );
  }
  return (
    <table className="table" data-testid="queue">
      <thead>
        <tr>
          <th>#</th>
          <th>Job</th>
          <th>Status</th>
          <th>World size (requested)</th>
          <th>Memory / rank</th>
          <th>Submitted</th>
          <th>Note</th>
        </tr>
      </thead>
      <tbody>
        {queue.map((j) => (
          <tr key={j.id} data-testid="queue-row">
            <td>{j.position ?? "—"}</td>
            <td>
              <Link to={`/jobs/${j.id}`}>{j.name || j.id}</Link>
            </td>
            <td>
              <StatusBadge status={j.status} />
            </td>
            <td>
              {j.spec?.resources?.world_size ?? "all free"}
              {j.world_size ? <span className="muted small"> · {j.world_size} placed</span> : null}
            </td>
            <td>{j.spec?.resources?.memory_required ? formatBytes(j.spec.resources.memory_required) : "any"}</td>
            <td>{formatTime(j.created_at)}</td>
            <td className="muted small">{j.waiting_reason || ""}</td>
          </tr>
        ))}
      </tbody>
    </table>
  );
}

/** What the room uses of its quotas (GET /room's `usage`), asked again whenever the number of
 * its jobs waiting or running changes. */
function useUsage(jobs) {
  const open = queueOf(Object.values(jobs)).length;
  const [usage, setUsage] = useState(null);
  useEffect(() => {
    let current = true;
    api.room().then((r) => current && setUsage(r.usage ?? null), () => {});
    return () => {
      current = false;
    };
  }, [open]);
  return usage;
}

/** The owner drops the room's offline GPU clients from its list (POST /room/clients/prune); the
 * list itself follows over Socket.IO. One that comes back registers again. */
function PruneOffline({ offline }) {
  const [said, setSaid] = useState(null);
  const [busy, setBusy] = useState(false);
  if (!offline && !said) return null;
  const prune = async () => {
    setBusy(true);
    try {
      const { pruned } = await api.pruneClients();
      setSaid(`${pruned.length} offline GPU client${pruned.length === 1 ? "" : "s"} dropped`);
    } catch (err) {
      setSaid(`not pruned: ${err.message}`);
    } finally {
      setBusy(false);
    }
  };
  return (
    <span className="stat">
      {offline > 0 && (
        <button type="button" data-testid="prune-clients" disabled={busy} onClick={prune}
                title="drop the GPU clients offline now (those running no ranks) from the room's list; one that comes back registers again">
          Prune offline
        </button>
      )}
      {said && <span className="muted small" data-testid="pruned"> {said}</span>}
    </span>
  );
}

const ofLimit = (used, limit, format) => (limit ? `${format(used)} / ${format(limit)}` : `${format(used)} (no limit)`);

function Usage({ usage }) {
  if (!usage) return null;
  return (
    <>
      <div className="stat" data-testid="quota-jobs" title="jobs waiting or running, and the most this room may have at once">
        <b>{ofLimit(usage.jobs, usage.jobs_limit, String)}</b> jobs
      </div>
      <div className="stat" data-testid="quota-artifacts"
           title="bundles, checkpoints, weights and metric and log events this room keeps, and its quota">
        <b>{ofLimit(usage.artifact_bytes + (usage.event_bytes ?? 0), usage.artifact_bytes_limit, formatBytes)}</b> stored
      </div>
      <div className="stat" data-testid="quota-events" title="metric and log events this room's jobs keep, and its quota">
        <b>{ofLimit(usage.events ?? 0, usage.events_limit ?? 0, String)}</b> events
      </div>
    </>
  );
}

export default function Overview() {
  const { room } = useAuth();
  const { clients, totals, slotHistory, jobs } = useLive();
  const usage = useUsage(jobs);
  const now = useNow();
  const online = (clients || []).filter((c) => c.status === ClientStatus.ONLINE).length;
  const slots = (clients || []).filter((c) => c.status === ClientStatus.ONLINE).flatMap((c) => c.slots || []);
  const busy = slots.filter((s) => s.job_id).length;
  return (
    <div data-testid="overview">
      <header className="page-head">
        <h1>{room?.name || "Room"}</h1>
        <span className="muted mono">{room?.id}</span>
        {room?.created_at && <span className="muted small">created {formatTime(room.created_at)}</span>}
      </header>
      <div className="stats">
        <div className="stat" data-testid="stat-online">
          <b>{online}</b> GPU client{online === 1 ? "" : "s"} online
        </div>
        <div className="stat">
          <b>{(clients || []).length - online}</b> offline
        </div>
        <PruneOffline offline={(clients || []).length - online} />
        <div className="stat">
          <b>{busy}</b> / {slots.length} slots busy
        </div>
        {totals && (
          <div className="stat" data-testid="stat-memory" title="GPU memory, plus the RAM of each host with CPU slots, counted once per host">
            <b>{formatBytes(totals.memory_free)}</b> free of {formatBytes(totals.memory_total)} memory
          </div>
        )}
        <Usage usage={usage} />
      </div>
      <section>
        <h2>GPU clients</h2>
        <Clients clients={clients} slotHistory={slotHistory} jobs={jobs} now={now} />
      </section>
      <section>
        <h2>Job queue</h2>
        <Queue jobs={jobs} />
      </section>
      <section>
        <h2>Tokens</h2>
        <RoomTokens />
      </section>
    </div>
  );
}
