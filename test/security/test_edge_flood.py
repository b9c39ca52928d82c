"""Issue 29, H1, L5 and M4, against a real server process (gevent, as ``zwdx server`` runs):

- H1: while bodies of 8 MiB of ``[`` arrive in a loop (no token needed), ``/health`` and another
  room's GPU client's heartbeat still answer within 100 ms (p99 over the attack's windows; on a
  machine that answers slower in the calm windows between them, within 6 x their p99), and a body
  nested too deep is a 400 that says so;
- M4: a client that trickles a request's headers, one byte at a time, is cut off after the
  header timeout; a connection over the per-address cap is refused (429); ``/health`` answers;
- L5: Engine.IO sessions per address are capped (429), one that never connects to a namespace
  is closed after the auth timeout, and packets that are not Socket.IO close their session with
  one WARNING line, no traceback.

The attacker speaks from 127.0.0.2 (loopback too, another address), the bystanders from 127.0.0.1.
"""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest
import requests

from donor import Donor
from procs import SLACK, Server, wait_until
from test_tls import HttpsServer, pki  # noqa: F401 (fixture: a CA and the server's certificate)
from zwdx.protocol import EV_HEARTBEAT, GPU_NAMESPACE
from zwdx.protocol.gpu import Heartbeat, SlotStats

pytestmark = pytest.mark.slow

ATTACKER = "127.0.0.2"
HEADER_TIMEOUT = 2.0


def _from_attacker(server: Server, timeout: float = 10) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(server.host, server.port, timeout=timeout, source_address=(ATTACKER, 0))


def _raw(server: Server) -> socket.socket:
    sock = socket.create_connection((server.host, server.port), timeout=10, source_address=(ATTACKER, 0))
    return sock


def _p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


@pytest.fixture
def server(tmp_path):
    srv = Server(str(tmp_path / "server"), extra=["--rate-limit-rooms", "100000 per minute"], env={
        "ZWDX_HEADER_TIMEOUT": str(HEADER_TIMEOUT), "ZWDX_IDLE_TIMEOUT": "2", "ZWDX_BODY_TIMEOUT": "2", "ZWDX_MAX_CONNECTIONS_PER_ADDRESS": "20",
        "ZWDX_SOCKET_SESSIONS_PER_ADDRESS": "5", "ZWDX_SOCKET_AUTH_TIMEOUT": "2"})
    yield srv
    srv.stop()


