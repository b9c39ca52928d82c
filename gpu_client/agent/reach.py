"""Where this GPU client's peers reach it, and whether they can, before the ranks of a DDP/FSDP job start.

Its address is the one of the interface that reaches the server (``reaching_address``; or
``--advertise-addr``); the ranks' gloo and NCCL sockets use that interface (``interface_of``),
and rank 0's rendezvous port is one the agent listens on there from the moment it offers it
(``listener``) and hands to rank 0's process, whose TCPStore serves on that very socket: no port
is closed and bound again, so nothing else on the machine can take it in between.

Each GPU client listens on a port of its advertised address (``Listener``; ``reach_port`` in its
``Register``) and answers every connection with one line, ``zwdx <client id>``, then closes it:
nothing is read from the caller. Before the ranks of a job that meets over TCP start, the agent
connects to every other GPU client of the job (``JobAssign.peers``, rank 0's first) at once, each
within ``REACH_TIMEOUT`` seconds, and checks the line names the peer it meant (an address on
another private network may answer as someone else). Peers it could not reach are reported
(``Unreachable``): the server fails the job at once, naming the pairs, instead of the ranks
waiting out the collective timeout.
"""
from __future__ import annotations

import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import psutil

from zwdx import defaults
from zwdx.protocol.gpu import JobAssign, Peer

#: The line a listener answers with starts so.
BANNER = b"zwdx "


def reaching_address(server_url: str) -> str:
    """The address of this machine's interface that reaches the server."""
    parsed = urlparse(server_url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # UDP: no packet is sent, the kernel just picks a route
        return probe.getsockname()[0]


def listener(addr: str) -> socket.socket:
    """A socket listening on a port the kernel picks at ``addr`` ("" for every address), held
    until a rank's store takes it over (``rendezvous.hold``). Connections made meanwhile wait in
    its backlog: other ranks may connect before rank 0's store serves."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((addr, 0))
        sock.listen(4096)
    except OSError:
        sock.close()
        raise
    return sock


def interface_of(addr: str) -> str | None:
    """The network interface holding ``addr`` (for GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)."""
    try:
        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address == addr for a in addrs):
                return name
    except Exception:
        pass
    return None


class Listener:
    """Answers reachability probes on ``addr`` (all interfaces when this machine does not hold
    ``addr``: an address forwarded to it) at ``port`` (0: any free one), in a daemon thread."""

    def __init__(self, addr: str, client_id: str, port: int = 0):
        self.client_id = client_id
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((addr if addr != "0.0.0.0" else "", port))
        except OSError:
            self.sock.bind(("", port))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, name="zwdx-reach", daemon=True).start()

    def _serve(self) -> None:
        line = BANNER + self.client_id.encode() + b"\n"
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            try:
                conn.settimeout(1.0)
                conn.sendall(line)
            except OSError:
                pass
            finally:
                conn.close()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def knock(peer: Peer, timeout: float) -> str | None:
    """None when ``peer`` answered as itself within ``timeout`` seconds, else what went wrong."""
    try:
        with socket.create_connection((peer.addr, peer.port), timeout=timeout) as conn:
            conn.settimeout(timeout)
            got = b""
            while not got.endswith(b"\n") and len(got) < 300:
                piece = conn.recv(300)
                if not piece:
                    break
                got += piece
    except TimeoutError:
        return f"no answer from {peer.addr}:{peer.port} within {timeout:g} s"
    except OSError as exc:
        return f"{peer.addr}:{peer.port}: {exc.strerror or exc}"
    if got.strip() != BANNER + peer.client_id.encode():
        return f"{peer.addr}:{peer.port} answered as {got.strip()[:60]!r}, not as gpu client {peer.client_id}"
    return None


def egress_peers(assign: JobAssign) -> list[str]:
    """Where this client's rank containers may reach the job's peers (``container.destinations``):
    where the server saw them connect from and this client's own address (``assign.addresses``),
    and the peers' advertised addresses, each of which answered this client's probe as that peer
    (``unreachable``) before any rank of the job starts (``agent._run_job``): a claim no one
    confirmed opens nothing."""
    return sorted(set(assign.addresses) | {p.addr for p in assign.peers})


def unreachable(peers: list[Peer], me: str, timeout: float = defaults.REACH_TIMEOUT) -> dict[str, str]:
    """The peers (other than ``me``) this client cannot reach: client id -> what went wrong.
    All at once, so the whole probe takes at most ``timeout`` seconds."""
    others = [p for p in peers if p.client_id != me]
    if not others:
        return {}
    with ThreadPoolExecutor(max_workers=min(32, len(others)), thread_name_prefix="zwdx-knock") as pool:
        answers = list(pool.map(lambda p: knock(p, timeout), others))
    return {p.client_id: why for p, why in zip(others, answers) if why is not None}
