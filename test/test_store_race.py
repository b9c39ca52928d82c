"""Schedulers racing on one queue, in threads and in separate OS processes, on each backend:
no slot is ever given to two jobs, no job is reserved or started twice.

Each worker plays a scheduler and a GPU client at once, on its own Store object:
reserve_slots for queued jobs (any worker), starting -> running guarded by its status (every
worker tries, one must win), running -> completed and release_slots (the reserving worker).
While a worker believes it holds a slot, it keeps a file named after the slot, created with
O_EXCL: a slot given to two jobs shows up as a file that already exists.
"""
from __future__ import annotations

import contextlib
import http.client
import json
import multiprocessing
import os
import random
import threading
import time
from collections import Counter

import pytest
import requests

from store_backends import *  # noqa: F401,F403  (fixtures: backend, mongo_uri, ...)
from store_backends import Backend, job_record, open_spec
from procs import Server
import zwdx
from zwdx.protocol.job import TimelineEntry
from zwdx.server.store.sqlite import SQLiteStore

pytestmark = pytest.mark.slow  # schedulers racing in separate OS processes, server processes

ROOM = "r1"
JOBS = 36
CLIENTS, GPUS = 2, 2
ACTIVE = ("queued", "starting", "running")


def seed(store) -> None:
    store.create_room({"id": ROOM, "name": "race", "token_hash": "h", "created_at": 0.0})
    for c in range(CLIENTS):
        cid = f"c{c}"
        store.upsert_client({"id": cid, "room_id": ROOM, "hostname": cid, "status": "online", "last_seen": 0.0},
                            [{"id": f"{cid}:{i}", "client_id": cid, "room_id": ROOM, "index": i, "kind": "cuda"}
                             for i in range(GPUS)])
    for j in range(JOBS):
        store.create_job(job_record(f"j{j:02d}", ROOM, world_size=1 + j % 3))


def move(store, job_id: str, to: str, by: str, when: str):
    """The job's status from ``when`` to ``to``, on its timeline, in one guarded write."""
    return store.append_job(job_id, {"timeline": TimelineEntry(status=to, at=time.time(), reason=f"by {by}")},
                            fields={"status": to}, when=[when])


def hammer(store, name: str, ledger: str, seconds: float = 60.0) -> dict:
    """One worker's loop until every job completed. Returns what it won and what it saw."""
    won = {"reserved": [], "started": [], "completed": [], "doubles": 0, "overwritten": 0, "lost": 0}
    holding: dict[str, list[str]] = {}
    rng = random.Random(name)
    deadline = time.time() + seconds
    while time.time() < deadline:
        jobs = [j for j in store.list_jobs(ROOM) if j.status in ACTIVE]
        if not jobs:
            break
        for job in jobs:
            if job.status == "queued":
                free = [s["id"] for s in store.list_slots(ROOM) if s["job_id"] is None]
                need = job.spec.resources.world_size
                if len(free) < need:
                    continue
                picked = rng.sample(free, need)
                if store.reserve_slots(job.id, [(s, r) for r, s in enumerate(picked)],
                                       {"status": "starting", "world_size": need, "waiting_reason": None}):
                    won["reserved"].append(job.id)
                    holding[job.id] = picked
                    for slot in picked:
                        try:
                            os.close(os.open(os.path.join(ledger, slot), os.O_CREAT | os.O_EXCL))
                        except FileExistsError:
                            won["doubles"] += 1
                else:
                    won["lost"] += 1
            elif job.status == "starting":
                if move(store, job.id, "running", name, when="starting"):
                    won["started"].append(job.id)
                else:
                    won["lost"] += 1
            elif job.status == "running" and job.id in holding:
                slots = {s["id"]: s["job_id"] for s in store.list_slots(ROOM)}
                won["overwritten"] += sum(slots[s] != job.id for s in holding[job.id])
                for slot in holding.pop(job.id):
                    with contextlib.suppress(FileNotFoundError):  # only when given twice
                        os.unlink(os.path.join(ledger, slot))
                if move(store, job.id, "completed", name, when="running"):
                    won["completed"].append(job.id)
                store.release_slots(job.id)
    won["left"] = sorted(holding)
    return won


