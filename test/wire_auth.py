"""What a test's stand-in GPU client or dashboard says as it connects over Socket.IO (``/gpu``,
``/ui``): its token and the protocol it speaks, as ``gpu_client/agent`` and the dashboard say
them (a peer that names no protocol speaks 1.0, which a 2.x server refuses)."""
from __future__ import annotations

from zwdx.protocol.base import PROTOCOL


def connect_auth(token: str) -> dict:
    """The ``auth`` of a Socket.IO connect: ``sio.connect(url, auth=connect_auth(token), ...)``."""
    return {"token": token, "protocol": PROTOCOL}
