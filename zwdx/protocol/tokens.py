"""A room's credentials: which secret opens what, and the REST bodies and answers that manage
them (``/api/v1/room/tokens``).

Every secret is 256 random bits, shown once, stored only as its sha256. Its prefix says what
it is, for people and error messages; the server decides by the stored record, never by the
prefix.

    zs_  submitter token   submits jobs, reads and cancels the room's jobs, downloads results,
                           opens the dashboard, manages the room's tokens
    zd_  donor token       connects GPU clients on /gpu (register, heartbeat, ranks exited):
                           nothing else, no REST route at all
    zr_  legacy token      a room made before tokens had roles: both of the above until it is
                           rotated into a pair (listed ``legacy``)
    zc_  client secret     issued to a GPU client at its first register; proves its id later
    rk_  rank key          one per rank of one attempt of a job, bound to (job, attempt, rank,
                           GPU client): the only secret a rank process holds

A room has at least one submitter token (the last one cannot be revoked), so its owner can
always get back in; donor tokens can all go.
"""
from __future__ import annotations

from typing import Annotated

from pydantic import StringConstraints

from .base import Answer, ByValue, Message
from .vocab import CredentialRole

#: Prefixes of the secrets (see the module's docstring).
SUBMITTER_PREFIX = "zs"
DONOR_PREFIX = "zd"
LEGACY_PREFIX = "zr"
CLIENT_SECRET_PREFIX = "zc"
RANK_KEY_PREFIX = "rk"
PREFIXES = {CredentialRole.SUBMITTER: SUBMITTER_PREFIX, CredentialRole.DONOR: DONOR_PREFIX}

#: A secret as it travels (``zs_`` and 43 characters of base64url); a bounded, plain string.
Secret = Annotated[str, StringConstraints(min_length=8, max_length=200, pattern=r"^[A-Za-z0-9_-]+$")]
#: What a person calls a token ("lab-3 donors", "ci").
TokenName = Annotated[str, StringConstraints(max_length=100)]


def role_of(token: str) -> str:
    """What a token's prefix says it is, for messages: "submitter token", "donor token", ..."""
    prefix = token.split("_", 1)[0] if isinstance(token, str) else ""
    return {SUBMITTER_PREFIX: "submitter token", DONOR_PREFIX: "donor token", LEGACY_PREFIX: "room token",
            RANK_KEY_PREFIX: "rank key", CLIENT_SECRET_PREFIX: "client secret"}.get(prefix, "token")


class CreateToken(Message):
    """``POST /api/v1/room/tokens``: a new token of the room."""
    role: Annotated[CredentialRole, ByValue]
    name: TokenName = ""


class TokenView(Answer):
    """A token of the room as listed: never its secret, never its hash."""
    id: str
    role: CredentialRole
    name: str = ""
    #: A token of a room made before tokens had roles: it opens both roles until rotated.
    legacy: bool = False
    created_at: float
    rotated_at: float | None = None
    revoked_at: float | None = None
    #: The token this request was made with (after a rotation: its new secret is yours now).
    own: bool = False


class TokenList(Answer):
    """``GET /api/v1/room/tokens``: every token of the room, revoked ones too, oldest first."""
    tokens: list[TokenView]


class NewToken(TokenView):
    """A token and its secret, shown only in this answer."""
    token: str


class Rotated(Answer):
    """``POST /api/v1/room/tokens/<id>/rotate``: the token's new secret (the old one opens nothing
    from now on); rotating a legacy token also makes the room a donor token, second in the list."""
    tokens: list[NewToken]


__all__ = ["SUBMITTER_PREFIX", "DONOR_PREFIX", "LEGACY_PREFIX", "CLIENT_SECRET_PREFIX", "RANK_KEY_PREFIX", "PREFIXES",
           "Secret", "TokenName", "role_of", "CreateToken", "TokenView", "TokenList", "NewToken", "Rotated"]
