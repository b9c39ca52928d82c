"""What the control plane's hot paths cost one server process, the earlier way and the way now,
on the embedded store (SQLite) in this process: figures independent of a load generator.

- a heartbeat: one store write (``touch_client``, as every heartbeat was) against the memory
  of the process holding the client (``Presence.beat``; the store is written once a second
  for those whose figures moved enough: ``Presence.step``, counted in);
- a placement pass's read of a room of N clients: the whole room (``list_clients``, as every
  pass was) against the view after K of its clients changed (``RoomViews.of``);
- a plan over that view (``placement.plan``, what a pass does per waiting job, and a submit's
  ``unschedulable`` alike): the records built from the room's documents at each plan, as before,
  against those the view keeps (``RoomViews.kept``);
- a rate-limit hit (``RATE_LIMIT_EVENTS``' per-second window), one a second for each of N rank
  keys spread over 3 s: the ``limits`` library's memory storage (a sweep of every key 10 ms after
  each hit) against zwdx's (``PurgedMemoryStorage``: once a second), process CPU per hit;
- ranks' event posts from W ranks at once: a transaction each (``add_events``) against the
  group commit (``EventWriter``), wall time for all of them (threads; the store's lock and
  fsync are what is shared).

    python bench/control_costs.py --clients 1000,5000 --changed 20 --ranks 64
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from limits import parse as parse_rate  # noqa: E402
from limits.storage import MemoryStorage  # noqa: E402
from limits.strategies import MovingWindowRateLimiter  # noqa: E402

from zwdx.server.batches import EventWriter  # noqa: E402
from zwdx.server.limits import PurgedMemoryStorage  # noqa: E402
from zwdx.server.placement import plan  # noqa: E402
from zwdx.server.presence import Presence  # noqa: E402
from zwdx.server.roomview import RoomViews, observe  # noqa: E402
from zwdx.server.store import open_store  # noqa: E402


def populate(store, n: int, room: str = "r1") -> None:
    for i in range(n):
        cid = f"c{i}"
        store.upsert_client({"id": cid, "room_id": room, "hostname": cid, "status": "online", "last_seen": 0.0,
                             "versions": {"python": "3.11.7"}, "modules": "torch numpy"},
                            [{"id": f"{cid}:{g}", "client_id": cid, "room_id": room, "index": g, "kind": "cuda",
                              "memory_total": 80 << 30, "memory_free": 80 << 30, "utilization": 0} for g in range(2)])


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f} ms"


def heartbeats(store, n: int) -> tuple[float, float]:
    stats = [{"index": g, "memory_free": 79 << 30, "utilization": 50} for g in range(2)]
    began = time.perf_counter()
    for i in range(n):
        store.touch_client(f"c{i}", {"last_seen": time.time(), "lost_after": time.time() + 10,
                                     "running_jobs": []}, stats, expect_status="online")
    before = (time.perf_counter() - began) / n
    ctx = SimpleNamespace(store=store, lease=SimpleNamespace(holder="bench", shared=False, held=lambda: True),
                          config={"CLIENT_TIMEOUT": 10})
    presence = Presence(ctx)
    now = time.time()
    for i in range(n):
        presence.joined(f"c{i}", "r1", f"s{i}", now, now + 10, [{"index": g, **stats[g]} for g in range(2)], [])
    began = time.perf_counter()
    for i in range(n):  # every client beats once, 1 in 20 with free memory moved enough to be written
        moved = [{**s, "memory_free": (40 << 30) if i % 20 == 0 else s["memory_free"]} for s in stats]
        presence.beat(f"c{i}", f"s{i}", time.time(), time.time() + 10, moved, [])
    presence.step()
    return before, (time.perf_counter() - began) / n


def placement_reads(store, changed: int, times: int = 5) -> tuple[float, float]:
    began = time.perf_counter()
    for _ in range(times):
        store.list_clients("r1")
    before = (time.perf_counter() - began) / times
    views = RoomViews(store)
    observe(store, views)
    views.of("r1")
    took = 0.0
    for t in range(times):
        for i in range(changed):
            store.update_client(f"c{(t * changed + i) * 7 % 1000}", {"last_seen": float(t)})
        began = time.perf_counter()
        views.of("r1")
        took += time.perf_counter() - began
    return before, took / times


def plans(store, times: int = 5) -> tuple[float, float]:
    views = RoomViews(store)
    clients = views.of("r1")
    slots = sorted((s for c in clients.values() for s in c["slots"]), key=lambda s: (s["client_id"], s["index"]))
    job = {"spec": {"parallelism": "DDP", "kind": "function", "world_size": 2}, "status": "queued"}
    took = []
    for kept in (None, views.kept):
        plan(job, slots, clients, kept=kept)  # the view's records built once
        began = time.perf_counter()
        for _ in range(times):
            plan(job, slots, clients, kept=kept)
        took.append((time.perf_counter() - began) / times)
    return took[0], took[1]


def rate_hits(keys: int, seconds: float = 3.0) -> tuple[float, float]:
    rate, took = parse_rate("20 per second"), []
    for storage in (MemoryStorage(), PurgedMemoryStorage()):
        window, n = MovingWindowRateLimiter(storage), 0
        began, cpu = time.monotonic(), time.process_time()
        while time.monotonic() - began < seconds:
            window.hit(rate, "events", f"j{n % keys}:0")
            n += 1
            time.sleep(max(0.0, began + n / keys - time.monotonic()))  # each key once a second
        took.append((time.process_time() - cpu) / n)
        storage.timer.cancel()
    return took[0], took[1]


def events(store, ranks: int, rounds: int = 5) -> tuple[float, float]:
    def post_all(add) -> float:
        start = threading.Barrier(ranks)

        def post(rank):
            start.wait()
            for r in range(rounds):
                add(f"j{rank % 8}", [{"kind": "metric", "rank": rank, "key": f"{tag}-{r}-{k}", "step": r,
                                      "data": {"loss": 1.0}, "ts": 1.0} for k in range(5)])
        threads = [threading.Thread(target=post, args=(rank,)) for rank in range(ranks)]
        began = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return (time.perf_counter() - began) / (ranks * rounds)
    tag = "a"
    before = post_all(store.add_events)
    tag = "b"
    return before, post_all(EventWriter(store).add)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1000,5000")
    parser.add_argument("--changed", type=int, default=20, help="clients changed between two placement passes")
    parser.add_argument("--ranks", type=int, default=64, help="ranks posting events at once")
    args = parser.parse_args()
    print("| clients | heartbeat: store write | heartbeat: memory (+ its share of the step) | placement read: room "
          "| placement read: view, {} changed | plan: records built | plan: records kept "
          "| rate-limit hit: library's sweep | rate-limit hit: once a second "
          "| events post: a transaction each | events post: group commit |".format(args.changed))
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.clients.split(",")):
        with tempfile.TemporaryDirectory() as data:
            store = open_store(data, None)
            populate(store, n)
            hb = heartbeats(store, n)
            pl = placement_reads(store, args.changed)
            pn = plans(store)
            rl = rate_hits(n)
            ev = events(store, args.ranks)
            store.close()
        print(f"| {n:,} | {ms(hb[0])} | {ms(hb[1])} | {ms(pl[0])} | {ms(pl[1])} | {ms(pn[0])} | {ms(pn[1])} | {ms(rl[0])} | {ms(rl[1])} | {ms(ev[0])} | {ms(ev[1])} |")


if __name__ == "__main__":
    main()