def _threads(make_store, names, ledger, go, seconds: float = 60.0) -> list[dict]:
    results, errors = {}, []

    def run(name):
        try:
            store = make_store()
            go.wait(60)
            results[name] = hammer(store, name, ledger, seconds)
        except BaseException as exc:  # reported by the test, not lost in a thread
            errors.append(f"{name}: {exc!r}")
    threads = [threading.Thread(target=run, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    return list(results.values())


def process_main(spec, names, ledger, ready, go, out) -> None:
    """Runs in a spawned OS process: its own stores, two worker threads."""
    try:
        ready.put(os.getpid())
        out.put(_threads(lambda: open_spec(spec), names, ledger, go))
    except BaseException as exc:
        out.put(f"process {os.getpid()}: {exc!r}")


def tally(backend_name: str, store, results: list[dict], workers: str) -> Counter:
    reserved = Counter(j for r in results for j in r["reserved"])
    started = Counter(j for r in results for j in r["started"])
    completed = Counter(j for r in results for j in r["completed"])
    jobs = store.list_jobs(ROOM)
    figures = Counter(
        workers=len(results), jobs=len(jobs), reservations=sum(reserved.values()),
        races_lost=sum(r["lost"] for r in results),
        slots_given_twice=sum(r["doubles"] + r["overwritten"] for r in results),
        jobs_reserved_twice=sum(n - 1 for n in reserved.values() if n > 1),
        jobs_started_twice=sum(n - 1 for n in started.values() if n > 1)
        + sum(1 for j in jobs if [t.status for t in j.timeline].count("running") > 1),
        jobs_completed_twice=sum(n - 1 for n in completed.values() if n > 1),
        not_completed=sum(j.status != "completed" for j in jobs),
        slots_still_held=sum(s["job_id"] is not None for s in store.list_slots(ROOM)))
    print(f"\nrace [{backend_name}] {workers}: " + ", ".join(f"{k} {v}" for k, v in figures.items()))
    return figures


def test_threads_racing_never_give_a_slot_twice_or_start_a_job_twice(backend, tmp_path):
    seed(backend.open())
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    go = threading.Event()
    timer = threading.Timer(0.2, go.set)
    timer.start()
    results = _threads(backend.open, [f"t{i}" for i in range(6)], str(ledger), go)
    figures = tally(backend.name, backend.open(), results, "6 threads")
    assert figures["reservations"] == JOBS
    assert (figures["slots_given_twice"], figures["jobs_reserved_twice"], figures["jobs_started_twice"],
            figures["jobs_completed_twice"]) == (0, 0, 0, 0)
    assert (figures["not_completed"], figures["slots_still_held"]) == (0, 0)
    assert os.listdir(ledger) == []


def test_processes_racing_never_give_a_slot_twice_or_start_a_job_twice(backend, tmp_path):
    seed(backend.open())
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    ctx = multiprocessing.get_context("spawn")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=process_main, args=(backend.spec, [f"p{p}t{t}" for t in range(2)], str(ledger),
                                                    ready, go, out)) for p in range(3)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=60)
        here = []
        waiter = threading.Thread(target=lambda: here.extend(_threads(backend.open, ["main0", "main1"],
                                                                      str(ledger), go)))
        waiter.start()
        go.set()
        results = [out.get(timeout=120) for _ in procs]
        waiter.join(120)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert not [r for r in results if isinstance(r, str)], results
    results = [w for r in results for w in r] + here
    figures = tally(backend.name, backend.open(), results, "3 processes x 2 threads + 2 threads")
    assert figures["workers"] == 8 and figures["reservations"] == JOBS
    assert (figures["slots_given_twice"], figures["jobs_reserved_twice"], figures["jobs_started_twice"],
            figures["jobs_completed_twice"]) == (0, 0, 0, 0)
    assert (figures["not_completed"], figures["slots_still_held"]) == (0, 0)


