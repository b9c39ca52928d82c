// A job's events: everything stored so far (REST), then what arrives live (Socket.IO), merged
// by seq. After a lost connection the page fetches what it missed.
import { useEffect, useRef, useState } from "react";
import { allEvents } from "./api.js";
import { lastSeq, mergeEvents } from "./events.js";
import { useLive } from "./LiveProvider.jsx";

export function useJobEvents(jobId) {
  const { subscribeEvents, onResync } = useLive();
  const [events, setEvents] = useState([]);
  const [error, setError] = useState(null);
  const held = useRef([]);
  held.current = events;

  useEffect(() => {
    let live = true;
    setEvents([]);
    setError(null);
    const apply = (incoming) => live && setEvents((prev) => mergeEvents(prev, incoming));
    const unsubscribe = subscribeEvents(jobId, apply); // before the fetch, so nothing falls between
    const load = () =>
      allEvents(jobId, lastSeq(held.current)).then(apply, (err) => live && setError(err));
    load();
    const unresync = onResync(load);
    return () => {
      live = false;
      unsubscribe();
      unresync();
    };
  }, [jobId, subscribeEvents, onResync]);

  return { events, error };
}
