"""Fake donors (issue 29: M3, L7, L3), replayed in-process over both stores: anyone a room gives
a donor token may run a GPU client that claims anything and does nothing.

- M3: a client claiming memory no hardware has is refused; jobs spread over the room's GPU
  clients rather than all going to the biggest; a client that takes a job and never starts it
  (never offers a rendezvous address, or never runs a rank) holds it for ``START_TIMEOUT`` at
  most: the job is placed again, not on that client, and fails after ``START_TRIES``.
- L7: one donor token is held to ``DONOR_MAX_CLIENTS`` clients online, ``CLIENT_MAX_SLOTS``
  slots each, and ``RATE_LIMIT_REGISTERS`` registers.
- L3: control characters in a client's names are refused at register, and escaped when
  ``zwdx room clients`` prints names stored before.
"""
from __future__ import annotations

import types
import uuid
from collections import Counter

import pytest

from security_world import *  # noqa: F401,F403  (fixtures: world, backend, ...)
from security_world import HELLO, snapshot
from procs import wait_until
from zwdx import defaults
from zwdx.protocol.job import Master
from wire_auth import connect_auth

GiB = 1 << 30


def connect(w, token: str | None = None):
    from zwdx.server import socketio
    return socketio.test_client(w.app, namespace="/gpu", auth=connect_auth(token or w.tokens["donor"]))


def register(sock, client_id: str, **hello) -> dict:
    return sock.emit("register", {"client_id": client_id, **{**HELLO, **hello}}, namespace="/gpu", callback=True)


def cpu_slots(n: int, memory: int = GiB, free: int | None = None) -> list[dict]:
    return [{"index": i, "kind": "cpu", "memory_total": memory, "memory_free": memory if free is None else free}
            for i in range(n)]


def ctx(w):
    return w.app.extensions["zwdx"]


def schedule(w) -> None:
    with w.app.app_context():
        ctx(w).scheduler.schedule_once()


def settle(w) -> None:
    from zwdx.server.jobs import lifecycle
    with w.app.app_context():
        lifecycle.settle_suspects(ctx(w), w.rooms["A"]["id"])


def placed_on(w, job_id: str) -> set[str]:
    return {p.client_id for p in w.store.get_job(job_id).placement or []}


# -- M3: claims no hardware makes ------------------------------------------------------------------
@pytest.mark.parametrize("slot, field", [
    # the review's client: 256 slots of 2**61 bytes each, 5.9e20 bytes in all
    ({"index": 0, "kind": "cuda", "name": "GPU", "memory_total": 1 << 61, "memory_free": 1 << 61},
     "slots.0.memory_total"),
    ({"index": 0, "kind": "cuda", "name": "GPU", "memory_total": 600 * GiB, "memory_free": 0}, "slots.0"),
    ({"index": 0, "kind": "cpu", "memory_total": 1 << 50, "memory_free": 1 << 50}, "slots.0.memory_total"),
    ({"index": 0, "kind": "cpu", "memory_total": GiB, "memory_free": 2 * GiB}, "slots.0"),
])
def test_a_register_claiming_memory_no_hardware_has_is_refused_and_stores_nothing(world, slot, field):
    sock = connect(world)
    before = snapshot(world)
    answer = register(sock, "fake-big", slots=[slot])
    assert answer["ok"] is False and f"field '{field}'" in answer["error"], answer
    assert "memory" in answer["error"]
    assert snapshot(world) == before
    beat = sock.emit("heartbeat", {"slots": [{"index": 0, "memory_free": 1 << 61, "memory_total": GiB}]},
                     namespace="/gpu", callback=True)
    assert beat["ok"] is False  # nor by a heartbeat later (this one is unregistered, and refused first for it)
    answer = world.sockets["a1"].emit("heartbeat", {"slots": [{"index": 0, "memory_free": 2 * GiB,
                                                               "memory_total": GiB}]}, namespace="/gpu", callback=True)
    assert answer["ok"] is False and "memory_free must be at most memory_total" in answer["error"], answer


