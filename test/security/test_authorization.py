"""The authorization matrix (issue 12): every REST route and every Socket.IO event, each asked
with every kind of credential, over both stores; the answer each cell must get, and for every
refusal a check that nothing stored changed (every table or collection, and the artifact bytes).

REST columns (the header a request carries):

    none             nothing
    wrong            a room token no room has
    revoked          a submitter token of room A, revoked
    other_submitter  room B's submitter token      (its own room: a room-A object is "not found")
    other_donor      room B's donor token           (opens only the link measurement, /link)
    donor            room A's donor token           (opens only the link measurement, /link)
    legacy           room A's legacy zr_ token      (a submitter token until rotated)
    submitter        room A's submitter token       the right token of a room route
    wrong_key        a rank key no rank has
    other_rank       rank 1's key of the live job   (its own rank's writes only)
    old_attempt      rank 0's key of attempt 0      (the live job is at attempt 1)
    ended_job        rank 0's key of a cancelled job, on that job
    rank             rank 0's key of the live job   the right key of a rank route

A room token opens no rank route (401: no rank key), a rank key no room route (401: no room
token). Every status a cell gets is one the route's OpenAPI operation declares.

The routes are listed from the app's url_map and the events from ``zwdx/protocol/events.py``:
a route or an event without an entry here fails ``test_every_route_and_event_has_an_entry``.
The routes' cells share one world per store (``shared_world``): each route's refused cells
run first, on what its ``prepare`` made, and the store is compared before and after them; then
each accepted cell, on what ``prepare`` makes again (a queued job to cancel, a token to revoke).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Callable

import pytest

from security_world import *  # noqa: F401,F403  (fixtures: world, shared_world, backend, ...)
from security_world import HELLO, World, snapshot
from zwdx import codec, defaults
from zwdx.protocol import events as ev
from zwdx.server import global_weights
from wire_auth import connect_auth

P = defaults.API_PREFIX
ROOM_COLUMNS = ("none", "wrong", "revoked", "other_submitter", "other_donor", "donor", "legacy", "submitter")
KEY_COLUMNS = ("wrong_key", "other_rank", "old_attempt", "ended_job", "rank")
COLUMNS = ROOM_COLUMNS + KEY_COLUMNS
#: A DILOCO worker's pseudo-gradient of no values (it is there, with nothing to add).
NOTHING = codec.Layout("int8", 0).header()


def headers(w: World, column: str) -> dict:
    if column == "none":
        return {}
    if column == "wrong":
        return {defaults.TOKEN_HEADER: f"zs_{secrets.token_urlsafe(32)}"}
    if column in ROOM_COLUMNS:
        return {defaults.TOKEN_HEADER: w.tokens[column]}
    if column == "wrong_key":
        return {defaults.RANK_KEY_HEADER: f"rk_{secrets.token_urlsafe(32)}"}
    return {defaults.RANK_KEY_HEADER: w.keys[{"other_rank": "rank1", "old_attempt": "old_attempt",
                                              "ended_job": "ended", "rank": "rank0"}[column]]}


# -- the routes ----------------------------------------------------------------------------------
@dataclass
class Route:
    """How to call one endpoint, and what its right caller gets."""
    #: "public" (anyone), "room" (a submitter token), "job" (a rank key), "room_or_job", "donor"
    #: (a donor token: a GPU client's), "page", "no_route" (the API's 404 for what it does not have)
    auth: str
    #: (world, column, made) -> (method, url, keyword arguments of the test client's ``open``)
    call: Callable[[World, str, object], tuple[str, str, dict]]
    #: the right caller's status
    ok: int
    #: a job route every rank of the attempt may call (not only rank 0, or the rank in the path)
    any_rank: bool = False
    #: room B's submitter token on a route that names nothing of room A: its own room's answer
    own_room: int | None = None
    #: world -> what the call uses up (a queued job to cancel, a token to revoke): made once for
    #: the refused cells (which leave it), and again before each accepted one
    prepare: Callable[[World], object] = lambda w: None


def job_of(w: World, column: str) -> str:
    """The job a rank route is asked about: the cancelled one for its key, else the live one."""
    return w.jobs["ended"] if column == "ended_job" else w.jobs["live"]


def fresh_bundle(w: World) -> str:
    return w.request("POST", "/artifacts", w.as_submitter(), data=secrets.token_bytes(16)).json["id"]


_ROUNDS = iter(range(10**6))


def fresh_round(w: World) -> int:
    """A round of the live (DILOCO) job that no rank uploaded to yet."""
    return next(_ROUNDS)


def averaged_round(w: World) -> int:
    """A round of the live job both ranks uploaded to (with nothing to add): its average is made."""
    n = fresh_round(w)
    for key in ("rank0", "rank1"):
        resp = w.request("PUT", f"/jobs/{w.jobs['live']}/diloco/rounds/{n}", w.as_rank(key), data=NOTHING)
        assert resp.status_code == 201, resp.text
    return n


def fresh_token(w: World) -> str:
    return w.request("POST", "/room/tokens", w.as_submitter(), json={"role": "donor", "name": "spare"}).json["id"]


#: The files of a DDP checkpoint of the live job (world size 2), and the rank that sends each.
# The live job is DILOCO: its checkpoints are rank 0's alone (another rank's file is refused:
# test_integrity.py covers DDP's files of every rank)
CHECKPOINT = {"state.pt": "rank0", "rng-0.pt": "rank0"}


def uploaded(w: World) -> None:
    """The ranks of the live job uploaded checkpoint 0's files (each its own)."""
    for name, rank in CHECKPOINT.items():
        resp = w.request("PUT", f"/jobs/{w.jobs['live']}/checkpoints/0/{name}", w.as_rank(rank), data=b"state")
        assert resp.status_code == 201, resp.text


