"""Where a rank in a container may connect (issue 29 M1): the egress rules were built from what
GPU clients claim (``Register.advertise_addr``, ``PortOffer.addr``), so a submitter with a donor
token registered a fake GPU client "at" a machine of an honest donor's network, and the honest
donor's rank containers could reach that machine, and the donor's own address, on every port.

Now (``zwdx/server/reach.py``, ``gpu_client/agent/reach.py``, ``gpu_client/sandbox/container.py``): a
container reaches its peers only on the rendezvous port and the ephemeral ports gloo and NCCL
listen on, only at the addresses the server saw the peers connect from (recorded at register,
over both stores), this client's own, and peers' advertised addresses that answered this
client's reachability probe as themselves before any rank started.
"""
from __future__ import annotations

import json
import socket
import threading

import pytest

from procs import wait_until
from security_world import *  # noqa: F401,F403  (fixtures: world, backend, ...)
from zwdx.protocol import events as ev
from wire_auth import connect_auth

EPHEMERAL = (32768, 60999)
HONEST, FAKE, VICTIM = "198.51.100.10", "203.0.113.66", "192.168.1.1"


def hello(client_id: str, advertise: str, reach_port: int) -> dict:
    return {"client_id": client_id, "hostname": client_id, "advertise_addr": advertise, "reach_port": reach_port,
            "slots": [{"index": 0, "kind": "cpu", "memory_total": 1 << 30, "memory_free": 1 << 30}]}


def register_from(w, address: str, message: dict):
    """A GPU client of room A registering over a connection from ``address``."""
    from zwdx.server import socketio
    http = w.app.test_client()
    http.environ_base["REMOTE_ADDR"] = address
    sock = socketio.test_client(w.app, namespace="/gpu", auth=connect_auth(w.rooms["A"]["donor_token"]),
                                flask_test_client=http)
    answer = sock.emit("register", message, namespace="/gpu", callback=True)
    assert answer["ok"], answer
    w.sockets[message["client_id"]], sock.secret = sock, answer.get("client_secret")
    return sock


def test_a_fake_clients_claimed_address_opens_nothing_in_an_honest_clients_rules(world):
    """The attack: a fake GPU client says it is at a machine of the honest donor's network (and,
    as rank 0, that the rendezvous is there, on port 22)."""
    from zwdx.protocol.gpu import JobAssign
    from zwdx.protocol.job import Master
    from zwdx.server.jobs import Job, placing
    w = world
    honest = register_from(w, HONEST, hello("honest", HONEST, 41000))
    register_from(w, f"::ffff:{FAKE}", hello("fake", VICTIM, 80))
    job = w.submit(world_size=2, parallelism="DDP")
    w.place(job["id"], {0: "fake:0", 1: "honest:0"}, {0: "rk_fake", 1: "rk_honest"})
    honest.get_received("/gpu")
    ctx = w.app.extensions["zwdx"]
    with w.app.app_context():
        assert Job.load(w.store, job["id"]).rendezvous(Master(addr=VICTIM, port=22))
        placing.assign(ctx, w.store.get_job(job["id"]), {0: "rk_fake", 1: "rk_honest"})
    got = [m["args"][0] for m in honest.get_received("/gpu") if m["name"] == ev.EV_JOB_ASSIGN]
    assign = JobAssign.model_validate(got[0])
    assert assign.addresses == sorted([HONEST, FAKE])  # seen addresses, and its own: never the claim
    assert {c: w.store.get_client(c).get("seen_addr") for c in ("honest", "fake")} == {"honest": HONEST, "fake": FAKE}
    # the claim reaches the honest client only as a peer to probe, which it refuses (below)
    assert [(p.client_id, p.addr) for p in assign.peers] == [("fake", VICTIM), ("honest", HONEST)]


def test_a_reconnect_from_another_address_replaces_the_seen_one(world):
    first = register_from(world, "10.9.8.7", hello("mover", "10.9.8.7", 41000))
    first.disconnect(namespace="/gpu")
    register_from(world, "2001:db8::7", hello("mover", "10.9.8.7", 41000) | {"client_secret": first.secret})
    assert world.store.get_client("mover")["seen_addr"] == "2001:db8::7"