def test_deep_json_in_a_loop_leaves_health_and_heartbeats_within_100_ms(server):
    room = requests.post(f"{server.url}/api/v1/rooms", json={"name": "bystander"}).json()
    donor = Donor(server.url, room["donor_token"], "bystander")
    beat = Heartbeat(slots=[SlotStats(index=0, memory_free=1 << 30)], running=[]).model_dump(mode="json")
    body = b"[" * (8 * 1024 * 1024)
    stop, attacking, answers = threading.Event(), threading.Event(), []

    def attack():
        while not stop.is_set():
            if not attacking.wait(0.1):
                continue
            conn = _from_attacker(server, timeout=30)
            try:
                conn.request("POST", "/api/v1/rooms", body=body, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                answers.append((resp.status, resp.read()))
            except OSError as exc:  # the server may close before the rest of the body is sent
                answers.append((None, repr(exc).encode()))
            finally:
                conn.close()

    session = requests.Session()
    health, beats, calm = [], [], []

    def probe(seconds: float, into: list, beats_into: list) -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            t0 = time.perf_counter()
            assert session.get(f"{server.url}/health", timeout=10).status_code == 200
            into.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert donor.call(EV_HEARTBEAT, beat, namespace=GPU_NAMESPACE, timeout=10).get("ok", True)
            beats_into.append(time.perf_counter() - t0)

    # Calm windows between the attack's: on a loaded machine (CI's two cores beside another test)
    # the neighbour's load falls on both alike, and the bound grows with what this machine answers
    # in when nobody attacks. Even unloaded, the attack's own traffic (two senders of 8 MiB in this
    # process, a 400 and a close a body on the server) makes a probe a few times slower: a stall,
    # the failure this guards against, is seconds.
    attackers = [threading.Thread(target=attack, daemon=True) for _ in range(2)]
    for thread in attackers:
        thread.start()
    try:
        for _ in range(4):
            probe(0.75, calm, calm)
            answered = len(answers)
            attacking.set()
            wait_until(lambda: len(answers) > answered, 30, what="the attack answered")
            probe(1.0, health, beats)
            attacking.clear()
    finally:
        stop.set()
        for thread in attackers:
            thread.join(30)
        donor.disconnect()
    limit = max(0.1, 6 * _p99(calm))
    print(f"\nH1: {len(answers)} bodies of 8 MiB of '[' in {len(health) + len(beats)} probes; p99 /health "
          f"{_p99(health) * 1000:.1f} ms, heartbeat {_p99(beats) * 1000:.1f} ms (worst {max(health) * 1000:.1f}, "
          f"{max(beats) * 1000:.1f} ms; p99 between the attacks {_p99(calm) * 1000:.1f} ms, bound {limit * 1000:.0f} ms)")
    assert len(answers) >= 10, answers[:3]
    # Each was refused at its first chunk: answered 400, or cut off (the server closes rather than
    # read the rest of a body it refused, and the client, still sending, may see a reset first).
    assert all(status in (400, None) for status, _ in answers), answers[:3]
    assert _p99(health) < limit and _p99(beats) < limit
    # A deep body short enough to be read whole is a 400 that says why.
    conn = _from_attacker(server)
    conn.request("POST", "/api/v1/rooms", body=b"[" * 100_000, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    error = json.loads(resp.read())["error"]
    assert resp.status == 400 and error["field"] == "body" and "nests deeper than 32 levels" in error["message"]
    conn.close()


def test_slow_headers_are_cut_off_and_connections_over_the_cap_refused(server):
    trickle = [_raw(server) for _ in range(5)]
    request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
    started = time.monotonic()
    cut = set()
    for sock in trickle:
        sock.setblocking(False)
    sent = 0
    while len(cut) < len(trickle) and time.monotonic() - started < HEADER_TIMEOUT + SLACK:
        for i, sock in enumerate(trickle):
            if i in cut:
                continue
            try:
                if sock.recv(1024) is not None:
                    cut.add(i)  # an answer (408) or the end of the connection
                    continue
            except BlockingIOError:
                pass
            except OSError:
                cut.add(i)
                continue
            try:
                sock.send(request[sent:sent + 1])
            except OSError:
                cut.add(i)
        sent += 1
        assert requests.get(f"{server.url}/health", timeout=5).status_code == 200
        time.sleep(0.25)  # the attack's own pace: one byte a quarter second
    took = time.monotonic() - started
    assert len(cut) == len(trickle), f"{len(cut)} of {len(trickle)} cut off in {took:.1f} s"
    assert took >= HEADER_TIMEOUT * 0.9  # not refused at once: cut off at the timeout
    for sock in trickle:
        sock.close()

    held = [_raw(server) for _ in range(20)]  # the cap: 20 per address
    try:
        wait_until(lambda: _over_cap(server) == b"429", 5, what="a connection over the cap answered 429")
        assert requests.get(f"{server.url}/health", timeout=5).status_code == 200  # another address
    finally:
        for sock in held:
            sock.close()
    wait_until(lambda: _over_cap(server) != b"429", 5, what="the address's connections counted down")
    assert "holds up to" in server.output() and "open files" in server.output()  # the process's capacity, said


def test_a_body_trickled_in_is_a_400_after_the_body_timeout_and_closes_its_connection(server):
    sock = _raw(server)
    sock.sendall(b"POST /api/v1/rooms HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"name\": \"")
    sock.setblocking(False)
    started, answer = time.monotonic(), b""
    while time.monotonic() - started < 2 + SLACK:
        try:
            more = sock.recv(4096)
            if not more:
                break  # closed
            answer += more
        except BlockingIOError:
            try:
                sock.send(b"a")
            except OSError:
                break
        assert requests.get(f"{server.url}/health", timeout=5).status_code == 200
        time.sleep(0.25)  # the attack's pace
    took = time.monotonic() - started
    sock.close()
    assert answer.startswith(b"HTTP/1.1 400") and b"did not arrive within 2 s" in answer, answer[:300]
    assert 1.8 <= took <= 2 + SLACK


def _over_cap(server: Server) -> bytes:
    with _raw(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while len(data) < 12:
            more = sock.recv(1024)
            if not more:
                break
            data += more
        return data[9:12]


def _handshake(server: Server) -> tuple[int, str]:
    conn = _from_attacker(server)
    conn.request("GET", "/socket.io/?EIO=4&transport=polling")
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    if resp.status != 200:
        return resp.status, text
    return 200, json.loads(text[1:])["sid"]


def _post(server: Server, sid: str, payload: str) -> int:
    conn = _from_attacker(server)
    conn.request("POST", f"/socket.io/?EIO=4&transport=polling&sid={sid}", body=payload.encode(),
                 headers={"Content-Type": "text/plain;charset=UTF-8"})
    status = conn.getresponse().status
    conn.close()
    return status


def _alive(server: Server, sid: str) -> bool:
    return _post(server, sid, "3") == 200  # a pong: refused (400) once the session is gone


def test_anonymous_socketio_sessions_are_capped_timed_out_and_bad_packets_logged_once(server):
    sids = [_handshake(server) for _ in range(5)]
    assert all(status == 200 for status, _ in sids), sids
    status, text = _handshake(server)
    assert status == 429 and "too many Socket.IO sessions" in text, (status, text)
    room = requests.post(f"{server.url}/api/v1/rooms", json={"name": "honest"}).json()
    honest = Donor(server.url, room["donor_token"], "honest")  # another address: not capped
    try:
        wait_until(lambda: not any(_alive(server, sid) for _, sid in sids), 2 + SLACK,
                   what="unauthenticated sessions closed after the auth timeout")
        assert honest.connected
    finally:
        honest.disconnect()

    bad = ["4" + "2/gpu,[" * 40, "4" + "9what", "4" + '2/gpu,["heartbeat",' + "[" * 40 + "]" * 40 + "]"]
    for i in range(30):
        status, sid = _handshake(server)
        assert status == 200, sid
        _post(server, sid, bad[i % len(bad)])
        wait_until(lambda: not _alive(server, sid), 5, what="a session closed by its bad packet")
    log = server.output()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    lines = [line for line in log.splitlines() if " WARNING zwdx.server.socket_edge: socket.io: a " in line]
    assert len(lines) == 1, lines



def test_a_tls_handshake_that_never_ends_is_cut_off_at_the_header_timeout(tmp_path, pki):
    class SlowTls(HttpsServer):
        def __init__(self, data_dir: str):
            self.ca = pki["ca"]
            Server.__init__(self, data_dir, extra=["--tls-cert", pki["cert"], "--tls-key", pki["key"],
                                                   "--async-mode", "gevent"],
                            env={"ZWDX_HEADER_TIMEOUT": str(HEADER_TIMEOUT)})

    server = SlowTls(str(tmp_path / "server"))
    try:
        stalled = [_raw(server) for _ in range(3)]
        stalled[0].sendall(b"\x16\x03\x01\x02\x00")  # a ClientHello's record header, and nothing after it
        started = time.monotonic()
        for sock in stalled:
            sock.settimeout(HEADER_TIMEOUT + SLACK)
            try:
                assert sock.recv(1024) == b""  # closed by the server
            except ConnectionResetError:
                pass
            sock.close()
        assert HEADER_TIMEOUT * 0.9 <= time.monotonic() - started <= HEADER_TIMEOUT + SLACK
        assert requests.get(f"{server.url}/health", timeout=5, verify=pki["ca"]).status_code == 200
    finally:
        server.stop()
