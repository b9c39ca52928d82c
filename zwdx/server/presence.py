"""Which GPU clients are alive: held in memory by the server process that holds each one's
connection, not written to the store at every heartbeat.

A heartbeat changes only this process's memory (``Presence.beat``): the client's last word,
its deadline, its slots' figures, the jobs it runs; only one that says the client runs other
jobs than it said before is written at once (a job started or ended there:
``jobs.not_started`` reads it). Once a second (``step``) the process

- declares lost its own clients past their deadline (``jobs.client_lost``: the store is
  told, their jobs moved), unless the store says the client registered since through another
  connection;
- writes to the store, in one transaction, what changed that matters: a slot's free memory moved by 1/``MEMORY_STEP`` of its total or more (placement reads it), and
  every ``STORE_EVERY`` seconds the rest (last seen, utilisation: what a listing shows of a
  client held elsewhere). A client the store no longer has online (lost, its token revoked) is
  forgotten: its next heartbeat is told to register again;
- with Redis (``MESSAGE_QUEUE`` ``redis://``, several processes), publishes its clients' fresh
  figures in a hash of its own (``zwdx:presence:<process>``, kept ``PRESENCE_TTL`` s past its last
  step) and its own liveness in the sorted set ``zwdx:servers`` (process -> wall-clock time).
  The process that leads (``lease.py``) finds processes silent for ``PRESENCE_TTL`` s (killed, cut
  off): their clients still ``online`` in the store are set offline with ``CLIENT_TIMEOUT`` to come
  back (``Store.release_clients_of``, one conditional write each: one that registered through
  another process meanwhile is left alone), as a dropped connection is.

The store is written on register (the client record names its process: ``server``), on a
disconnect, on a loss, when the jobs it runs change and when its figures move enough. A
client's ``lost_after`` in the store is None while a process holds it: the leader's reaper
(``Scheduler.reap_silent_clients``) reads only the deadlines of clients no process holds.
Several processes with a message queue that is not Redis have no such channel: there each step
also writes every beating client's deadline to the store, as every heartbeat did before.

    Presence(ctx, redis_url)  .joined() .beat() .left() .held() .overlay(clients) .start(app) .stop()
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import orjson

from ..protocol import ClientStatus

log = logging.getLogger(__name__)

#: Seconds between two steps (losses found, figures written and published).
PRESENCE_INTERVAL = 1.0
#: A client's figures go to the store at least this often (seconds) while it beats.
STORE_EVERY = 30.0
#: A slot's free memory is written at once when it moved by its total / this, or more.
MEMORY_STEP = 64
#: A process's Redis entries are taken for dead this many seconds after its last step.
PRESENCE_TTL = 5.0
#: Seconds between two looks of the leader for clients online in the store whose process Redis
#: does not know (Redis restarted while their process died): found twice in a row, released.
ORPHANS_EVERY = 60.0
KEY = "zwdx:presence:"
SERVERS = "zwdx:servers"


@dataclass
class Live:
    """One GPU client held by this process."""
    client_id: str
    room_id: str
    sid: str
    last_seen: float
    deadline: float
    stats: dict[int, dict] = field(default_factory=dict)  # slot index -> its figures
    running: list[str] = field(default_factory=list)
    stored: dict[int, dict] = field(default_factory=dict)  # the figures as last written
    stored_running: list[str] = field(default_factory=list)
    stored_at: float = 0.0
    fresh: bool = True  # beat since the last step (to publish, and to write its deadline)


class Presence:
    """The GPU clients this process holds (``ServerContext.presence``)."""

    def __init__(self, ctx, redis_url: str | None = None):
        self.ctx = ctx
        self.server = ctx.lease.holder
        self.live: dict[str, Live] = {}
        self._gone: set[str] = set()  # to drop from this process's Redis hash
        self.redis = None
        if redis_url and redis_url.startswith(("redis://", "rediss://", "unix://")):
            import redis  # installed with Flask-SocketIO's Redis queue
            self.redis = redis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        #: deadlines written to the store (several processes without Redis)
        self.deadlines_in_store = ctx.lease.shared and self.redis is None
        self._redis_ok_since: float | None = None
        self._redis_failed_at = float("-inf")
        self._orphans: tuple[float, set[str]] = (time.time(), set())  # (looked at, servers unknown then)
        self._thread: threading.Thread | None = None

    # -- this process's connections ----------------------------------------------------------
    def joined(self, client_id: str, room_id: str, sid: str, now: float, deadline: float, slots: list[dict],
               running: list[str]) -> None:
        """A register through this process (written to the store already)."""
        stats = {s["index"]: _figures(s) for s in slots}
        self.live[client_id] = Live(client_id, room_id, sid, now, deadline, stats, list(running),
                                    {i: dict(f) for i, f in stats.items()}, list(running), now)
        self._gone.discard(client_id)

    def beat(self, client_id: str, sid: str, now: float, deadline: float, stats: list[dict],
             running: list[str]) -> bool:
        """A heartbeat; False if this process does not hold the client on that connection (lost,
        or never registered here): it must register again."""
        live = self.live.get(client_id)
        if live is None or live.sid != sid:
            return False
        live.last_seen, live.deadline, live.running, live.fresh = now, deadline, running, True
        for stat in stats:
            live.stats.setdefault(stat["index"], {}).update(_figures(stat))
        if running != live.stored_running:  # a job started or ended on it: the scheduler's judgement
            # of a placement that did not start reads it (jobs.not_started), so at once
            if not self.ctx.store.touch_client(client_id, {"last_seen": now, "running_jobs": running}, [],
                                               expect_status=ClientStatus.ONLINE.value):
                self._forget(client_id)
                return False
            live.stored_running = list(running)
        return True

    def left(self, client_id: str, sid: str) -> Live | None:
        """The connection ``sid`` closed: forget the client if that was its connection."""
        live = self.live.get(client_id)
        if live is None or live.sid != sid:
            return None
        self._forget(client_id)
        return live

    def held(self, client_id: str) -> Live | None:
        return self.live.get(client_id)

    def _forget(self, client_id: str) -> None:
        self.live.pop(client_id, None)
        self._gone.add(client_id)

    # -- fresher figures for a listing -----------------------------------------------------
    def overlay(self, clients: list[dict]) -> list[dict]:
        """``clients`` (the store's documents, with slots) with the fresh figures of those online:
        this process's from memory, the others' from their processes' Redis hashes."""
        elsewhere: dict[str, list[dict]] = {}
        for client in clients:
            if client.get("status") != ClientStatus.ONLINE.value:
                continue
            live = self.live.get(client["id"])
            if live is not None and live.sid == client.get("sid"):
                _apply(client, live.last_seen, live.stats)
            elif self.redis is not None and client.get("server") and client["server"] != self.server:
                elsewhere.setdefault(client["server"], []).append(client)
        if elsewhere and self._redis_ok_since is not None:
            try:
                pipe = self.redis.pipeline(transaction=False)
                for server, held in elsewhere.items():
                    pipe.hmget(KEY + server, [c["id"] for c in held])
                for held, found in zip(elsewhere.values(), pipe.execute()):
                    for client, raw in zip(held, found):
                        if raw:
                            seen, stats = orjson.loads(raw)
                            _apply(client, seen, {int(i): f for i, f in stats.items()})
            except Exception as exc:  # the store's figures then, a little older
                self._redis_failed(exc)
        return clients

    # -- the step ----------------------------------------------------------------------------
    def start(self, app) -> None:
        if self.redis is not None:
            self._publish(time.time())  # known to the others before its first client registers
        self._thread = threading.Thread(target=self._loop, args=(app,), name="zwdx-presence", daemon=True)
        self._thread.start()

    def _loop(self, app) -> None:
        # An app made with SCHEDULER=False (a test's) declares nothing lost by itself, as its
        # scheduler's reaper does not: its steps write and publish only.
        reap = self.ctx.settings.scheduler
        with app.app_context():
            while not self.ctx.stopping.wait(PRESENCE_INTERVAL):
                try:
                    self.step(reap=reap)
                except Exception:
                    log.exception("presence: a step failed")

    def stop(self) -> None:
        """A clean stop: this process's Redis entries go at once (its connections close anyway)."""
        if self.redis is not None:
            try:
                self.redis.delete(KEY + self.server)
                self.redis.zrem(SERVERS, self.server)
            except Exception:
                pass
            self.redis.close()

    def step(self, now: float | None = None, reap: bool = True) -> None:
        now = time.time() if now is None else now
        for live in [l for l in self.live.values() if reap and l.deadline < now]:
            self._lost(live, now)
        self._write(now)
        if self.redis is not None:
            self._publish(now)
            if self.ctx.lease.held():
                self._reap_dead_servers(now)

    def _lost(self, live: Live, now: float) -> None:
        from . import jobs
        self._forget(live.client_id)
        stored = self.ctx.store.get_client(live.client_id)
        if not stored or stored.get("sid") != live.sid or stored.get("status") != ClientStatus.ONLINE.value:
            return  # registered again through another connection, or lost already
        jobs.client_lost(self.ctx, live.client_id, f"no heartbeat for {now - live.last_seen:.1f} s")

    def _write(self, now: float) -> None:
        touches = []
        for live in self.live.values():
            due = now - live.stored_at >= STORE_EVERY and live.last_seen > live.stored_at
            if not (due or live.running != live.stored_running or _moved(live.stats, live.stored)
                    or (self.deadlines_in_store and live.fresh)):
                continue
            changes = {"last_seen": live.last_seen, "running_jobs": live.running}
            if self.deadlines_in_store:
                changes["lost_after"] = live.deadline
            touches.append((live.client_id, changes, [{"index": i, **f} for i, f in live.stats.items()]))
            live.stored = {i: dict(f) for i, f in live.stats.items()}
            live.stored_running, live.stored_at = list(live.running), now
        if not self.redis:
            for live in self.live.values():
                live.fresh = False
        if not touches:
            return
        for client_id in self.ctx.store.touch_clients(touches, expect_status=ClientStatus.ONLINE.value):
            log.info("gpu-client %s: no longer online in the store; told to register again at its next heartbeat",
                     client_id)
            self._forget(client_id)

    def _publish(self, now: float) -> None:
        fresh = {l.client_id: orjson.dumps([l.last_seen, {str(i): f for i, f in l.stats.items()}])
                 for l in self.live.values() if l.fresh}
        gone, key = list(self._gone), KEY + self.server
        try:
            pipe = self.redis.pipeline(transaction=False)
            if fresh:
                pipe.hset(key, mapping=fresh)
            if gone:
                pipe.hdel(key, *gone)
            pipe.expire(key, int(PRESENCE_TTL) + 1)
            pipe.zadd(SERVERS, {self.server: now})
            pipe.execute()
        except Exception as exc:
            self._redis_failed(exc)
            return
        for client_id in fresh:
            if client_id in self.live:
                self.live[client_id].fresh = False
        self._gone.difference_update(gone)
        if self._redis_ok_since is None:
            self._redis_ok_since = now

    def _redis_failed(self, exc: Exception) -> None:
        self._redis_ok_since = None
        if time.monotonic() - self._redis_failed_at > 60:
            self._redis_failed_at = time.monotonic()
            log.warning("presence: Redis unreachable (%s): no process is judged dead meanwhile", exc)

    def _reap_dead_servers(self, now: float) -> None:
        """The leader's part: the processes silent for ``PRESENCE_TTL`` hold no client any more.
        Judged only once this process has reached Redis for that long itself (after an outage of
        Redis every process is silent for a while)."""
        from . import notify
        if self._redis_ok_since is None or now - self._redis_ok_since < PRESENCE_TTL:
            return
        try:
            dead = [s.decode() for s in self.redis.zrangebyscore(SERVERS, "-inf", now - PRESENCE_TTL)]
        except Exception as exc:
            self._redis_failed(exc)
            return
        grace = self.ctx.settings.client_timeout
        for server in dead:
            if server == self.server:
                continue
            released = self.ctx.store.release_clients_of(server, {
                "status": ClientStatus.OFFLINE.value, "sid": None, "disconnected_at": now, "lost_after": now + grace})
            self.redis.zrem(SERVERS, server)
            log.warning("presence: server process %s silent for %gs: %d gpu client(s) it held have %gs to come back",
                        server, PRESENCE_TTL, len(released), grace)
            for room_id in {c["room_id"] for c in map(self.ctx.store.get_client, released) if c}:
                notify.clients_changed(self.ctx, room_id, joined_or_left=True)
        if dead:
            self.ctx.scheduler.kick()
        if now - self._orphans[0] >= ORPHANS_EVERY:
            self._release_orphans(now, grace)

    def _release_orphans(self, now: float, grace: float) -> None:
        alive = {s.decode() for s in self.redis.zrange(SERVERS, 0, -1)} | {self.server}
        unknown = {c.get("server") for c in self.ctx.store.list_clients(None)
                   if c.get("status") == ClientStatus.ONLINE.value and c.get("lost_after") is None} - alive - {None}
        for server in unknown & self._orphans[1]:
            released = self.ctx.store.release_clients_of(server, {
                "status": ClientStatus.OFFLINE.value, "sid": None, "disconnected_at": now, "lost_after": now + grace})
            log.warning("presence: %d gpu client(s) online in the store under server process %s, which Redis does "
                        "not know: %gs to come back", len(released), server, grace)
        self._orphans = (now, unknown)


def _figures(slot: dict) -> dict:
    return {k: slot[k] for k in ("memory_free", "utilization", "memory_total") if slot.get(k) is not None}


def _moved(now: dict[int, dict], before: dict[int, dict]) -> bool:
    """Whether a slot's free or total memory moved enough to matter to placement."""
    for index, figures in now.items():
        old = before.get(index, {})
        total = figures.get("memory_total") or old.get("memory_total") or 0
        if figures.get("memory_total") != old.get("memory_total"):
            return True
        if abs((figures.get("memory_free") or 0) - (old.get("memory_free") or 0)) * MEMORY_STEP >= max(total, 1):
            return True
    return False


def _apply(client: dict, last_seen: float, stats: dict[int, dict]) -> None:
    client["last_seen"] = max(float(client.get("last_seen") or 0), last_seen)
    for slot in client.get("slots") or []:
        slot.update(stats.get(slot.get("index"), {}))