def committed(w: World) -> None:
    """Checkpoint 0 of the live job, committed (once): only a committed checkpoint's files are read."""
    if not w.request("GET", f"/jobs/{w.jobs['live']}/checkpoints", w.as_submitter()).json["checkpoints"]:
        uploaded(w)
        resp = w.request("POST", f"/jobs/{w.jobs['live']}/checkpoints/0/commit", w.as_rank("rank0"),
                         json={"files": list(CHECKPOINT)})
        assert resp.status_code == 201, resp.text


def fresh_workdir(w: World) -> tuple[bytes, str]:
    """Fresh bytes of a working dir and their sha256."""
    import hashlib
    data = secrets.token_bytes(16)
    return data, hashlib.sha256(data).hexdigest()


def stored_workdir(w: World) -> str:
    """A working dir the room has: its sha256."""
    data, sha = fresh_workdir(w)
    resp = w.request("PUT", f"/workdirs/{sha}", w.as_submitter(), data=data)
    assert resp.status_code == 201, resp.text
    return sha


def outputs(w: World) -> None:
    """Rank 0 of the live job uploaded its outputs."""
    resp = w.request("PUT", f"/jobs/{w.jobs['live']}/outputs", w.as_rank("rank0"), data=b"a tar")
    assert resp.status_code == 201, resp.text


def fresh_manifest(w: World) -> dict:
    """A manifest of a new dataset over a chunk room A has (uploaded now)."""
    data, sha = fresh_workdir(w)
    assert w.request("PUT", f"/datasets/chunks/{sha}", w.as_submitter(), data=data).status_code == 201
    return {"name": f"d{sha[:8]}", "chunk_bytes": 1024,
            "files": [{"path": "f", "size": len(data), "sha256": sha, "chunks": [sha]}]}


def fresh_dataset(w: World) -> str:
    """A dataset of room A no job uses: its name."""
    name = f"spare{secrets.token_hex(4)}"
    w.push_dataset(name)
    return name


