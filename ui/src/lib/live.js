// The room's live state, fed by Socket.IO (namespace /ui) and the REST answers that seed it.
import { mergeJob } from "./jobs.js";
import { ClientStatus } from "./protocol.js";

/** Samples kept per slot for its sparkline (the server pushes about one every 2 s). */
export const SPARK_SAMPLES = 60;

export const initialLive = {
  connection: "connecting", // connecting | online | reconnecting | refused
  error: null,
  clients: null, // null until the first answer: "loading", not "empty"
  totals: null, // what the online GPU clients offer in all (a host's RAM counted once), from the server
  jobs: {}, // id -> job
  slotHistory: {}, // slot id -> {t: [], util: [], mem: []}
};

function appendSample(history, slot, at) {
  const prev = history[slot.id] || { t: [], util: [], mem: [] };
  const used = slot.memory_total ? (100 * (slot.memory_total - slot.memory_free)) / slot.memory_total : null;
  const keep = (arr, v) => [...arr, v].slice(-SPARK_SAMPLES);
  return { t: keep(prev.t, at), util: keep(prev.util, slot.utilization ?? null), mem: keep(prev.mem, used) };
}

/** A push of what changed (``full: false``) laid over the list held: changed and new clients
 * replace theirs (new ones last), ``removed`` ids go. */
function mergeClients(held, { clients, removed = [] }) {
  const byId = new Map(held.map((c) => [c.id, c]));
  for (const id of removed) byId.delete(id);
  for (const c of clients) byId.set(c.id, c);
  return [...byId.values()];
}

export function liveReducer(state, action) {
  switch (action.type) {
    case "connection":
      return { ...state, connection: action.status, error: action.error ?? null };
    case "clients": {
      const clients = action.full === false && state.clients ? mergeClients(state.clients, action) : action.clients;
      const slotHistory = { ...state.slotHistory };
      for (const client of clients) {
        if (client.status !== ClientStatus.ONLINE) continue;
        for (const slot of client.slots || []) slotHistory[slot.id] = appendSample(slotHistory, slot, action.at);
      }
      return { ...state, clients, totals: action.totals ?? null, slotHistory };
    }
    case "jobs": {
      const jobs = { ...state.jobs };
      for (const job of action.jobs) jobs[job.id] = mergeJob(jobs[job.id], job);
      return { ...state, jobs };
    }
    case "job":
      return { ...state, jobs: { ...state.jobs, [action.job.id]: mergeJob(state.jobs[action.job.id], action.job) } };
    default:
      return state;
  }
}
