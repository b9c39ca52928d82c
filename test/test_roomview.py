"""The placement view (``zwdx/server/roomview.py``): a room's GPU clients as the scheduler places
from, read whole once and then kept by the store's own writes (only the clients a write changed
are read again), read whole again after a gap; across processes through Redis announcements."""
from __future__ import annotations

import pytest

import needs
from procs import wait_until
from zwdx.server.roomview import RoomViews, observe
from zwdx.server.store import open_store


def add_clients(store, n, room="r1"):
    for i in range(n):
        cid = f"c{i}"
        store.upsert_client({"id": cid, "room_id": room, "hostname": cid, "status": "online"},
                            [{"id": f"{cid}:0", "client_id": cid, "room_id": room, "index": 0, "kind": "cuda",
                              "memory_total": 80, "memory_free": 80}])


def as_stored(store, room="r1"):
    return {c["id"]: c for c in store.list_clients(room)}


@pytest.fixture
def store(tmp_path):
    opened = open_store(str(tmp_path / "data"), None)
    yield opened
    opened.close()


def test_the_view_is_read_once_then_kept_by_the_writes_that_change_clients(store):
    from store_backends import job_record
    views = RoomViews(store)
    observe(store, views)
    add_clients(store, 40)
    assert views.of("r1") == as_stored(store) and views.rebuilds == 1
    store.create_job(job_record("j1", "r1", "queued", 2))
    assert store.reserve_slots("j1", [("c3:0", 0), ("c7:0", 1)], {"status": "starting"})
    store.update_client("c9", {"status": "offline", "sid": None})
    assert store.touch_clients([("c11", {"last_seen": 5.0}, [{"index": 0, "memory_free": 1}])]) == []
    assert views.of("r1") == as_stored(store)
    assert views.rebuilds == 1 and views.rereads == 4  # each changed client read again, not the room
    add_clients(store, 41)  # a client joins (and the others register again: 40 more changes)
    assert views.of("r1") == as_stored(store) and views.rereads == 4 + 41
    before = views.rereads
    assert views.of("r1") == as_stored(store) and views.rereads == before  # nothing changed: nothing read
    assert store.release_slots("j1") == 2
    assert views.of("r1") == as_stored(store) and views.rereads == before + 2  # the job's two clients
    store.update_client("c9", {"status": "offline", "last_seen": 1.0})
    assert store.remove_clients("r1", seen_before=2.0) == ["c9"]
    assert views.of("r1") == as_stored(store) and "c9" not in views.of("r1")


def test_a_write_the_view_did_not_see_shows_after_a_gap_rebuilds_it(store, tmp_path):
    views = RoomViews(store)
    observe(store, views)
    add_clients(store, 3)
    views.of("r1")
    other = open_store(str(tmp_path / "data"), None)  # another process's store: not observed here
    try:
        other.update_client("c1", {"status": "offline"})
        assert views.of("r1")["c1"]["status"] == "online"
        views.rebuild()  # what the announcements' subscription does when it breaks
        assert views.of("r1") == as_stored(store) and views.rebuilds == 2
    finally:
        other.close()


@pytest.mark.slow
def test_changes_made_through_another_process_reach_the_view_through_redis(tmp_path):
    needs.tool("redis-server", "apt-get install redis-server (./setup.sh --test installs it)")
    needs.module("redis")
    from zwdx.testing import RedisProc
    redis = RedisProc(str(tmp_path))
    mine, theirs = open_store(str(tmp_path / "data"), None), open_store(str(tmp_path / "data"), None)
    stopping = __import__("threading").Event()
    try:
        here, there = RoomViews(mine, redis.url), RoomViews(theirs, redis.url)
        observe(mine, here)
        observe(theirs, there)
        here.start(stopping)
        add_clients(mine, 5)
        wait_until(lambda: here.of("r1") and here.rebuilds >= 1, 10, what="the view built")
        wait_until(lambda: redis_subscribers(redis) == 1, 10, what="the view subscribed")
        theirs.update_client("c2", {"status": "offline"})  # through the other process: announced
        wait_until(lambda: here.of("r1")["c2"]["status"] == "offline", 10, what="the other process's change seen")
        assert here.of("r1") == as_stored(mine)
        built = here.rebuilds
        redis.stop()  # a gap: the subscription breaks, and the view is read whole again
        theirs.update_client("c3", {"status": "offline"})  # not announced (Redis is down)
        wait_until(lambda: here.of("r1")["c3"]["status"] == "offline" and here.rebuilds > built, 15,
                   what="the view read whole after the gap")
    finally:
        stopping.set()
        redis.stop()
        mine.close()
        theirs.close()


def redis_subscribers(redis) -> int:
    import redis as redis_py
    client = redis_py.Redis.from_url(redis.url)
    try:
        return int(client.pubsub_numsub("zwdx:clients")[0][1])
    finally:
        client.close()


def test_the_submit_hint_reads_the_view_current_and_without_reading_the_room_again(store):
    from zwdx.server.placement import RecentClients
    views = RoomViews(store)
    observe(store, views)
    hint = RecentClients(store, ttl=3600, views=views)
    add_clients(store, 30)
    assert {c["id"] for c in hint.of("r1")} == {f"c{i}" for i in range(30)}
    store.update_client("c4", {"status": "offline"})
    assert {c["id"]: c["status"] for c in hint.of("r1")}["c4"] == "offline"  # at once, not after the ttl
    assert views.rebuilds == 1 and views.rereads == 1