class CarelessStore(SQLiteStore):
    """reserve_slots as check-then-write, without the transaction: what the race test must catch."""

    def reserve_slots(self, job_id, assignments, fields):
        free = {s["id"] for s in self.list_slots(None) if s["job_id"] is None}
        if self.get_job(job_id).status != "queued" or any(s not in free for s, _ in assignments):
            return False
        time.sleep(0.002)  # widens the planted race's window
        with self.db.tx() as db:
            for slot_id, rank in assignments:
                db.execute("UPDATE slots SET job_id=?, rank=? WHERE id=?", (job_id, rank, slot_id))
        self.set_job(job_id, fields)
        return True


def test_the_race_detector_catches_a_store_without_atomic_claims(tmp_path):
    path = str(tmp_path / "zwdx.sqlite3")
    seed(CarelessStore(path))
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    go = threading.Event()
    go.set()
    results = _threads(lambda: CarelessStore(path), [f"t{i}" for i in range(6)], str(ledger), go, seconds=15)
    figures = tally("careless sqlite", CarelessStore(path), results, "6 threads")
    assert figures["slots_given_twice"] + figures["jobs_reserved_twice"] > 0


def test_a_reservation_cut_short_by_a_killed_server_is_healed(mongo_uri):
    """MongoDB has no transaction here: a server killed between claiming slots and moving
    the job leaves pending claims behind. Once stale, they are fenced off their job and freed;
    a pending claim whose job did move stays the job's."""
    from pymongo import MongoClient
    from zwdx.server.store import mongo
    backend = Backend("mongo", mongo_uri)
    store = backend.open()
    seed(store)
    raw = MongoClient(mongo_uri).get_default_database()
    stale = time.time() - mongo.STALE_CLAIM_S - 1

    def held():
        return {s["id"]: s["job_id"] for s in store.list_slots(ROOM)}
    # What killed reservations leave: c0:0 claimed for j00 (still queued), c0:1 for j03 (since cancelled).
    for slot, job in (("c0:0", "j00"), ("c0:1", "j03")):
        raw.slots.update_one({"_id": slot}, {"$set": {"job_id": job, "rank": 0, "_claim": f"dead-{job}",
                                                      "_claimed_at": time.time()}})
    store.set_job("j03", {"status": "cancelled"})
    assert store.reserve_slots("j01", [("c0:0", 0)], {"status": "starting"}) is False
    assert held()["c0:0"] == "j00"  # fresh: it may still be on its way
    raw.slots.update_many({"_claim": {"$in": ["dead-j00", "dead-j03"]}}, {"$set": {"_claimed_at": stale}})
    assert held() == {"c0:0": None, "c0:1": None, "c1:0": None, "c1:1": None}
    assert store.get_job("j00").status == "queued"
    # The killed reservation cannot move its job any more, were it only paused.
    assert raw.jobs.find_one({"_id": "j00"})["_fences"] == {"dead-j00": True}
    assert store.reserve_slots("j01", [("c0:0", 0)], {"status": "starting"}) is True
    assert store.reserve_slots("j00", [("c1:0", 0)], {"status": "starting"}) is True
    # A server killed after moving its job, before settling the claim: the slot stays the job's.
    raw.slots.update_one({"_id": "c0:0"}, {"$set": {"_claimed_at": stale}})
    assert held()["c0:0"] == "j01"
    assert raw.slots.find_one({"_id": "c0:0"})["_claimed_at"] is None
    assert store.reserve_slots("j02", [("c0:0", 0)], {"status": "starting"}) is False
    raw.client.close()
    backend.close_all()


