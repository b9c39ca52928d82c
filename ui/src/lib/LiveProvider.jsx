// One Socket.IO connection per signed-in tab (namespace /ui, the room token in `auth`).
// Room-wide state (clients, jobs) goes through a reducer; a job's events go straight to the
// pages that subscribed to that job, so a metric re-renders only the job page.
import { createContext, useCallback, useContext, useEffect, useMemo, useReducer, useRef } from "react";
import { io } from "socket.io-client";
import { api } from "./api.js";
import { isFinished } from "./jobs.js";
import { initialLive, liveReducer } from "./live.js";
import { ACTIVE, UI_NAMESPACE, UiEvent, WAITING } from "./protocol.js";

const UNFINISHED = [...WAITING, ...ACTIVE];

const LiveContext = createContext(null);

export function LiveProvider({ token, onRefused, children }) {
  const [state, dispatch] = useReducer(liveReducer, initialLive);
  const eventListeners = useRef(new Map()); // job id -> Set(fn)
  const resyncListeners = useRef(new Set());
  const refusedRef = useRef(onRefused);
  refusedRef.current = onRefused;

  const jobsRef = useRef(state.jobs);
  jobsRef.current = state.jobs;

  /** The unfinished jobs (finished ones are the history's); a job held as unfinished that is
   * no longer among them ended while we were away, so it is fetched again. */
  const refreshJobs = useCallback(async () => {
    let jobs;
    try {
      ({ jobs } = await api.jobs(UNFINISHED));
    } catch {
      return; // shown by the pages that need it; the next reconnect tries again
    }
    dispatch({ type: "jobs", jobs });
    const fresh = new Set(jobs.map((j) => j.id));
    for (const held of Object.values(jobsRef.current)) {
      if (!isFinished(held) && !fresh.has(held.id)) {
        api.job(held.id).then((job) => dispatch({ type: "job", job }), () => {});
      }
    }
  }, []);

  useEffect(() => {
    refreshJobs();
    api.room().then((r) => dispatch({ type: "clients", clients: r.clients, totals: r.totals, at: Date.now() / 1000 }), () => {});
    const socket = io(UI_NAMESPACE, { auth: { token }, reconnectionDelay: 500, reconnectionDelayMax: 3000 });
    let everConnected = false;

    socket.on("connect", () => {
      dispatch({ type: "connection", status: "online" });
      // Catch up on what changed before this connection joined the room's updates: while it was
      // down, and on the first connect since the fetch above (a job's change in between would
      // never be sent again).
      refreshJobs();
      resyncListeners.current.forEach((fn) => fn());
      everConnected = true;
    });
    socket.on("disconnect", (reason) => {
      if (reason === "io client disconnect") return;
      dispatch({ type: "connection", status: "reconnecting", error: reason });
      if (reason === "io server disconnect") socket.connect(); // not retried by itself
    });
    socket.on("connect_error", (err) => {
      if (!socket.active) {
        // the server refused this token (it does not retry on its own)
        dispatch({ type: "connection", status: "refused", error: err.message });
        refusedRef.current?.(err.message);
      } else {
        dispatch({ type: "connection", status: everConnected ? "reconnecting" : "connecting", error: err.message });
      }
    });
    socket.on(UiEvent.CLIENTS_UPDATE, (msg) =>
      dispatch({
        type: "clients",
        clients: msg.clients,
        removed: msg.removed,
        full: msg.full,
        totals: msg.totals,
        at: Date.now() / 1000,
      }),
    );
    socket.on(UiEvent.JOB_UPDATE, (job) => dispatch({ type: "job", job }));
    socket.on(UiEvent.JOB_EVENTS, (msg) => {
      eventListeners.current.get(msg.job_id)?.forEach((fn) => fn(msg.events));
    });
    return () => {
      socket.removeAllListeners();
      socket.disconnect();
    };
  }, [token, refreshJobs]);

  const subscribeEvents = useCallback((jobId, fn) => {
    const map = eventListeners.current;
    if (!map.has(jobId)) map.set(jobId, new Set());
    map.get(jobId).add(fn);
    return () => {
      map.get(jobId)?.delete(fn);
      if (map.get(jobId)?.size === 0) map.delete(jobId);
    };
  }, []);

  const onResync = useCallback((fn) => {
    resyncListeners.current.add(fn);
    return () => resyncListeners.current.delete(fn);
  }, []);

  const putJob = useCallback((job) => dispatch({ type: "job", job }), []);

  const value = useMemo(
    () => ({ ...state, subscribeEvents, onResync, putJob, refreshJobs }),
    [state, subscribeEvents, onResync, putJob, refreshJobs],
  );
  return <LiveContext.Provider value={value}>{children}</LiveContext.Provider>;
}

export function useLive() {
  return useContext(LiveContext);
}