ROUTES: dict[str, Route] = {
    "api.health": Route("public", lambda w, c, m: ("GET", "/health", {}), 200),
    "api.create_room": Route("public", lambda w, c, m: ("POST", f"{P}/rooms", {"json": {"name": "new"}}), 201),
    "openapi.openapi_json": Route("public", lambda w, c, m: ("GET", f"{P}/openapi.json", {}), 200),
    "openapi.docs": Route("public", lambda w, c, m: ("GET", f"{P}/docs", {}), 200),
    # from this machine without a metrics token (anyone else: test_prometheus.py)
    "prometheus.metrics": Route("public", lambda w, c, m: ("GET", "/metrics", {}), 200),
    "ui.dashboard": Route("page", lambda w, c, m: ("GET", "/jobs/whatever", {}), 200),
    "api.no_route": Route("no_route", lambda w, c, m: ("GET", f"{P}/nothing/here", {}), 404),
    "api.get_room": Route("room", lambda w, c, m: ("GET", f"{P}/room", {}), 200, own_room=200),
    "api.set_room": Route("room", lambda w, c, m: ("PATCH", f"{P}/room", {"json": {"client_retention": 7200}}), 200,
                          own_room=200),
    # offline for a year: the world's GPU clients stay (a refusal must drop none either)
    "api.prune_clients": Route("room", lambda w, c, m: ("POST", f"{P}/room/clients/prune", {"json": {
        "offline_for": 365 * 86400}}), 200, own_room=200),
    "api.upload_bundle": Route("room", lambda w, c, m: ("POST", f"{P}/artifacts", {"data": b"a bundle"}), 201,
                               own_room=201),
    "api.download_artifact": Route("room", lambda w, c, m: ("GET", f"{P}/artifacts/{w.bundle}", {}), 200),
    # Room B's submitter naming room A's bundle: no bundle of its room (400, nothing stored).
    "api.create_job": Route("room", lambda w, c, m: ("POST", f"{P}/jobs", {"json": {
        "bundle_artifact": m, "versions": {"python": "3.11.7"}}}), 201, own_room=400, prepare=fresh_bundle),
    "api.list_jobs": Route("room", lambda w, c, m: ("GET", f"{P}/jobs", {}), 200, own_room=200),
    "api.get_job": Route("room", lambda w, c, m: ("GET", f"{P}/jobs/{w.jobs['live']}", {}), 200),
    "api.cancel_job": Route("room", lambda w, c, m: ("POST", f"{P}/jobs/{m}/cancel", {}), 200,
                            prepare=lambda w: w.submit()["id"]),
    "api.get_events": Route("room", lambda w, c, m: ("GET", f"{P}/jobs/{w.jobs['live']}/events", {}), 200),
    "api.get_metrics": Route("room", lambda w, c, m: ("GET", f"{P}/jobs/{w.jobs['live']}/metrics", {}), 200),
    "api.get_weights": Route("room", lambda w, c, m: ("GET", f"{P}/jobs/{w.jobs['done']}/weights", {}), 200),
    "api.get_bundle": Route("job", lambda w, c, m: ("GET", f"{P}/jobs/{job_of(w, c)}/bundle", {}), 200,
                            any_rank=True),
    "api.post_events": Route("job", lambda w, c, m: ("POST", f"{P}/jobs/{job_of(w, c)}/events", {"json": {"events": [
        {"kind": "log", "data": {"text": f"written with {c}"}}]}}), 200, any_rank=True),
    "api.post_rank_status": Route("job", lambda w, c, m: ("POST", f"{P}/jobs/{job_of(w, c)}/ranks/0",
                                                          {"json": {"status": "running"}}), 200),
    "api.post_rank_layout": Route("job", lambda w, c, m: ("POST", f"{P}/jobs/{job_of(w, c)}/ranks/0/layout",
                                                          {"json": {"role": "replica", "text": "the whole model"}}),
                                  200),
    "api.put_weights": Route("job", lambda w, c, m: ("PUT", f"{P}/jobs/{job_of(w, c)}/weights", {"data": b"w"}),
                             201),
    # Each rank sends its own file (another rank's is refused: test_integrity.py), to a checkpoint not
    # committed yet (checkpoint 0 is, by the commit route's cells).
    "checkpoints.put_checkpoint_file": Route("job", lambda w, c, m: (
        "PUT", f"{P}/jobs/{job_of(w, c)}/checkpoints/1/rng-0.pt", {"data": b"rng"}), 201),
    "checkpoints.commit_checkpoint": Route("job", lambda w, c, m: (
        "POST", f"{P}/jobs/{job_of(w, c)}/checkpoints/0/commit", {"json": {"files": list(CHECKPOINT)}}), 201,
        prepare=uploaded),
    "checkpoints.list_checkpoints": Route("room", lambda w, c, m: (
        "GET", f"{P}/jobs/{w.jobs['live']}/checkpoints", {}), 200),
    "checkpoints.get_checkpoint_file": Route("room_or_job", lambda w, c, m: (
        "GET", f"{P}/jobs/{job_of(w, c)}/checkpoints/0/state.pt", {}), 200, any_rank=True, prepare=committed),
    "diloco.put_round": Route("job", lambda w, c, m: (
        "PUT", f"{P}/jobs/{job_of(w, c)}/diloco/rounds/{m}", {"data": NOTHING}), 201, any_rank=True,
        prepare=fresh_round),
    "diloco.get_round": Route("job", lambda w, c, m: ("GET", f"{P}/jobs/{job_of(w, c)}/diloco/rounds/{m}", {}), 200,
                              any_rank=True, prepare=averaged_round),
    # No worker waits to join the live job: its ranks' keys get past authorization to the 409 that says so.
    "diloco.put_state": Route("job", lambda w, c, m: ("PUT", f"{P}/jobs/{job_of(w, c)}/diloco/state/0",
                                                      {"data": b"state"}), 409, any_rank=True),
    "diloco.get_state": Route("job", lambda w, c, m: ("GET", f"{P}/jobs/{job_of(w, c)}/diloco/state", {}), 409,
                              any_rank=True),
    # A model's start weights (one float32 parameter), as the SDK sends them before a DILOCO job.
    "diloco.post_start": Route("room", lambda w, c, m: ("POST", f"{P}/diloco/start", {"data": global_weights.write(
        {"w": ("F32", [2], bytes(8))}, {"parameters": '[["w"]]'})}), 201, own_room=201),
    "dashboard_api.history": Route("room", lambda w, c, m: ("GET", f"{P}/dashboard/history", {}), 200,
                                   own_room=200),
    "tokens.list_tokens": Route("room", lambda w, c, m: ("GET", f"{P}/room/tokens", {}), 200, own_room=200),
    "tokens.create_token": Route("room", lambda w, c, m: ("POST", f"{P}/room/tokens", {"json": {"role": "donor"}}),
                                 201, own_room=201),
    "tokens.revoke_token": Route("room", lambda w, c, m: ("DELETE", f"{P}/room/tokens/{m}", {}), 200,
                                 prepare=fresh_token),
    "tokens.rotate_token": Route("room", lambda w, c, m: ("POST", f"{P}/room/tokens/{m}/rotate", {}), 200,
                                 prepare=fresh_token),
    "scripts.put_workdir": Route("room", lambda w, c, m: ("PUT", f"{P}/workdirs/{m[1]}", {"data": m[0]}), 201,
                                 own_room=201, prepare=fresh_workdir),
    "scripts.get_workdir": Route("room", lambda w, c, m: ("GET", f"{P}/workdirs/{m}", {}), 200,
                                 prepare=stored_workdir),
    # A GPU client's link measurement: any room's donor token (it names nothing of a room).
    "links.link_down": Route("donor", lambda w, c, m: ("GET", f"{P}/link?bytes=1000", {}), 200),
    "links.link_up": Route("donor", lambda w, c, m: ("POST", f"{P}/link", {"data": b"x" * 1000}), 200),
    "datasets.missing_chunks": Route("room", lambda w, c, m: (
        "POST", f"{P}/datasets/chunks/missing", {"json": {"chunks": [w.dataset["chunk"]]}}), 200, own_room=200),
    "datasets.put_chunk": Route("room", lambda w, c, m: ("PUT", f"{P}/datasets/chunks/{m[1]}", {"data": m[0]}), 201,
                                own_room=201, prepare=fresh_workdir),
    # Room B's submitter naming room A's chunk: not in its room (400, nothing stored).
    "datasets.create_version": Route("room", lambda w, c, m: ("POST", f"{P}/datasets", {"json": m}), 201,
                                     own_room=400, prepare=fresh_manifest),
    "datasets.list_datasets": Route("room", lambda w, c, m: ("GET", f"{P}/datasets", {}), 200, own_room=200),
    "datasets.get_dataset": Route("room", lambda w, c, m: ("GET", f"{P}/datasets/tiny", {}), 200),
    "datasets.remove_dataset": Route("room", lambda w, c, m: ("DELETE", f"{P}/datasets/{m}", {}), 200,
                                     prepare=fresh_dataset),
    "datasets.get_job_manifest": Route("job", lambda w, c, m: (
        "GET", f"{P}/jobs/{job_of(w, c)}/datasets/{w.dataset['version']}", {}), 200, any_rank=True),
    "datasets.get_job_chunk": Route("job", lambda w, c, m: (
        "GET", f"{P}/jobs/{job_of(w, c)}/datasets/{w.dataset['version']}/chunks/{w.dataset['chunk']}", {}), 200,
        any_rank=True),
    "scripts.put_outputs": Route("job", lambda w, c, m: ("PUT", f"{P}/jobs/{job_of(w, c)}/outputs", {"data": b"t"}),
                                 201),
    "scripts.get_outputs": Route("room", lambda w, c, m: ("GET", f"{P}/jobs/{w.jobs['live']}/outputs", {}), 200,
                                 prepare=outputs),
}


