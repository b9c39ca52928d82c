"""A room's tokens, managed with a submitter token of the room (``zwdx room tokens ...``).

    GET    /api/v1/room/tokens              every token by name and role (never a secret)
    POST   /api/v1/room/tokens              a new submitter or donor token (its secret shown once)
    DELETE /api/v1/room/tokens/<id>         revoke it: it opens nothing from now on
    POST   /api/v1/room/tokens/<id>/rotate  a new secret for it; a legacy token becomes a
                                            submitter token and the room gets a donor token

The room's last submitter token cannot be revoked (409): its owner could never get back in.
Revoking or rotating a donor token closes the GPU-client connections made with it on this
server process (they cannot connect again with the old secret, and exit) and declares those GPU
clients lost at once, saying why in their jobs' timelines; a submitter token's dashboard
connections close the same way. Among several server processes (a message queue), the others
close theirs within a lease interval (``close_revoked``, run after each try for the lease).
"""
from __future__ import annotations

import logging
import time

from flask import Blueprint

from ..errors import Conflict, NotFound
from ..protocol import GPU_NAMESPACE, CredentialRole
from ..protocol.tokens import PREFIXES, CreateToken, NewToken, Rotated, TokenList, TokenView
from .auth import Caller, hash_secret, issue_credential, new_secret
from .extensions import socketio
from .http import ctx, operation
from . import jobs

log = logging.getLogger(__name__)

bp = Blueprint("tokens", __name__)


def _view(credential: dict, caller: Caller) -> TokenView:
    return TokenView.model_validate({**credential, "own": credential["id"] == caller.credential["id"]})


def _credential_in_room(token_id: str, room: dict) -> dict:
    """The room's credential ``token_id``; NotFound for any other (another room's is not found)."""
    credential = ctx().store.get_credential(token_id)
    if credential is None or credential.get("room_id") != room["id"]:
        raise NotFound(f"no token {token_id} in this room", token_id=token_id)
    return credential


def _gone(credential: dict, why: str) -> None:
    """This process forgets the credential and closes the Socket.IO connections made with it
    (``ServerContext.connections``, kept by ``events.py``)."""
    ctx().credentials.forget(credential["id"])
    sids = [sid for sid, (_, credential_id, _) in list(ctx().connections.items()) if credential_id == credential["id"]]
    _lost(ctx(), credential, sids, why)
    _close(ctx(), sids)


def _lost(server_ctx, credential: dict, sids: list[str], why: str) -> None:
    """The GPU clients on ``sids`` are lost now, ``why`` in their jobs' timelines: with their
    token gone they cannot come back, so no grace is waited out (nor "connection dropped" said)."""
    gpu = {sid for sid in sids if (server_ctx.connections.get(sid) or ("",))[0] == GPU_NAMESPACE}
    if not gpu:
        return
    for client in server_ctx.store.list_clients(credential["room_id"]):
        if client.get("sid") in gpu:
            try:
                jobs.client_lost(server_ctx, client["id"], why)
            except Exception:  # its connection is closed anyway; the reaper declares it lost on the clock
                log.exception("tokens: gpu client %s not declared lost", client["id"])


def _named(credential: dict) -> str:
    name = credential.get("name")
    return f"{credential.get('role', '')} token {credential['id']}" + (f" ({name})" if name else "")


def _close(server_ctx, sids: list[str]) -> None:
    for sid in sids:
        namespace = (server_ctx.connections.get(sid) or ("/",))[0]
        try:
            socketio.server.disconnect(sid, namespace=namespace, ignore_queue=True)  # this process's own
        except Exception:  # gone already
            log.debug("tokens: connection %s already closed", sid)


