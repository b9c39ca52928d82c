"""Issue 12's credential attacks, replayed over both stores, each asserted to fail: the ones the
authorization matrix (``test_authorization.py``: every route and event x every credential) and
``test_artifact_refs.py`` (operator documents and other rooms' ids as artifact ids) do not
already tell cell by cell.

- item 1: an id that exists in another room and one that exists nowhere get the same answer
  (no 200-versus-500 or 404-versus-403 oracle to enumerate ids);
- item 5: the room's last submitter token cannot be revoked; revoking or rotating a donor token
  closes the GPU clients connected with it, and a submitter token's revocation its dashboards;
- item 6: rank 0's donor reports rank 1 completed: refused, and the job goes on to complete
  with the honest ranks' results; then every key of it is refused;
- item 7: a donor of the room registers under another donor's client id without its secret:
  refused, the client untouched, and its next job goes to the real one.

In-process apps over ``security_world``'s world (rooms A and B, GPU clients a1, a2 and b1).
"""
from __future__ import annotations

import secrets

from security_world import *  # noqa: F401,F403  (fixtures: world, backend, ...)
from security_world import HELLO, World, snapshot
from zwdx import defaults
from zwdx.protocol import events as ev
from wire_auth import connect_auth

GPU, UI = ev.GPU_NAMESPACE, ev.UI_NAMESPACE


def _connect(w: World, namespace: str, token: str):
    from zwdx.server import socketio
    return socketio.test_client(w.app, namespace=namespace, auth=connect_auth(token))


def _names(sock, namespace: str) -> list[str]:
    return [m["name"] for m in sock.get_received(namespace)]


def _same_answer(first, second, first_id: str, second_id: str) -> None:
    """Two answers a caller cannot tell apart, but for the id it asked about."""
    assert first.status_code == second.status_code, (first.status_code, second.status_code)
    assert first.get_data(as_text=True).replace(first_id, "ID") == second.get_data(as_text=True).replace(second_id, "ID")