def expected(route: Route, column: str) -> int:
    """The status a cell must get (see the module's docstring)."""
    if route.auth in ("public", "page"):
        return route.ok
    if route.auth == "no_route":
        return 404
    if route.auth == "donor":  # a submitter token is refused (403), a rank key is no room token (401)
        return {"donor": route.ok, "legacy": route.ok, "other_donor": route.ok, "submitter": 403,
                "other_submitter": 403}.get(column, 401)
    room = {"none": 401, "wrong": 401, "revoked": 401, "other_donor": 403, "donor": 403, "legacy": route.ok,
            "submitter": route.ok, "other_submitter": route.own_room or 404}
    keys = {"wrong_key": 403, "old_attempt": 403, "ended_job": 403, "rank": route.ok,
            "other_rank": route.ok if route.any_rank else 403}
    if route.auth == "room":
        return room[column] if column in room else 401      # a rank key opens no room route
    if route.auth == "job":
        return keys[column] if column in keys else 401      # a room token is no rank's key
    return {**room, **keys}[column]                         # room_or_job


ERROR_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 409: "conflict"}


def test_every_route_and_event_has_an_entry(make_app):
    app = make_app()
    endpoints = {rule.endpoint for rule in app.url_map.iter_rules()}
    assert endpoints == set(ROUTES), f"routes without an entry: {endpoints - set(ROUTES)}; " \
                                     f"entries without a route: {set(ROUTES) - endpoints}"
    for endpoint in endpoints:  # the matrix's kind of each route is the one its operation declares
        op = getattr(app.view_functions[endpoint], "operation", None)
        if op is not None and endpoint != "api.no_route":
            kind = {"none": "public", "room": "room", "job": "job", "room or job": "room_or_job",
                    "donor": "donor"}[op.auth.value]
            assert ROUTES[endpoint].auth == kind, endpoint
    names = {value for name, value in vars(ev).items() if name.startswith("EV_")}
    assert names == set(EVENTS), f"events without an entry: {names - set(EVENTS)}"


