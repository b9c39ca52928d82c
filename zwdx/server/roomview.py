"""The placement view: each room's GPU clients with their slots, kept in memory by the process
that places jobs, instead of read whole from the store at every placement pass.

Every store write that changes a GPU client or its slots (a register, a disconnect, a loss, its
figures written by ``presence.py``, slots reserved or released by a job's moves) marks that client
stale in this process's view (``observe`` wraps those store verbs of the process's store), and,
with Redis (several processes), is announced on the channel ``zwdx:clients`` so that the view
of whichever process leads marks it stale too. A pass (``of``) re-reads only the stale clients
of the room, each with its own slots: a submit costs in proportion to what changed, not to the
room. A room's view is read whole the first time, after a gap in the announcements (the
subscription to Redis broke: what was missed is unknown), and every ``REBUILD_EVERY`` seconds
in any case (a write that escapes the verbs: a restore).

    RoomViews(store, redis_url)   .of(room_id) -> {client id: client with slots}
    .changed(client_ids, room_id=None, job_id=None)   .rebuild()   .start(stopping)
    .kept  # placement's records of the views' documents, built once each (placement.records.Kept)
    observe(store, views)  # the store's client and slot verbs tell the views what they changed
"""
from __future__ import annotations

import functools
import logging
import threading
import time
import uuid

from .placement.records import Kept

log = logging.getLogger(__name__)

#: Seconds after which a room's view is read whole again, whatever was announced.
REBUILD_EVERY = 60.0
CHANNEL = "zwdx:clients"
_ALL = object()  # every client of the room is stale


