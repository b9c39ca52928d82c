"""``GET /metrics``: the server in Prometheus's text format, for an operator's Prometheus.

Two sources, one answer:
- what the store holds, read at each scrape (``StoreCollector``): jobs by room and status, each
  room's queue (depth, the longest wait so far), GPU clients online and offline, slots free,
  busy and lost, and each online slot's utilisation and memory as its last heartbeat said;
- what this process counted as it happened (``meters.py``): REST request latencies, job wait
  times, durations, ends and restarts; and whether it runs the scheduler (``lease.py``).

Labels are bounded: a room's id, a GPU client's id and slot index, a status, a direction (up,
down), a route's rule;
never a job id, never a token. Who may scrape: with ``METRICS_TOKEN`` set (``zwdx server
--metrics-token-file``), whoever sends ``Authorization: Bearer <it>``; without it, only
loopback addresses (a Prometheus or an agent on the server's machine). Behind a reverse proxy
on the same machine every request looks local: set a token there, or do not route /metrics.
"""
from __future__ import annotations

import hmac
import ipaddress
import time
from collections import Counter as Tally

from flask import Blueprint, Response, request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .. import __version__
from ..errors import AuthError, Forbidden
from ..protocol import WAITING, ClientStatus
from . import meters
from .http import Auth, ctx, operation
from .placement import apart_from

bp = Blueprint("prometheus", __name__)

TEXT = "text/plain"


class StoreCollector(Collector):
    """Gauges read from the store when Prometheus scrapes (nothing is kept between scrapes)."""

    def __init__(self, store, clock=time.time, overlay=None):
        #: ``overlay``: the fresh figures of the clients the processes hold (``Presence.overlay``)
        self.store, self.clock, self.overlay = store, clock, overlay or (lambda clients: clients)

    def collect(self):
        now = self.clock()
        info = GaugeMetricFamily("zwdx_build_info", "The zwdx version this server runs", labels=["version"])
        info.add_metric([__version__], 1)
        yield info

        jobs = GaugeMetricFamily("zwdx_jobs", "Jobs by room and status", labels=["room", "status"])
        counts = self.store.job_counts()
        for (room, status), n in sorted(counts.items()):
            jobs.add_metric([room, status], n)
        yield jobs

        depth = GaugeMetricFamily("zwdx_queue_depth", "Jobs waiting to be placed (queued or resuming)", labels=["room"])
        oldest = GaugeMetricFamily("zwdx_queue_oldest_wait_seconds",
                                   "How long the room's longest-waiting job has waited so far", labels=["room"])
        waits: dict[str, list[float]] = {}
        for job in self.store.list_jobs(statuses=WAITING):
            since = next((e.at for e in reversed(job.timeline) if e.status in WAITING), job.created_at)
            waits.setdefault(job.room_id, []).append(max(0.0, now - since))
        for room, _ in counts:  # a room with jobs and none waiting: 0, not "No data"
            waits.setdefault(room, [])
        for room, seconds in sorted(waits.items()):
            depth.add_metric([room], len(seconds))
            oldest.add_metric([room], max(seconds, default=0.0))
        yield depth
        yield oldest

        yield from self._clients()

    def _clients(self):
        clients = GaugeMetricFamily("zwdx_gpu_clients", "GPU clients by room and status", labels=["room", "status"])
        slots = GaugeMetricFamily("zwdx_slots", "GPU slots by room and state (free, busy, lost)",
                                  labels=["room", "state"])
        utilization = GaugeMetricFamily("zwdx_slot_utilization_percent", "A slot's GPU utilisation, last heartbeat",
                                        labels=["room", "client", "slot", "kind"])
        free = GaugeMetricFamily("zwdx_slot_memory_free_bytes", "A slot's free memory, last heartbeat",
                                 labels=["room", "client", "slot", "kind"])
        total = GaugeMetricFamily("zwdx_slot_memory_total_bytes", "A slot's memory", labels=["room", "client", "slot",
                                                                                          "kind"])
        rtt = GaugeMetricFamily("zwdx_client_link_rtt_seconds", "A GPU client's round trip to the server, "
                                "measured at register", labels=["room", "client"])
        rate = GaugeMetricFamily("zwdx_client_link_bytes_per_second", "A GPU client's link to the server, measured "
                                 "at register (up: to the server)", labels=["room", "client", "direction"])
        apart = GaugeMetricFamily("zwdx_unreachable_pairs", "Pairs of a room's GPU clients known not to reach each "
                                  "other (kept apart for DDP and FSDP)", labels=["room"])
        by_status, by_state, pairs = Tally(), Tally(), {}
        now = self.clock()
        for client in self.overlay(self.store.list_clients(None)):
            room = client.get("room_id")
            if not isinstance(room, str):
                continue
            online = client.get("status") == ClientStatus.ONLINE.value
            by_status[(room, ClientStatus.ONLINE.value if online else ClientStatus.OFFLINE.value)] += 1
            pairs.setdefault(room, set()).update(frozenset((str(client.get("id")), peer))
                                                 for peer in apart_from(client, now))
            if online:
                _link(client, room, rtt, rate)
            for slot in client.get("slots") or []:
                by_state[(room, "lost" if not online else "busy" if slot.get("job_id") else "free")] += 1
                if online:
                    labels = [room, str(client.get("id")), str(slot.get("index")), str(slot.get("kind") or "cuda")]
                    _measured(slot, labels, ((utilization, "utilization"), (free, "memory_free"),
                                             (total, "memory_total")))
        for (room, status), n in sorted(by_status.items()):
            clients.add_metric([room, status], n)
        for (room, state), n in sorted(by_state.items()):
            slots.add_metric([room, state], n)
        for room, held in sorted(pairs.items()):
            apart.add_metric([room], len(held))
        yield from (clients, slots, utilization, free, total, rtt, rate, apart)