def _changed(before: dict, after: dict) -> dict:
    """What differs between two snapshots: table -> (rows gone, rows new)."""
    out = {}
    for table in sorted(set(before) | set(after)):
        old, new = before.get(table, []), after.get(table, [])
        if old != new:
            if isinstance(old, dict) or isinstance(new, dict):
                out[table] = (old, new)
            else:
                out[table] = ([r for r in old if r not in new][:5], [r for r in new if r not in old][:5])
    return out


@pytest.mark.parametrize("endpoint", sorted(ROUTES))
def test_each_route_answers_each_credential_as_the_matrix_says(shared_world, endpoint):
    w, route = shared_world, ROUTES[endpoint]
    a_ids = {w.rooms["A"]["id"], w.jobs["live"], w.jobs["done"], w.bundle, w.weights}
    op = getattr(w.app.view_functions[endpoint], "operation", None)
    declared = None if op is None else set(op.answers) | set(op.errors)

    def ask(column: str, made) -> None:
        want = expected(route, column)
        method, url, kwargs = route.call(w, column, made)
        resp = w.client.open(url, method=method, headers=headers(w, column), **kwargs)
        cell = f"{method} {url} as {column}"
        assert resp.status_code == want, f"{cell}: {resp.status_code} {resp.get_data(as_text=True)[:300]}"
        assert declared is None or want in declared, f"{cell}: {want} is not in its OpenAPI operation {declared}"
        if want >= 400 and route.auth != "no_route":
            assert resp.json["error"]["code"] == ERROR_CODES[want], cell
        elif column == "other_submitter" and route.auth == "room":
            body = resp.get_data(as_text=True)  # room B's own answer: nothing of room A in it
            assert not any(i in body for i in a_ids), f"{cell} showed room A's objects"

    refused = [c for c in COLUMNS if expected(route, c) >= 400]
    made = route.prepare(w)
    before = snapshot(w)
    for column in refused:
        ask(column, made)
    after = snapshot(w)
    assert after == before, f"{endpoint}: refused to {refused}, yet what is stored changed: {_changed(before, after)}"
    for column in (c for c in COLUMNS if c not in refused):
        ask(column, route.prepare(w))


# -- Socket.IO -----------------------------------------------------------------------------------
def connect(w: World, namespace: str, column: str):
    """A test client on ``namespace`` with the column's token (or rank key) as its ``auth``."""
    from zwdx.server import socketio
    token = {**headers(w, column)}.popitem()[1] if column != "none" else None
    return socketio.test_client(w.app, namespace=namespace, auth=connect_auth(token) if token else None)