# -- two real server processes on one store ----------------------------------------------------
@pytest.mark.parametrize("kind", ["sqlite", "mongo"])
def test_two_servers_on_one_store_apply_each_transition_once(kind, tmp_path, request):
    from mnist import Net, create_loader, train
    from zwdx import ZWDX, Conflict
    if kind == "sqlite":
        dirs = [str(tmp_path / "shared")] * 2
        extra = []
    else:
        dirs = [str(tmp_path / "a"), str(tmp_path / "b")]
        extra = ["--mongo-uri", request.getfixturevalue("mongo_uri")]
    servers = []
    try:
        for d in dirs:
            servers.append(Server(d, extra=extra))
        a, b = (ZWDX(s.url) for s in servers)
        room = a.create_room("two servers")
        token = room["token"]
        assert b.get_room(token)["id"] == room["id"]
        jobs = [(a if i % 2 else b).submit_job(Net(), create_loader, train, resources=zwdx.Resources(world_size=4),
                                               run=zwdx.Run(room_token=token, progress=False),
                                               wait=False) for i in range(6)]
        assert [j["id"] for j in a.list_jobs(token)] == jobs == [j["id"] for j in b.list_jobs(token)]
        assert [b.get_job(j, token)["queue_position"] for j in jobs] == list(range(1, 7))

        wins, conflicts, errors = Counter(), Counter(), []

        def cancel(sdk, job_id):
            try:
                sdk.cancel_job(job_id, token)
                wins[job_id] += 1
            except Conflict:
                conflicts[job_id] += 1
            except Exception as exc:
                errors.append(repr(exc))
        threads = [threading.Thread(target=cancel, args=(sdk, j)) for j in jobs for sdk in (a, b, a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        print(f"\ntwo servers [{kind}]: {len(jobs)} jobs, 4 concurrent cancels each through 2 servers: "
              f"{sum(wins.values())} applied, {sum(conflicts.values())} refused (409), "
              f"cancelled twice {sum(n - 1 for n in wins.values() if n > 1)}")
        assert all(wins[j] == 1 and conflicts[j] == 3 for j in jobs), (wins, conflicts)
        for j in jobs:
            job = b.get_job(j, token)
            assert job["status"] == "cancelled"
            assert [t["status"] for t in job["timeline"]].count("cancelled") == 1
        assert requests.get(f"{servers[0].url}/health", timeout=5).json()["status"] == "ok"
    finally:
        for s in servers:
            s.stop()


def test_a_server_waiting_for_the_files_write_lock_still_serves_its_other_connections(tmp_path):
    """Another process holds the embedded store's write lock: a write through this server waits
    for it (and then completes), and meanwhile the server answers everything else."""
    import sqlite3
    srv = Server(str(tmp_path / "server"))
    try:
        holder = sqlite3.connect(os.path.join(srv.data_dir, "zwdx.sqlite3"), isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # another process's write, under way
        created: dict = {}
        sent = threading.Event()

        def write():
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
            conn.request("POST", "/api/v1/rooms", body=json.dumps({"name": "waits"}),
                         headers={"Content-Type": "application/json"})
            sent.set()
            resp = conn.getresponse()
            created.update(status=resp.status, body=resp.read())
            conn.close()
        writer = threading.Thread(target=write)
        started = time.monotonic()
        writer.start()
        assert sent.wait(30), "the room's write was not sent"
        answered = []
        while time.monotonic() - started < 2.5:  # the other process holds the lock 2.5 s: asked all along
            t = time.monotonic()
            assert requests.get(f"{srv.url}/health", timeout=10).status_code == 200
            answered.append(time.monotonic() - t)
            time.sleep(0.1)  # paces the asking, waits for nothing
        assert max(answered) < 0.5, answered  # not held for the lock's length
        assert writer.is_alive() and not created, "the write waits for the lock"
        holder.execute("COMMIT")
        writer.join(30)
        assert created["status"] == 201, created["body"]
    finally:
        srv.stop()