def _link(client: dict, room: str, rtt, rate) -> None:
    """A GPU client's link to the server, as measured at register, if it was."""
    link, cid = client.get("link"), str(client.get("id"))
    if isinstance(link, dict):
        _measured(link, [room, cid], ((rtt, "rtt"),))
        for direction in ("up", "down"):
            _measured(link, [room, cid, direction], ((rate, direction),))


def _measured(doc: dict, labels: list[str], families) -> None:
    """Each (family, key) of ``families`` given ``doc[key]`` under ``labels``, where it is a number."""
    for family, key in families:
        value = doc.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            family.add_metric(labels, float(value))


class _Meters(Collector):
    """What this process counted (``meters.REGISTRY``), in the same answer, and whether it leads."""

    def __init__(self, lease, presence=None, events=None):
        self.lease, self.presence, self.events = lease, presence, events

    def collect(self):
        yield from meters.REGISTRY.collect()
        leader = GaugeMetricFamily("zwdx_scheduler_leader", "1 while this server process runs the scheduler and the "
                                   "sweeper (alone: always; among several: while it holds the store's lease)")
        leader.add_metric([], 1 if self.lease.held() else 0)
        yield leader
        if self.presence is not None:
            held = GaugeMetricFamily("zwdx_presence_clients", "GPU clients whose connection this server process holds "
                                     "(their heartbeats kept in its memory: presence.py)")
            held.add_metric([], len(self.presence.live))
            yield held
        if self.events is not None:
            writes = CounterMetricFamily("zwdx_event_writes", "Store writes of ranks' events by this process (each "
                                         "takes the posts that came meanwhile: batches.py)")
            writes.add_metric([], self.events.writes)
            posts = CounterMetricFamily("zwdx_event_posts", "Posts of ranks' events this process stored")
            posts.add_metric([], self.events.requests)
            yield from (writes, posts)


def _may_scrape() -> None:
    token = ctx().settings.metrics_token
    if token:
        sent = request.headers.get("Authorization", "")
        if not (sent.lower().startswith("bearer ") and hmac.compare_digest(sent[7:].encode(), str(token).encode())):
            raise AuthError("GET /metrics needs 'Authorization: Bearer <the server's metrics token>'")
        return
    try:
        local = ipaddress.ip_address(request.remote_addr or "").is_loopback
    except ValueError:
        local = False
    if not local:
        raise Forbidden("GET /metrics answers only this machine unless the server has a metrics token "
                        "(zwdx server --metrics-token-file FILE, or ZWDX_METRICS_TOKEN)")


@operation(bp, "GET", "/metrics", "The server's metrics, in Prometheus's text format", auth=Auth.NONE, answer=TEXT,
           errors=(401, 403), prefix="", tag="server")
def metrics():
    """Jobs, queues, GPU clients and slots (read from the store at each scrape) and this
    process's request latencies and job timings. Open to loopback addresses; with a metrics
    token set on the server, to ``Authorization: Bearer <token>`` only."""
    _may_scrape()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(ctx().store, overlay=ctx().presence.overlay))
    registry.register(_Meters(ctx().lease, ctx().presence, ctx().events))
    return Response(generate_latest(registry), mimetype=CONTENT_TYPE_LATEST.split(";")[0],
                    content_type=CONTENT_TYPE_LATEST)


def observe_requests(app) -> None:
    """Time every request to a REST route (``meters.request_done``), labelled by its rule."""

    @app.before_request
    def _start():
        request.environ["zwdx.started"] = time.perf_counter()

    @app.after_request
    def _done(response):
        started = request.environ.get("zwdx.started")
        rule = request.url_rule.rule if request.url_rule is not None else "(no route)"
        if started is not None:
            meters.request_done(request.method, rule, response.status_code, time.perf_counter() - started)
        return response