def test_a_heartbeat_saying_null_for_a_figure_changes_nothing_and_the_room_stays_readable(world):
    """A donor's heartbeat naming ``memory_total: null`` (or any figure as null) keeps what was
    registered: the room's page (GET /room, the dashboard's list) never turns into a 500."""
    answer = world.sockets["a1"].emit("heartbeat", {"slots": [{"index": 0, "memory_free": GiB // 2, "memory_total": None,
                                                               "utilization": None}]}, namespace="/gpu", callback=True)
    assert answer["ok"] is True, answer
    room = world.request("GET", "/room", world.as_submitter())
    assert room.status_code == 200, room.text
    [slot] = [s for c in room.json["clients"] if c["id"] == "a1" for s in c["slots"] if s["index"] == 0]
    assert slot["memory_total"] == HELLO["slots"][0]["memory_total"] and slot["memory_free"] == GiB // 2, slot


def test_a_claim_stored_before_draws_no_job_by_memory_no_hardware_has(world):
    """A record stored before registers were checked: placement believes no more than a GPU has."""
    from zwdx.server.placement import plan
    spec = {"world_size": 1, "memory_required": 600 * GiB, "versions": {"python": HELLO["versions"]["python"]}}
    slot = {"id": "old:0", "client_id": "old", "index": 0, "kind": "cuda", "memory_total": 1 << 61,
            "memory_free": 1 << 61, "job_id": None}
    client = {"id": "old", "status": "online", "versions": HELLO["versions"], "hostname": "old"}
    chosen, why = plan({"spec": spec}, [slot], {"old": client})
    assert chosen is None and "less than 600.0 GiB of memory in all" in why


# -- M3: spreading ---------------------------------------------------------------------------------
def test_jobs_spread_over_gpu_clients_rather_than_all_going_to_the_biggest(world):
    world.store.release_slots(world.jobs["done"])  # a1 and a2: one free slot each, one busy (the live job)
    sock = connect(world)
    assert register(sock, "fake-wide", slots=cpu_slots(16))["ok"]
    jobs = [world.submit(world_size=1)["id"] for _ in range(3)]
    schedule(world)
    held = Counter(client for job in jobs for client in placed_on(world, job))
    assert sum(held.values()) == 3, held
    assert held["fake-wide"] <= 1, f"the client with the most slots drew {held['fake-wide']} of 3 jobs: {held}"
    assert set(held) == {"a1", "a2", "fake-wide"}  # one job each (a1 and a2 run the live job too)
    sock.disconnect(namespace="/gpu")


# -- M3: a client that takes a job and never starts it ---------------------------------------------
def test_a_job_whose_ranks_never_start_is_placed_again_elsewhere_then_fails(world):
    world.app.extensions["zwdx"].reconfigure(START_TIMEOUT=0.3, START_TRIES=2)
    sock = connect(world)
    assert register(sock, "fake-idle", slots=cpu_slots(1))["ok"]
    job_id = world.submit(world_size=1)["id"]
    key = f"rk_fake_{uuid.uuid4().hex}"
    world.place(job_id, {0: "fake-idle:0"}, {0: key})
    from zwdx.server.jobs import Job
    assert Job.load(world.store, job_id).rendezvous(Master(addr="127.0.0.1", port=29500))  # assigned, never run

    def requeued():
        settle(world)
        return world.store.get_job(job_id).status == "queued"
    wait_until(requeued, 10, what="the job placed again")
    job = world.store.get_job(job_id)
    assert job.avoid == ["fake-idle"] and job.start_failures == 1 and job.placement is None
    assert job.timeline[-1].reason == ("placed again, not on gpu client(s) fake-idle: no rank reported running "
                                       "within 0.3 s of its placement; gpu client(s) fake-idle never said they run it")
    assert not any(s["job_id"] for s in world.store.list_slots(world.rooms["A"]["id"], "fake-idle"))
    assert world.request("POST", f"/jobs/{job_id}/ranks/0", {defaults.RANK_KEY_HEADER: key},
                         json={"status": "running"}).status_code in (401, 403)  # its key is void
    cancels = [e for e in sock.get_received("/gpu") if e["name"] == "job_cancel"]
    assert cancels and cancels[-1]["args"][0]["job_id"] == job_id

    schedule(world)  # elsewhere: fake-idle's slot is free, and passed over
    assert placed_on(world, job_id) and "fake-idle" not in placed_on(world, job_id)
    assert Job.load(world.store, job_id).rendezvous(Master(addr="127.0.0.1", port=29500))

    def failed():
        settle(world)
        return world.store.get_job(job_id).status == "failed"
    wait_until(failed, 10, what="the job failed")
    job = world.store.get_job(job_id)
    assert "gave up after 2 placement(s) that did not start" in job.reason, job.reason
    assert not any(s["job_id"] == job_id for s in world.store.list_slots(world.rooms["A"]["id"]))
    sock.disconnect(namespace="/gpu")