#: Who may connect: /gpu with a donor token (a legacy one too; room B's donor joins room B), /ui
#: with a submitter token (room B's opens room B).
CONNECTS = {ev.GPU_NAMESPACE: {"donor", "legacy", "other_donor"}, ev.UI_NAMESPACE: {"submitter", "legacy",
                                                                                      "other_submitter"}}


def test_each_namespace_lets_in_only_its_role(world):
    for namespace, allowed in CONNECTS.items():
        for column in COLUMNS:
            before = snapshot(world)
            sock = connect(world, namespace, column)
            assert sock.is_connected(namespace) == (column in allowed), (namespace, column)
            if sock.is_connected(namespace):
                sock.disconnect(namespace=namespace)
            assert snapshot(world) == before, (namespace, column)


def _register(sock, client_id: str, secret: str | None = None, w: World | None = None) -> dict:
    """Register as ``client_id``; with ``w``, saying it still runs its ranks of the live job (a
    client that says it runs none has them declared exited)."""
    running = [{"job_id": w.jobs["live"], "attempt": 1}] if w is not None else []
    return sock.emit(ev.EV_REGISTER, {"client_id": client_id, **HELLO, "running": running,
                                      **({"client_secret": secret} if secret else {})},
                     namespace=ev.GPU_NAMESPACE, callback=True)


def register_cells(w: World):
    """register as room A's client a1: only with a donor token of room A and a1's secret."""
    for column, secret, want in [("donor", None, "client_secret"), ("legacy", None, "client_secret"),
                                 ("donor", "zc_forged-secret-of-a1", "client_secret"),
                                 ("other_donor", w.secrets["a1"], "belongs to another room"),
                                 ("donor", w.secrets["a1"], "ok"), ("legacy", w.secrets["a1"], "ok")]:
        sock = connect(w, ev.GPU_NAMESPACE, column)
        before = snapshot(w)
        answer = _register(sock, "a1", secret, w)
        if want == "ok":
            assert answer["ok"] and "client_secret" not in answer, (column, answer)  # it has one already
        else:
            assert answer["ok"] is False and (answer.get("code") == want or want in answer["error"]), (column, answer)
            assert snapshot(w) == before, column
        sock.disconnect(namespace=ev.GPU_NAMESPACE)


def heartbeat_cells(w: World):
    """A heartbeat speaks for the client its connection registered, in the token's room."""
    for column in ("donor", "legacy", "other_donor"):
        sock = connect(w, ev.GPU_NAMESPACE, column)
        before = snapshot(w)
        assert sock.emit(ev.EV_HEARTBEAT, {"slots": []}, namespace=ev.GPU_NAMESPACE, callback=True) == \
            {"ok": False, "error": "heartbeat before register"}
        assert snapshot(w) == before, column
        client_id = f"beat-{column}"
        assert _register(sock, client_id)["ok"]
        assert sock.emit(ev.EV_HEARTBEAT, {"slots": [{"index": 0, "memory_free": 5}]}, namespace=ev.GPU_NAMESPACE,
                         callback=True) == {"ok": True}
        room = "B" if column == "other_donor" else "A"
        assert w.store.get_client(client_id)["room_id"] == w.rooms[room]["id"]
        sock.disconnect(namespace=ev.GPU_NAMESPACE)


def ranks_exited_cells(w: World):
    """Exits of the live job's attempt 1: only from the client each rank was placed on."""
    live = w.jobs["live"]
    exits = {"job_id": live, "attempt": 1, "exits": {"0": 0}}
    for column, client_id, report, error in [
            ("donor", "a2", exits, "not placed on this gpu client"),                 # rank 0 is a1's
            ("donor", "a1", {**exits, "exits": {"0": 0, "1": 0}}, "not placed on this gpu client"),  # rank 1 is a2's
            ("other_donor", "b1", exits, "no such job in this room")]:
        sock = connect(w, ev.GPU_NAMESPACE, column)
        assert _register(sock, client_id, w.secrets[client_id], w if client_id != "b1" else None)["ok"]
        before = snapshot(w)
        answer = sock.emit(ev.EV_RANKS_EXITED, report, namespace=ev.GPU_NAMESPACE, callback=True)
        assert answer["ok"] is False and error in answer["error"], (column, client_id, answer)
        assert snapshot(w) == before, (column, client_id)
        sock.disconnect(namespace=ev.GPU_NAMESPACE)
    sock = connect(w, ev.GPU_NAMESPACE, "donor")
    assert _register(sock, "a1", w.secrets["a1"], w)["ok"]
    assert sock.emit(ev.EV_RANKS_EXITED, exits, namespace=ev.GPU_NAMESPACE, callback=True) == {"ok": True}
    assert w.store.get_job(live).exits == {"0": 0}
    sock.disconnect(namespace=ev.GPU_NAMESPACE)


