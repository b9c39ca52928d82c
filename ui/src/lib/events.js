// Merging a job's events as they arrive over REST and Socket.IO: ordered by seq, each once.

export function mergeEvents(existing, incoming) {
  if (!incoming?.length) return existing;
  const last = existing.length ? existing[existing.length - 1].seq : 0;
  // The usual case: new events after the ones already held, in order.
  if (incoming[0].seq > last && incoming.every((e, i) => i === 0 || e.seq > incoming[i - 1].seq)) {
    return existing.concat(incoming);
  }
  const bySeq = new Map(existing.map((e) => [e.seq, e]));
  for (const e of incoming) bySeq.set(e.seq, e);
  return [...bySeq.values()].sort((a, b) => a.seq - b.seq);
}

export const lastSeq = (events) => (events.length ? events[events.length - 1].seq : 0);