# -- item 1: no oracle ------------------------------------------------------------------------------
def test_another_rooms_ids_answer_as_ids_that_exist_nowhere(world):
    w, live = world, world.jobs["live"]
    b_job = w.submit("B")
    b_ids = {"artifact": b_job["spec"]["code"]["bundle_artifact"], "job": b_job["id"]}
    nowhere = {kind: secrets.token_hex(len(i) // 2) for kind, i in b_ids.items()}
    assert len(nowhere["artifact"]) == len(b_ids["artifact"])
    before = snapshot(w)
    asks = [  # (method, path with ID, headers, body with ID)
        ("GET", "/artifacts/ID", w.as_submitter(), None),
        ("GET", "/jobs/ID", w.as_submitter(), None),
        ("GET", "/jobs/ID/weights", w.as_submitter(), None),
        ("POST", "/jobs/ID/cancel", w.as_submitter(), None),
        ("GET", "/jobs/ID/bundle", w.as_rank("rank0"), None),
        ("POST", "/jobs/ID/events", w.as_rank("rank0"), {"events": []}),
        ("POST", f"/jobs/{live}/ranks/0", w.as_rank("rank0"), {"status": "completed", "weights_artifact": "ID"}),
        ("POST", "/jobs", w.as_submitter(), {"bundle_artifact": "ID", "versions": {"python": "3.11.7"}}),
    ]
    for method, path, headers, body in asks:
        kind = "job" if path.startswith("/jobs/ID") else "artifact"
        answers = []
        for target in (b_ids[kind], nowhere[kind]):
            json = None if body is None else {k: (target if v == "ID" else v) for k, v in body.items()}
            answers.append(w.request(method, path.replace("ID", target), headers, json=json))
        assert answers[0].status_code in (400, 403, 404), (method, path, answers[0].status_code)
        _same_answer(*answers, b_ids[kind], nowhere[kind])
    assert snapshot(w) == before
    assert w.store.get_job(b_job["id"]).status == "queued"


# -- item 5: revoking and rotating ----------------------------------------------------------------
def test_the_rooms_last_submitter_token_cannot_be_revoked(world):
    w = world
    b = {defaults.TOKEN_HEADER: w.tokens["other_submitter"]}
    [own] = [t for t in w.request("GET", "/room/tokens", b).json["tokens"] if t["own"]]
    before = snapshot(w)
    resp = w.request("DELETE", f"/room/tokens/{own['id']}", b)
    assert resp.status_code == 409 and "last submitter token" in resp.json["error"]["message"], resp.text
    assert snapshot(w) == before
    assert w.request("GET", "/room", b).status_code == 200
    # with another submitter token made first, it can go; the new one opens the room
    made = w.request("POST", "/room/tokens", b, json={"role": "submitter", "name": "next owner"}).json
    assert w.request("DELETE", f"/room/tokens/{own['id']}", b).status_code == 200
    assert w.request("GET", "/room", b).status_code == 401
    assert w.request("GET", "/room", {defaults.TOKEN_HEADER: made["token"]}).status_code == 200


def test_revoking_a_donor_token_closes_its_gpu_clients_and_keeps_them_out(world):
    w, live = world, world.jobs["live"]
    a1, a2, b1 = w.sockets["a1"], w.sockets["a2"], w.sockets["b1"]
    assert a1.is_connected(GPU) and a2.is_connected(GPU)
    donor = next(t for t in w.request("GET", "/room/tokens", w.as_submitter()).json["tokens"] if t["role"] == "donor")
    assert w.request("DELETE", f"/room/tokens/{donor['id']}", w.as_submitter()).status_code == 200
    assert not a1.is_connected(GPU) and not a2.is_connected(GPU)
    assert b1.is_connected(GPU)  # another room's donor token: its clients stay
    assert {w.store.get_client(c)["status"] for c in ("a1", "a2")} == {"offline"}
    assert not _connect(w, GPU, w.tokens["donor"]).is_connected(GPU)
    # the revoked token's GPU clients are lost at once: their ranks (keys of that attempt) go no further,
    # and the job's timeline says why (issue 34 item 3)
    job = w.store.get_job(live)
    assert job.status == "resuming" and "was revoked" in job.timeline[-1].reason, job.timeline[-1]
    # a new donor token lets the same GPU clients back, each under its own secret
    made = w.request("POST", "/room/tokens", w.as_submitter(), json={"role": "donor", "name": "new"}).json
    back = _connect(w, GPU, made["token"])
    answer = back.emit(ev.EV_REGISTER, {"client_id": "a1", **HELLO, "client_secret": w.secrets["a1"],
                                        "running": [{"job_id": live, "attempt": 1}]}, namespace=GPU, callback=True)
    assert answer["ok"] and w.store.get_client("a1")["status"] == "online", answer
    back.disconnect(namespace=GPU)


def test_rotating_a_donor_token_closes_what_the_old_secret_opened(world):
    w = world
    donor = next(t for t in w.request("GET", "/room/tokens", w.as_submitter()).json["tokens"] if t["role"] == "donor")
    [rotated] = w.request("POST", f"/room/tokens/{donor['id']}/rotate", w.as_submitter()).json["tokens"]
    assert rotated["id"] == donor["id"] and rotated["token"].startswith("zd_") and rotated["token"] != w.tokens["donor"]
    assert not w.sockets["a1"].is_connected(GPU) and not w.sockets["a2"].is_connected(GPU)
    assert not _connect(w, GPU, w.tokens["donor"]).is_connected(GPU)
    fresh = _connect(w, GPU, rotated["token"])
    assert fresh.is_connected(GPU)
    fresh.disconnect(namespace=GPU)


def test_revoking_a_submitter_token_closes_its_dashboards_only(world):
    w = world
    made = w.request("POST", "/room/tokens", w.as_submitter(), json={"role": "submitter", "name": "a laptop"}).json
    theirs, mine = _connect(w, UI, made["token"]), _connect(w, UI, w.tokens["submitter"])
    assert theirs.is_connected(UI) and mine.is_connected(UI)
    assert w.request("DELETE", f"/room/tokens/{made['id']}", w.as_submitter()).status_code == 200
    assert not theirs.is_connected(UI) and mine.is_connected(UI)
    assert w.request("GET", "/jobs", {defaults.TOKEN_HEADER: made["token"]}).status_code == 401
    mine.disconnect(namespace=UI)


# -- item 6: forged results -------------------------------------------------------------------------
def test_rank_0s_donor_cannot_complete_rank_1_and_the_keys_end_with_the_job(world):
    w, live = world, world.jobs["live"]
    rank0, rank1 = w.as_rank("rank0"), w.as_rank("rank1")
    for rank in (rank0, rank1):
        assert w.request("POST", f"/jobs/{live}/ranks/{0 if rank is rank0 else 1}", rank,
                         json={"status": "running"}).json == {"ok": True}
    fake = w.request("PUT", f"/jobs/{live}/weights", rank0, data=b"fake weights").json
    before = snapshot(w)
    for forged in ({"status": "completed", "final_loss": 0.0, "results": {"accuracy": 1.0}},
                   {"status": "completed", "final_loss": 0.0, "weights_artifact": fake["id"]},
                   {"status": "failed", "error": "forged", "traceback": "forged"}):
        resp = w.request("POST", f"/jobs/{live}/ranks/1", rank0, json=forged)
        assert resp.status_code == 403 and "rank 1's key" in resp.json["error"]["message"], resp.text
    # nor as rank 1 from rank 0's GPU client over Socket.IO
    said = w.sockets["a1"].emit(ev.EV_RANKS_EXITED, {"job_id": live, "attempt": 1, "exits": {"1": 0}}, namespace=GPU,
                                callback=True)
    assert said["ok"] is False and "not placed on this gpu client" in said["error"], said
    assert snapshot(w) == before
    assert w.store.get_job(live).status == "running"

    # the honest ranks finish: the job completes with their results, rank 0's weights
    honest = w.request("PUT", f"/jobs/{live}/weights", rank0, data=b"honest weights").json
    assert w.request("POST", f"/jobs/{live}/ranks/1", rank1, json={"status": "completed", "final_loss": 0.5}).json \
        == {"ok": True}
    assert w.store.get_job(live).status == "running"  # one rank of two
    assert w.request("POST", f"/jobs/{live}/ranks/0", rank0, json={
        "status": "completed", "final_loss": 0.5, "weights_artifact": honest["id"]}).json == {"ok": True}
    done = w.request("GET", f"/jobs/{live}", w.as_submitter()).json
    assert done["status"] == "completed" and done["final_loss"] == 0.5 and done["weights_artifact"] == honest["id"]
    assert w.request("GET", f"/jobs/{live}/weights", w.as_submitter()).data == b"honest weights"

    # and its keys ended with it: every rank route refuses them, and nothing changes
    before = snapshot(w)
    for key in (rank0, rank1):
        for method, path, kwargs in [("POST", "/ranks/0", {"json": {"status": "completed"}}),
                                     ("POST", "/events", {"json": {"events": [{"kind": "log", "data": {"text": "x"}}]}}),
                                     ("PUT", "/weights", {"data": b"later"}), ("GET", "/bundle", {}),
                                     ("PUT", "/checkpoints/0/x.pt", {"data": b"x"}),
                                     ("POST", "/checkpoints/0/commit", {"json": {"files": ["x.pt"]}})]:
            resp = w.request(method, f"/jobs/{live}{path}", key, **kwargs)
            assert resp.status_code == 403 and "expired" in resp.json["error"]["message"], (path, resp.text)
    assert snapshot(w) == before


# -- item 7: impersonation --------------------------------------------------------------------------
def test_another_donor_cannot_take_a_client_id_nor_its_next_job(world):
    from zwdx.server.auth import hash_secret
    w = world
    real = w.sockets["a2"]
    held = w.store.get_client("a2")
    impostor = _connect(w, GPU, w.tokens["donor"])  # a donor of the same room: ids are listed to it
    before = snapshot(w)
    for secret in (None, "zc_" + secrets.token_urlsafe(32), w.secrets["a1"]):  # none, a guess, another client's
        answer = impostor.emit(ev.EV_REGISTER, {"client_id": "a2", **HELLO, **({"client_secret": secret} if secret
                                                                            else {})}, namespace=GPU, callback=True)
        assert answer["ok"] is False and answer["code"] == "client_secret", answer
    assert snapshot(w) == before
    assert w.store.get_client("a2")["sid"] == held["sid"] and held["secret_hash"] == hash_secret(w.secrets["a2"])
    # a heartbeat on the impostor's connection speaks for no client
    assert impostor.emit(ev.EV_HEARTBEAT, {"slots": []}, namespace=GPU, callback=True)["ok"] is False

    # a2's next job goes to a2's own connection: the impostor hears nothing
    for sock in (real, impostor):
        sock.get_received(GPU)
    job = w.submit(world_size=1)
    with w.app.app_context():
        w.app.extensions["zwdx"].scheduler.schedule_once()
    placed = w.store.get_job(job["id"]).placement
    assert [p.client_id for p in placed] == ["a2"], placed  # a2:1 is its only free slot
    assert ev.EV_RESERVE_PORT in _names(real, GPU) and _names(impostor, GPU) == []
    impostor.disconnect(namespace=GPU)
