"""What one donor token may register: a bound on GPU clients, slots and registers.

A donor token is all a GPU client needs, and anyone a room gives one may run a client that
claims anything; ``zwdx.protocol.gpu`` refuses the claims no hardware makes (memory past the
largest GPU's or machine's, free above total, control characters in names). What is left is
volume: one token registering hundreds of client ids of hundreds of slots each (issue 29's L7:
150 x 256 in 83 s, and another room's heartbeats took 5 s). So, per donor token:

- ``DONOR_MAX_CLIENTS`` GPU clients online at once (its own reconnects not counted twice);
- ``CLIENT_MAX_SLOTS`` slots per GPU client;
- ``RATE_LIMIT_REGISTERS`` registers (a moving window of the ``limits`` library, in the
  storage the other rate limits use, keyed by the token's credential id).

Each is a server setting (``zwdx server --donor-max-clients`` ..., or ``ZWDX_<NAME>``); 0 (or
an empty rate) lifts it. A register over one is refused with the reason and changes nothing.
The count of clients online is read from the store, so it holds across server processes; two
registers of new ids racing may both pass it (the bound is one over, never unbounded).
"""
from __future__ import annotations

from ..protocol import ClientStatus
from ..protocol.gpu import Register


def refusal(ctx, room_id: str, token_id: str | None, hello: Register, existing: dict | None) -> str | None:
    """Why this register of ``token_id`` (a donor credential's id) is refused, or None."""
    config = ctx.settings
    most_slots = config.client_max_slots
    if most_slots and len(hello.slots) > most_slots:
        return (f"register: field 'slots' has {len(hello.slots)} slot(s); this server takes at most {most_slots} "
                f"per gpu client (its --client-max-slots): offer fewer (--gpus, --cpu-slots)")
    if token_id is None:
        return None
    rate = config.rate_limit_registers
    if rate and not ctx.limiter.hit_rate(rate, "registers", token_id):
        return (f"register: this donor token registered more than {rate} already; wait and retry "
                f"(the server's --rate-limit-registers)")
    most_clients = config.donor_max_clients
    if most_clients and not (existing and existing.get("status") == ClientStatus.ONLINE.value):
        online = sum(1 for c in ctx.store.list_clients(room_id) if c.get("token_id") == token_id
                     and c.get("status") == ClientStatus.ONLINE.value and c["id"] != hello.client_id)
        if online >= most_clients:
            return (f"register: this donor token has {online} gpu client(s) online already, the most this server "
                    f"takes (its --donor-max-clients): stop one, or lend more under another donor token")
    return None