def test_beside_an_honest_gpu_client_only_the_one_that_never_ran_the_job_is_passed_over(world):
    """An honest client's ranks wait in the rendezvous for the fake's: the honest one said in its
    heartbeat that it runs the job, so only the fake is held against it."""
    world.app.extensions["zwdx"].reconfigure(START_TIMEOUT=0.3)
    sock = connect(world)
    assert register(sock, "fake-idle", slots=cpu_slots(1))["ok"]
    job_id = world.submit(world_size=2)["id"]
    world.place(job_id, {0: "a2:1", 1: "fake-idle:0"}, {0: f"rk_{uuid.uuid4().hex}", 1: f"rk_{uuid.uuid4().hex}"})
    from zwdx.server.jobs import Job
    assert Job.load(world.store, job_id).rendezvous(Master(addr="127.0.0.1", port=29500))
    attempt = world.store.get_job(job_id).attempt
    beat = world.sockets["a2"].emit("heartbeat", {"running": [{"job_id": job_id, "attempt": attempt}]},
                                    namespace="/gpu", callback=True)
    assert beat["ok"], beat

    def requeued():
        settle(world)
        return world.store.get_job(job_id).status == "queued"
    wait_until(requeued, 10, what="the job placed again")
    job = world.store.get_job(job_id)
    assert job.avoid == ["fake-idle"], job.avoid
    assert job.timeline[-1].reason.endswith("gpu client(s) fake-idle never said they run it")
    sock.disconnect(namespace="/gpu")


def test_a_gpu_client_that_never_offers_a_rendezvous_address_holds_no_job(world):
    world.app.extensions["zwdx"].reconfigure(RESERVE_TIMEOUT=0.2)
    sock = connect(world)  # the test client hears reserve_port and never answers it
    assert register(sock, "fake-mute", slots=cpu_slots(2))["ok"]
    job_id = world.submit(world_size=1)["id"]
    schedule(world)
    assert placed_on(world, job_id) == {"fake-mute"}  # the least busy client

    def requeued():
        with world.app.app_context():
            ctx(world).scheduler.finish_placements()
        return world.store.get_job(job_id).status != "starting"
    wait_until(requeued, 10, what="the placement given up")
    job = world.store.get_job(job_id)
    assert job.status == "queued", (job.status, job.reason)
    assert job.avoid == ["fake-mute"] and "did not offer a rendezvous address" in job.timeline[-1].reason
    schedule(world)
    assert placed_on(world, job_id) and "fake-mute" not in placed_on(world, job_id)
    sock.disconnect(namespace="/gpu")


def test_a_job_only_passed_over_clients_could_run_holds_back_no_job_behind_it(world):
    world.store.release_slots(world.jobs["done"])  # a1 and a2: one free slot each
    held = world.submit(world_size=1)["id"]
    assert world.store.set_job(held, {"avoid": ["a1", "a2"]}, when=["queued"])
    behind = world.submit(world_size=1)["id"]
    schedule(world)
    assert world.store.get_job(held).status == "queued"
    assert "gpu client(s) a1, a2 held a placement of this job that did not start" in \
        world.store.get_job(held).waiting_reason
    assert placed_on(world, behind) & {"a1", "a2"}, "the job behind it waited for it"