def unreachable_cells(w: World):
    """A GPU client says which peers of a DDP/FSDP job it cannot reach: only for a job of its room
    that it and those peers are placed on. Accepted, the job is placed again without the pair (or
    fails naming it) and both remember it."""
    w.store.release_slots(w.jobs["done"])
    live = w.submit(world_size=2)["id"]  # DDP
    w.place(live, {0: "a1:1", 1: "a2:1"}, {0: f"rk_ddp0_{secrets.token_hex(8)}", 1: f"rk_ddp1_{secrets.token_hex(8)}"})
    report = {"job_id": live, "attempt": 0, "peers": {"a2": "no route to host"}}
    sock = connect(w, ev.GPU_NAMESPACE, "donor")
    before = snapshot(w)
    assert sock.emit(ev.EV_UNREACHABLE, report, namespace=ev.GPU_NAMESPACE, callback=True) == \
        {"ok": False, "error": "unreachable before register"}
    assert snapshot(w) == before
    sock.disconnect(namespace=ev.GPU_NAMESPACE)
    for column, client_id, sent, error in [
            ("other_donor", "b1", report, "no such job in this room"),
            ("donor", "a3", report, "has no rank on this gpu client"),             # of room A, not placed
            ("donor", "a1", {**report, "peers": {"b1": "refused"}}, "no peers"),  # room B's client
            ("donor", "a1", {**report, "peers": {"a1": "refused"}}, "no peers"),  # itself
            ("donor", "a1", {**report, "job_id": w.jobs["live"], "attempt": 1}, "need not reach")]:  # DILOCO
        sock = connect(w, ev.GPU_NAMESPACE, column)
        answer = _register(sock, client_id, w.secrets.get(client_id), w if client_id in ("a1", "a2") else None)
        assert answer["ok"], answer
        w.secrets.setdefault(client_id, answer.get("client_secret"))
        before = snapshot(w)
        answer = sock.emit(ev.EV_UNREACHABLE, sent, namespace=ev.GPU_NAMESPACE, callback=True)
        assert answer["ok"] is False and error in answer["error"], (column, client_id, answer)
        assert snapshot(w) == before, (column, client_id)
        sock.disconnect(namespace=ev.GPU_NAMESPACE)
    sock = connect(w, ev.GPU_NAMESPACE, "donor")
    assert _register(sock, "a1", w.secrets["a1"], w)["ok"]
    assert sock.emit(ev.EV_UNREACHABLE, report, namespace=ev.GPU_NAMESPACE, callback=True) == {"ok": True}
    job = w.store.get_job(live)  # no other GPU client of room A online (a3 left): it fails (test_reach.py: placed again)
    assert job.status == "failed" and "a1 (host h) and a2 (host h) cannot reach each other" in job.reason
    assert 'parallelism="DILOCO"' in job.reason
    apart = {cid: [e["client_id"] for e in w.store.get_client(cid).get("unreachable") or []] for cid in ("a1", "a2", "b1")}
    assert apart == {"a1": ["a2"], "a2": ["a1"], "b1": []}
    sock.disconnect(namespace=ev.GPU_NAMESPACE)


def _received(sock, namespace: str) -> dict[str, list]:
    """What came to ``sock`` since last asked: event -> its payloads, in order."""
    out: dict[str, list] = {}
    for message in sock.get_received(namespace):
        out.setdefault(message["name"], []).append(message["args"][0])
    return out