class RoomViews:
    """This process's views of the rooms it has placed jobs in (``ServerContext.views``)."""

    def __init__(self, store, redis_url: str | None = None):
        self.store = store
        self._rooms: dict[str, dict[str, dict]] = {}  # room id -> client id -> client (with slots)
        self._built: dict[str, float] = {}  # room id -> when it was read whole (monotonic)
        self._stale: dict[str, object] = {}  # room id -> set of client ids, or _ALL
        self._room_of: dict[str, str] = {}  # client id -> its room, for a change that names no room
        self._lock = threading.Lock()
        self._reading = threading.Lock()  # one ``of`` at a time (the scheduler's and a submit's)
        self.redis = None
        self._me = uuid.uuid4().hex[:12]  # this process's announcements, not marked twice
        if redis_url and redis_url.startswith(("redis://", "rediss://", "unix://")):
            import redis
            self.redis = redis.Redis.from_url(redis_url, socket_connect_timeout=2.0)
        #: rooms read whole and clients read one by one since the start (tests, /metrics)
        self.rebuilds = self.rereads = 0
        #: placement's records of the documents held here: what a view drops or replaces goes too
        self.kept = Kept()

    # -- what changed ------------------------------------------------------------------------
    def changed(self, client_ids=(), room_id: str | None = None, job_id: str | None = None,
                announce: bool = True) -> None:
        """Mark clients stale (their room given or known from the view), or those holding slots of
        ``job_id``; announce it to the other processes."""
        ids = list(client_ids)
        with self._lock:
            if job_id is not None:
                ids += [cid for clients in self._rooms.values() for cid, c in clients.items()
                        if any(s.get("job_id") == job_id for s in c.get("slots", ()))]
            for cid in ids:
                room = room_id or self._room_of.get(cid)
                if room is None or room not in self._rooms:
                    continue  # a room this process holds no view of: read whole when asked
                stale = self._stale.setdefault(room, set())
                if stale is not _ALL:
                    stale.add(cid)
        if announce and self.redis is not None:
            try:
                self.redis.publish(CHANNEL, "\t".join([self._me, room_id or "", job_id or "", *client_ids]))
            except Exception as exc:  # the others' views are rebuilt on the gap
                log.warning("room views: change not announced through Redis: %s", exc)

    def rebuild(self) -> None:
        """Every view read whole at its next use (a gap in the announcements)."""
        with self._lock:
            for room in self._rooms:
                self._stale[room] = _ALL

    # -- the view ------------------------------------------------------------------------------
    def of(self, room_id: str) -> dict[str, dict]:
        """The room's GPU clients by id, each with its slots, as the store has them now (up to the
        announcements in flight): a dict of the caller's own over the view's documents (the
        scheduler's pass marks the slots it reserves in them, as the store has them)."""
        with self._reading:
            return self._of(room_id)

    def _of(self, room_id: str) -> dict[str, dict]:
        now = time.monotonic()
        with self._lock:
            view = self._rooms.get(room_id)
            stale = self._stale.pop(room_id, set())
            if view is None or now - self._built.get(room_id, 0.0) > REBUILD_EVERY:
                stale = _ALL
        if stale is _ALL:
            clients = {c["id"]: c for c in self.store.list_clients(room_id)}
            with self._lock:
                self._rooms[room_id], self._built[room_id] = clients, now
                for cid in clients:
                    self._room_of[cid] = room_id
                held = [c for view in self._rooms.values() for c in view.values()]
            self.kept.retain(held)
            self.rebuilds += 1
            return dict(clients)
        fresh = {}
        for cid in stale:
            client = self.store.get_client(cid)
            if client is not None and client.get("room_id") == room_id:
                client["slots"] = self.store.list_slots(None, cid)
            fresh[cid] = client
        with self._lock:
            for cid, client in fresh.items():
                self.kept.forget([view.get(cid)])
                if client is None or client.get("room_id") != room_id:
                    view.pop(cid, None)
                else:
                    view[cid], self._room_of[cid] = client, room_id
            self.rereads += len(fresh)
            return dict(view)

    # -- the other processes' changes --------------------------------------------------------
    def start(self, stopping: threading.Event) -> None:
        if self.redis is not None:
            threading.Thread(target=self._listen, args=(stopping,), name="zwdx-room-views", daemon=True).start()

    def _listen(self, stopping: threading.Event) -> None:
        while not stopping.is_set():
            try:
                pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(CHANNEL)
                self.rebuild()  # whatever came before the subscription is unknown
                while not stopping.is_set():
                    message = pubsub.get_message(timeout=1.0)
                    if message is not None:
                        origin, room, job, *ids = message["data"].decode().split("\t")
                        if origin != self._me:
                            self.changed(ids, room or None, job or None, announce=False)
            except Exception as exc:
                log.warning("room views: Redis subscription broken (%s); the views are read whole again", exc)
                self.rebuild()
                stopping.wait(1.0)


def observe(store, views: RoomViews) -> None:
    """Wrap the client and slot verbs of ``store`` (this instance only) so that each write tells
    ``views`` which clients it changed."""
    def after(name, which):
        verb = getattr(store, name)

        @functools.wraps(verb)
        def observed(*args, **kwargs):
            result = verb(*args, **kwargs)
            try:
                which(result, *args, **kwargs)
            except Exception:
                log.exception("room views: %s not observed; the views are read whole again", name)
                views.rebuild()
            return result
        setattr(store, name, observed)

    after("upsert_client", lambda ok, client, slots: ok and views.changed([client["id"]], client["room_id"]))
    after("update_client", lambda _, client_id, changes: views.changed([client_id]))
    after("touch_client", lambda ok, client_id, *a, **k: ok and views.changed([client_id]))
    after("touch_clients", lambda missed, touches, *a, **k: views.changed(
        [t[0] for t in touches if t[0] not in set(missed)]))
    after("release_clients_of", lambda ids, *a, **k: ids and views.changed(ids))
    after("remove_clients", lambda ids, room_id, *a, **k: ids and views.changed(ids, room_id))
    after("reserve_slots", lambda ok, job_id, assignments, *a, **k: ok and views.changed(
        [slot_id.rsplit(":", 1)[0] for slot_id, _ in assignments]))
    after("release_slots", lambda n, job_id, client_id=None: n and (
        views.changed([client_id]) if client_id else views.changed(job_id=job_id)))
