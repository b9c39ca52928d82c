"""The store's credential verbs and the client-secret guard of ``upsert_client``, run against
every backend (the embedded SQLite file and MongoDB over its wire protocol), as part of the
store contract suite: tokens found by their hash, listed by room, revoked (never the room's
last submitter token, however many revocations race) and rotated; a GPU client's record
replaced only under its own secret.

    python -m pytest test/test_store_credentials.py -q
"""
from __future__ import annotations

import threading

import pytest

from store_backends import *  # noqa: F401,F403  (fixtures: backend, store)
from zwdx.errors import StoreError


def credential(cid: str, room_id: str = "r1", role: str = "submitter", **fields) -> dict:
    return {"id": cid, "room_id": room_id, "role": role, "name": f"token {cid}", "hash": f"h-{cid}",
            "created_at": 1.0, "rotated_at": None, "revoked_at": None, "legacy": False, **fields}


def test_credentials_are_found_by_hash_and_id_and_listed_by_room_oldest_first(store):
    made = [store.add_credential(credential(c, room_id="r2" if c == "k3" else "r1", role=role))
            for c, role in (("k1", "submitter"), ("k2", "donor"), ("k3", "submitter"), ("k4", "donor"))]
    assert store.find_credential("h-k2") == made[1] and store.get_credential("k4") == made[3]
    assert [c["id"] for c in store.list_credentials("r1")] == ["k1", "k2", "k4"]
    assert [c["id"] for c in store.list_credentials("r2")] == ["k3"]
    assert store.find_credential("nope") is None and store.get_credential("nope") is None
    assert store.list_credentials("r3") == []


def test_a_credential_id_or_secret_stored_twice_is_a_store_error_and_the_first_stays(store):
    store.add_credential(credential("k1"))
    with pytest.raises(StoreError):
        store.add_credential(credential("k1", hash="h-other"))
    with pytest.raises(StoreError):
        store.add_credential(credential("k2", hash="h-k1"))  # one secret opens one credential
    assert [c["id"] for c in store.list_credentials("r1")] == ["k1"]
    assert store.find_credential("h-other") is None and store.get_credential("k2") is None


def test_revoking_keeps_the_record_and_never_the_rooms_last_submitter_token(store):
    store.add_credential(credential("s1"))
    store.add_credential(credential("d1", role="donor"))
    store.add_credential(credential("s2"))
    store.add_credential(credential("other-room", room_id="r2"))
    assert store.revoke_credential("d1", 5.0)["revoked_at"] == 5.0  # every donor token may go
    assert store.revoke_credential("d1", 6.0) is None  # revoked already: nothing changes
    assert store.revoke_credential("s1", 7.0)["revoked_at"] == 7.0
    # the last submitter token of r1, at a time.time() of more digits than nx-27017 keeps of a float
    assert store.revoke_credential("s2", 1795694579.936504) is None
    assert store.get_credential("s2")["revoked_at"] is None
    assert store.find_credential("h-d1")["revoked_at"] == 5.0  # still found, by its hash: it says revoked
    assert {c["id"]: c["revoked_at"] for c in store.list_credentials("r1")} == {"s1": 7.0, "d1": 5.0, "s2": None}
    assert store.revoke_credential("nope", 9.0) is None


def test_racing_revocations_never_leave_a_room_without_a_submitter_token(backend):
    first = backend.open()
    for cid in ("s1", "s2", "s3", "s4"):
        first.add_credential(credential(cid))
    stores = [backend.open() for _ in range(4)]  # as four server processes would
    barrier = threading.Barrier(4)

    def revoke(store, cid):
        barrier.wait()
        store.revoke_credential(cid, 10.0)
    threads = [threading.Thread(target=revoke, args=(s, f"s{i + 1}")) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    left = [c["id"] for c in first.list_credentials("r1") if c["revoked_at"] is None]
    assert len(left) >= 1, left


def test_rotating_replaces_the_secret_and_ends_legacy(store):
    store.add_credential(credential("old", legacy=True, hash="h-legacy"))
    rotated = store.rotate_credential("old", "h-new", 3.0)
    assert (rotated["hash"], rotated["rotated_at"], rotated["legacy"], rotated["role"]) == ("h-new", 3.0, False,
                                                                                            "submitter")
    assert store.find_credential("h-legacy") is None and store.find_credential("h-new")["id"] == "old"
    store.add_credential(credential("d1", role="donor"))
    store.add_credential(credential("s2"))
    assert store.revoke_credential("d1", 4.0)
    assert store.rotate_credential("d1", "h-d1-new", 5.0) is None  # a revoked token stays revoked
    assert store.find_credential("h-d1")["revoked_at"] == 4.0 and store.find_credential("h-d1-new") is None
    assert store.rotate_credential("nope", "h-x", 5.0) is None


def client(cid: str = "c1", room_id: str = "r1", secret_hash: str | None = "s-1", **extra) -> dict:
    return {"id": cid, "room_id": room_id, "hostname": "host", "status": "online", "secret_hash": secret_hash,
            **extra}


def slots(cid: str = "c1", room_id: str = "r1", n: int = 1) -> list[dict]:
    return [{"id": f"{cid}:{i}", "client_id": cid, "room_id": room_id, "index": i, "kind": "cpu"} for i in range(n)]


def test_a_client_is_replaced_only_under_its_own_secret_and_room(store):
    assert store.upsert_client(client(), slots()) is True
    assert store.upsert_client(client(hostname="again"), slots(n=2)) is True  # its own secret
    assert store.get_client("c1")["hostname"] == "again" and len(store.list_slots("r1")) == 2
    for stranger in (client(secret_hash="s-forged", hostname="taken"), client(secret_hash=None, hostname="taken"),
                     client(room_id="r2", hostname="taken")):
        assert store.upsert_client(stranger, slots(room_id=stranger["room_id"], n=3)) is False
    seen = store.get_client("c1")
    assert (seen["hostname"], seen["room_id"], seen["secret_hash"]) == ("again", "r1", "s-1")
    assert [s["id"] for s in store.list_slots(None, "c1")] == ["c1:0", "c1:1"]  # its slots untouched too


def test_a_client_registered_before_secrets_takes_its_first_one(store):
    assert store.upsert_client(client("old", secret_hash=None), slots("old")) is True
    assert store.upsert_client(client("old", secret_hash="s-first", hostname="upgraded"), slots("old")) is True
    assert store.get_client("old")["secret_hash"] == "s-first"
    assert store.upsert_client(client("old", secret_hash="s-second"), slots("old")) is False


def test_two_registrations_of_one_new_id_at_once_make_one_client(backend):
    stores = [backend.open() for _ in range(6)]
    barrier, won = threading.Barrier(6), []

    def register(i, store):
        barrier.wait()
        if store.upsert_client(client("new", secret_hash=f"s-{i}", hostname=f"h{i}"), slots("new")):
            won.append(i)
    threads = [threading.Thread(target=register, args=(i, s)) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1, won
    assert stores[0].get_client("new")["secret_hash"] == f"s-{won[0]}"
