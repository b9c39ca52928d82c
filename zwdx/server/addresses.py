"""Where a rank in a container may connect (``egress_addresses``, ``JobAssign.addresses``): the
addresses the server saw the job's GPU clients connect from (``seen_addr``, recorded at each
register by ``seen_address``: the connection's, or behind ``PROXY_HOPS`` proxies the client's as
they forward it), and the receiving client's own ``advertise_addr`` (its own word about itself
only). What a client claims for itself (``advertise_addr``, a ``PortOffer``'s address) reaches
another client's rules only where that client's own reachability probe found the peer answering
there as itself (``gpu_client/agent/agent.py``), never by the server's word.
"""
from __future__ import annotations

import ipaddress


def seen_address(remote_addr: str | None) -> str | None:
    """The address a connection came from, as one canonical IP (an IPv4-mapped IPv6 one as
    IPv4); None when it is not an IP address."""
    try:
        ip = ipaddress.ip_address((remote_addr or "").split("%", 1)[0])
    except ValueError:
        return None
    return str(ip.ipv4_mapped or ip) if ip.version == 6 else str(ip)


def egress_addresses(clients: list[dict], recipient: dict) -> list[str]:
    """The addresses ``recipient``'s rank containers may reach the job's peers at: where the
    server saw each of the job's GPU clients (``clients``) connect from, and the recipient's own
    advertised address (its own ranks meet there)."""
    seen = {c["seen_addr"] for c in clients if c.get("seen_addr")}
    return sorted(seen | ({recipient["advertise_addr"]} if recipient.get("advertise_addr") else set()))