# -- L7: what one donor token may register ---------------------------------------------------------
def test_one_donor_token_is_held_to_its_clients_and_slots(world):
    world.app.extensions["zwdx"].reconfigure(DONOR_MAX_CLIENTS=3, CLIENT_MAX_SLOTS=16)
    sock = connect(world)
    before = snapshot(world)
    answer = register(sock, "wide", slots=cpu_slots(17))
    assert answer["ok"] is False and "field 'slots' has 17 slot(s)" in answer["error"] and "16" in answer["error"]
    assert snapshot(world) == before
    first = register(sock, "fake-1", slots=cpu_slots(16))  # a1 and a2 are online under this token already
    assert first["ok"], first
    other = connect(world)
    before = snapshot(world)
    answer = register(other, "fake-2")
    assert answer["ok"] is False and "has 3 gpu client(s) online already" in answer["error"], answer
    assert snapshot(world) == before
    again = connect(world)  # its own reconnect is no new client
    assert register(again, "fake-1", client_secret=first["client_secret"], slots=cpu_slots(16))["ok"]
    bystander = connect(world, world.tokens["other_donor"])  # another room's token has its own count
    assert register(bystander, "b-2")["ok"]
    for s in (sock, again):
        s.disconnect(namespace="/gpu")
    assert register(other, "fake-2")["ok"]  # fake-1 went offline
    for s in (other, bystander):
        s.disconnect(namespace="/gpu")


def test_registers_of_one_donor_token_are_rate_limited(world):
    world.app.extensions["zwdx"].reconfigure(RATE_LIMIT_REGISTERS="3 per minute", DONOR_MAX_CLIENTS=0)
    socks = [connect(world) for _ in range(4)]
    for i, sock in enumerate(socks[:3]):
        assert register(sock, f"churn-{i}")["ok"]
    answer = register(socks[3], "churn-3")
    assert answer["ok"] is False and "registered more than 3 per minute" in answer["error"], answer
    bystander = connect(world, world.tokens["other_donor"])
    assert register(bystander, "b-2")["ok"]
    for sock in [*socks, bystander]:
        sock.disconnect(namespace="/gpu")


# -- L3: control characters ------------------------------------------------------------------------
OSC52 = "\x1b]52;c;Y3VybCBldmlsLnNoIHwgc2g=\x07"


@pytest.mark.parametrize("hello, field", [
    ({"hostname": f"box{OSC52}"}, "hostname"),
    ({"hostname": "box\x1b[2J\x1b[H"}, "hostname"),
    ({"hostname": "box\x9b31m"}, "hostname"),  # C1 CSI
    ({"slots": [{"index": 0, "kind": "cpu", "name": "CPU \u202egnp.exe", "memory_total": GiB, "memory_free": GiB}]},
     "slots.0.name"),
    ({"host_id": "h\x00"}, "host_id"),
    ({"versions": {"python": HELLO["versions"]["python"], "torch": "2.5\x1b[8m"}}, "versions.torch"),
])
def test_control_characters_in_a_register_are_refused_naming_the_field(world, hello, field):
    sock = connect(world)
    before = snapshot(world)
    answer = register(sock, "fake-term", **hello)
    assert answer["ok"] is False and f"field '{field}' must not contain control characters" in answer["error"], answer
    assert snapshot(world) == before
    sock.disconnect(namespace="/gpu")


def test_room_clients_escapes_control_characters_of_names_stored_before(world, capsys):
    from zwdx import jobs_cli
    room = world.rooms["A"]["id"]
    world.store.upsert_client({"id": "stored", "room_id": room, "hostname": f"box{OSC52}\x1b[2J", "status": "online",
                               "versions": HELLO["versions"], "last_seen": 1.0},
                              [{"id": "stored:0", "client_id": "stored", "room_id": room, "index": 0, "kind": "cpu",
                                "name": "CPU \u202egnp.exe", "memory_total": GiB, "memory_free": GiB}])
    doc = world.request("GET", "/room", world.as_submitter()).json
    sdk = types.SimpleNamespace(room_token="t", get_room=lambda token: doc)
    assert jobs_cli.room_clients(sdk, types.SimpleNamespace(json=False, clients_action=None)) == 0
    shown = capsys.readouterr().out
    assert "\x1b" not in shown and "\x07" not in shown and "\u202e" not in shown, repr(shown)
    assert "box\\x1b]52;c;" in shown and "\\u202egnp.exe" in shown
