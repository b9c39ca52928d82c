"""A room's tokens, from the SDK: ``ZWDX(url).tokens`` (what ``zwdx room tokens ...`` runs).

    tokens = ZWDX(url, room_token=SUBMITTER_TOKEN).tokens
    tokens.list()                          # [{"id", "role", "name", "legacy", "created_at", "revoked_at", "own"}, ...]
    tokens.create("donor", name="lab-3")   # {..., "token": "zd_..."}: its secret, shown only this once
    tokens.revoke(token_id)                # it opens nothing from now on (the last submitter token cannot go)
    tokens.rotate(token_id)                # [{..., "token": new secret}] (+ a donor token, for a legacy token)

Every call takes a submitter token of the room (``room_token=``, else the ``ZWDX``'s own).
When a call rotates the token it was made with, the SDK's own copy and the credential store's
take the new secret, so the next call works.
"""
from __future__ import annotations

from .protocol import CredentialRole


class RoomTokens:
    """The token calls of one ``ZWDX`` (``zwdx.tokens``)."""

    def __init__(self, sdk):
        self.sdk = sdk

    def _call(self, method: str, path: str, room_token: str | None, **kwargs) -> dict:
        return self.sdk._json(method, path, self.sdk._token(room_token), **kwargs)

    def list(self, room_token: str | None = None) -> list[dict]:
        """Every token of the room by name and role, revoked ones too, oldest first; never a secret."""
        return self._call("GET", "/room/tokens", room_token)["tokens"]

    def create(self, role: str = CredentialRole.DONOR.value, name: str = "", room_token: str | None = None) -> dict:
        """A new ``"submitter"`` or ``"donor"`` token; its secret is in ``"token"``, shown only now."""
        return self._call("POST", "/room/tokens", room_token, json={"role": str(getattr(role, "value", role)),
                                                                    "name": name})

    def revoke(self, token_id: str, room_token: str | None = None) -> dict:
        """Revoke a token: it opens nothing from now on, and its GPU clients or dashboards are
        disconnected. The room's last submitter token cannot be revoked (``Conflict``)."""
        return self._call("DELETE", f"/room/tokens/{token_id}", room_token)

    def rotate(self, token_id: str, room_token: str | None = None) -> list[dict]:
        """Give a token a new secret (the old one opens nothing from now on). A legacy token
        becomes a submitter token, and the room gets a donor token too (second in the list)."""
        used = self.sdk._token(room_token)
        tokens = self.sdk._json("POST", f"/room/tokens/{token_id}/rotate", used)["tokens"]
        mine = next((t for t in tokens if t.get("own")), None)
        if mine is not None:  # the token this call carried: keep its new secret wherever it was kept
            if self.sdk.room_token == used:
                self.sdk.room_token = mine["token"]
            self.sdk._job_tokens = {job: mine["token"] if token == used else token
                                    for job, token in self.sdk._job_tokens.items()}
            self.sdk._remember("replace_token", used, mine["token"])
        return tokens


__all__ = ["RoomTokens"]