def close_revoked(server_ctx) -> None:
    """Close this process's connections whose token was revoked or rotated since they were made
    (through another server process): one store read per credential in use."""
    held: dict[tuple[str, str | None], list[str]] = {}
    for sid, (_, credential_id, token_hash) in list(server_ctx.connections.items()):
        held.setdefault((credential_id, token_hash), []).append(sid)
    gone = []
    for (credential_id, token_hash), sids in held.items():
        credential = server_ctx.store.get_credential(credential_id)
        if credential is None or credential.get("revoked_at") or credential.get("hash") != token_hash:
            server_ctx.credentials.forget(credential_id)
            if credential is not None:
                _lost(server_ctx, credential, sids, f"its {_named(credential)} was "
                                                    f"{'revoked' if credential.get('revoked_at') else 'rotated'}")
            gone += sids
    if gone:
        log.info("tokens: closing %d connection(s) whose token was revoked or rotated elsewhere", len(gone))
        _close(server_ctx, gone)


@operation(bp, "GET", "/room/tokens", "The room's tokens, by name and role", answer=TokenList, tag="rooms")
def list_tokens(room: dict, caller: Caller):
    """Revoked ones too (with ``revoked_at``), oldest first; a ``legacy`` token opens both roles;
    ``own`` marks the one this request carries."""
    return TokenList(tokens=[_view(c, caller) for c in ctx().store.list_credentials(room["id"])])


@operation(bp, "POST", "/room/tokens", "Make a submitter or donor token", body=CreateToken, answer=NewToken,
           status=201, tag="rooms")
def create_token(room: dict, caller: Caller, body: CreateToken):
    """The answer holds its secret, shown this once."""
    credential, secret = issue_credential(ctx().store, room["id"], CredentialRole(body.role), body.name)
    log.info("room %s: %s token %s (%s) made", room["id"], credential["role"], credential["id"], body.name or "-")
    return NewToken(**_view(credential, caller).model_dump(), token=secret), 201


@operation(bp, "DELETE", "/room/tokens/<token_id>", "Revoke a token", answer=TokenView, errors=(404, 409),
           tag="rooms")
def revoke_token(room: dict, caller: Caller, token_id: str):
    """It opens nothing from now on. A token revoked already, or the room's last submitter
    token, is a conflict (409), and nothing changes."""
    credential = _credential_in_room(token_id, room)
    if credential.get("revoked_at") is not None:
        raise Conflict(f"token {token_id} is revoked already", token_id=token_id)
    revoked = ctx().store.revoke_credential(token_id, time.time())
    if revoked is None:
        raise Conflict(f"token {token_id} is the room's last submitter token: make another one first "
                       f"(POST /room/tokens with role submitter), then revoke this one", token_id=token_id)
    _gone(revoked, f"its {_named(revoked)} was revoked")
    log.info("room %s: token %s revoked", room["id"], token_id)
    return _view(revoked, caller)


@operation(bp, "POST", "/room/tokens/<token_id>/rotate", "Give a token a new secret", answer=Rotated,
           errors=(404, 409), tag="rooms")
def rotate_token(room: dict, caller: Caller, token_id: str):
    """The old secret opens nothing from now on. A legacy token becomes the submitter token it
    was used as, and the room gets a donor token too (second in the answer); give that one to
    the GPU clients."""
    credential = _credential_in_room(token_id, room)
    secret = new_secret(PREFIXES[CredentialRole(credential["role"])])
    rotated = ctx().store.rotate_credential(token_id, hash_secret(secret), time.time())
    if rotated is None:
        raise Conflict(f"token {token_id} is revoked: it cannot be rotated", token_id=token_id)
    _gone(credential, f"its {_named(credential)} was rotated")
    out = [NewToken(**_view(rotated, caller).model_dump(), token=secret)]
    if credential.get("legacy"):
        donor, donor_secret = issue_credential(ctx().store, room["id"], CredentialRole.DONOR, "rotated from the room token")
        out.append(NewToken(**_view(donor, caller).model_dump(), token=donor_secret))
    log.info("room %s: token %s rotated", room["id"], token_id)
    return Rotated(tokens=out)