def server_to_client_cells(w: World):
    """What the server sends goes to those it concerns only: a job's GPU clients (each its own
    ranks' keys), the room's dashboards."""
    from zwdx.protocol.job import Master
    from zwdx.server.jobs import Job, placing
    ctx, live = w.app.extensions["zwdx"], w.jobs["live"]
    gpus = {cid: sock for cid, sock in w.sockets.items()}
    for sock in gpus.values():
        sock.get_received(ev.GPU_NAMESPACE)  # what came so far
    dashboards = {c: connect(w, ev.UI_NAMESPACE, c) for c in ("submitter", "legacy", "other_submitter")}
    for column, sock in dashboards.items():
        pushed = _received(sock, ev.UI_NAMESPACE).get(ev.EV_CLIENTS_UPDATE, [])
        want = {"b1"} if column == "other_submitter" else {"a1", "a2"}
        assert {c["id"] for c in pushed[0]["clients"]} >= want and not \
            ({c["id"] for c in pushed[0]["clients"]} & ({"a1", "a2", "b1"} - want)), (column, pushed)
    with w.app.app_context():
        record = w.store.get_job(live)
        ctx.scheduler._ask_port(record, {0: w.keys["rank0"], 1: w.keys["rank1"]}, w.store.get_client("a1"))
        assert Job.load(w.store, live).rendezvous(Master(addr="127.0.0.1", port=29500))
        placing.assign(ctx, w.store.get_job(live), {0: w.keys["rank0"], 1: w.keys["rank1"]})
    came = {cid: _received(s, ev.GPU_NAMESPACE) for cid, s in gpus.items()}
    asked = {cid: got.get(ev.EV_RESERVE_PORT, []) for cid, got in came.items()}
    assert {cid for cid, got in asked.items() if got} == {"a1"}, asked
    assigned = {cid: got.get(ev.EV_JOB_ASSIGN, []) for cid, got in came.items()}
    assert {cid: [(r["rank"], r["key"]) for a in got for r in a["ranks"]] for cid, got in assigned.items()} == \
        {"a1": [(0, w.keys["rank0"])], "a2": [(1, w.keys["rank1"])], "b1": []}
    with w.app.app_context():  # a waiting job asks the clients that lack its package to look again
        from zwdx.server import clients as client_life
        lacking = {**w.store.get_client("a2"), "modules": "torch numpy"}
        assert client_life.ask_refresh(live, {"required_modules": ["their_pkg"]}, [lacking]) == 1
    refreshed = {cid: _received(s, ev.GPU_NAMESPACE).get(ev.EV_REFRESH, []) for cid, s in gpus.items()}
    assert {cid for cid, got in refreshed.items() if got} == {"a2"}, refreshed
    assert refreshed["a2"][0]["modules"] == ["their_pkg"]
    resp = w.request("POST", f"/jobs/{live}/events", w.as_rank("rank0"), json={"events": [
        {"kind": "log", "data": {"text": "for room A's dashboards"}}]})
    assert resp.json == {"stored": 1}, resp.text
    assert w.request("POST", f"/jobs/{live}/cancel", w.as_submitter()).status_code == 200
    cancelled = {cid: _received(s, ev.GPU_NAMESPACE).get(ev.EV_JOB_CANCEL, []) for cid, s in gpus.items()}
    assert {cid for cid, got in cancelled.items() if got} == {"a1", "a2"}, cancelled
    for column, sock in dashboards.items():
        came = _received(sock, ev.UI_NAMESPACE)
        updates, events = came.get(ev.EV_JOB_UPDATE, []), came.get(ev.EV_JOB_EVENTS, [])
        if column == "other_submitter":
            assert updates == [] and events == [], column
        else:
            assert updates and updates[-1]["id"] == live and updates[-1]["status"] == "cancelled", column
            assert events and events[-1]["events"][0]["data"] == {"text": "for room A's dashboards"}, column
        sock.disconnect(namespace=ev.UI_NAMESPACE)


#: Each event, and the cells that check who may send it or who receives it.
EVENTS = {
    ev.EV_REGISTER: register_cells,
    ev.EV_HEARTBEAT: heartbeat_cells,
    ev.EV_RANKS_EXITED: ranks_exited_cells,
    ev.EV_UNREACHABLE: unreachable_cells,
    ev.EV_RESERVE_PORT: server_to_client_cells,
    ev.EV_JOB_ASSIGN: server_to_client_cells,
    ev.EV_JOB_CANCEL: server_to_client_cells,
    ev.EV_JOB_UPDATE: server_to_client_cells,
    ev.EV_JOB_EVENTS: server_to_client_cells,
    ev.EV_CLIENTS_UPDATE: server_to_client_cells,
    ev.EV_REFRESH: server_to_client_cells,
}


@pytest.mark.parametrize("cells", sorted(set(EVENTS.values()), key=lambda f: f.__name__),
                         ids=lambda f: f.__name__)
def test_each_socketio_event_as_the_matrix_says(world, cells):
    cells(world)