def _register_over_http(app, token: str, client_id: str, remote: str, forwarded_for: str) -> None:
    """A register through the app's WSGI stack (Engine.IO's polling transport), as a proxy at
    ``remote`` forwards it for ``forwarded_for``: ProxyFix sits there, not in Flask-SocketIO's
    test client."""
    http = app.test_client()
    http.environ_base["REMOTE_ADDR"] = remote
    headers = {"X-Forwarded-For": forwarded_for}
    opened = http.get("/socket.io/?EIO=4&transport=polling", headers=headers)
    assert opened.status_code == 200, opened.data
    url = f"/socket.io/?EIO=4&transport=polling&sid={json.loads(opened.data[1:])['sid']}"
    for packet in ("40/gpu," + json.dumps(connect_auth(token)),
                   "42/gpu,1" + json.dumps(["register", hello(client_id, "10.0.0.1", 41000)])):
        assert http.post(url, data=packet, headers=headers).status_code == 200
    wait_until(lambda: app.extensions["zwdx"].store.get_client(client_id), 10, what=f"{client_id} registered")


@pytest.mark.parametrize("hops, seen", [(1, "203.0.113.7"), (0, "172.18.0.5")])
def test_behind_proxy_hops_the_seen_address_is_the_forwarded_one(backend, make_app, tmp_path, hops, seen):
    """As for rate limits (test_proxy_hops.py): with PROXY_HOPS the client's address as the proxy
    forwards it; without, a forwarded address is not believed."""
    where = {"DATA_DIR": backend.where} if backend.name == "sqlite" else {
        "DATA_DIR": str(tmp_path / "mongo-app"), "MONGO_URI": backend.where}
    app = make_app(PROXY_HOPS=hops, **where)
    room = app.test_client().post("/api/v1/rooms", json={"name": "proxied"}).json
    _register_over_http(app, room["donor_token"], "proxied", "172.18.0.5", "203.0.113.7")
    assert app.extensions["zwdx"].store.get_client("proxied")["seen_addr"] == seen


def test_the_rules_name_only_rendezvous_and_collective_ports_at_allowed_addresses(monkeypatch):
    from gpu_client.sandbox import container
    from zwdx.protocol.rank import RankSpec
    monkeypatch.setattr(container, "ephemeral_ports", lambda: EPHEMERAL, raising=False)
    spec = RankSpec.model_construct(server="http://203.0.113.1:4461", master_addr=VICTIM, master_port=29500,
                                    peers=[HONEST, FAKE])
    allowed = container.destinations(spec)
    assert sorted(allowed, key=str) == sorted([("203.0.113.1", 4461), (HONEST, 29500), (HONEST, EPHEMERAL),
                                               (FAKE, 29500), (FAKE, EPHEMERAL)], key=str)
    assert all(port is not None for _, port in allowed)
    assert VICTIM not in {addr for addr, _ in allowed}  # the rendezvous address counts only as a peer's


def test_the_iptables_rules_carry_the_ports(monkeypatch):
    from gpu_client.sandbox.egress import Egress
    egress = Egress("test")
    egress.tools, applied = ["iptables", "ip6tables"], []
    monkeypatch.setattr(egress, "_apply", applied.append)
    egress.allow(2000001, [(HONEST, 29500), (HONEST, EPHEMERAL), ("2001:db8::1", EPHEMERAL)])
    v4, v6 = applied[0]["iptables"], applied[0]["ip6tables"]
    accepts = [r for r in v4 + v6 if r.endswith("-j ACCEPT") and " -d " in r]
    assert accepts == [f"-A ZWDX-test-2000001 -d {HONEST} -p tcp --dport 29500 -j ACCEPT",
                       f"-A ZWDX-test-2000001 -d {HONEST} -p tcp --dport 32768:60999 -j ACCEPT",
                       "-A ZWDX-test-2000001 -d 2001:db8::1 -p tcp --dport 32768:60999 -j ACCEPT"]


def test_a_claimed_address_opens_only_once_the_peer_answered_there_as_itself():
    """The honest client's probe of the fake peer's claimed address (a service of the donor's
    network, which answers as itself, not as the fake GPU client) fails: the job's ranks never
    start, so no rule names it; a peer that answers as itself is added."""
    from gpu_client.agent import reach
    from zwdx.protocol.gpu import JobAssign, Peer
    service = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=lambda: [c.sendall(b"SSH-2.0-OpenSSH_9.6\r\n") or c.close()
                                     for c in iter(lambda: service.accept()[0], None)], daemon=True).start()
    genuine = reach.Listener("127.0.0.1", "peer")
    try:
        peers = [Peer(client_id="fake", addr="127.0.0.1", port=service.getsockname()[1]),
                 Peer(client_id="peer", addr="127.0.0.1", port=genuine.port)]
        missed = reach.unreachable(peers, "honest", timeout=5)
        assert list(missed) == ["fake"] and "not as gpu client fake" in missed["fake"]
    finally:
        service.close()
        genuine.close()
    assign = JobAssign.model_construct(addresses=[HONEST], peers=[peers[1]])
    assert reach.egress_peers(assign) == sorted([HONEST, "127.0.0.1"])
