"""How a rank (and the GPU client's calls for its ranks) waits out a server that is away.

Every call a rank makes to the server (events, status, checkpoints, weights, outputs, DILOCO
rounds, layout) goes through ``http_session``: urllib3's ``Retry`` tries it again with backoff
(at most ``BACKOFF_MAX`` s apart) while the server refuses connections, drops them, or a proxy in
front answers 502, 503 or 504, for up to ``patience`` seconds from the first failure (the donor's
``zwdx gpu-client --outage-tolerance``, default ``defaults.OUTAGE_TOLERANCE``): a server
restarted, or upgraded, within that time never fails a job. Anything else (a TLS certificate
that does not verify, an answer the server gave) is not tried again here.
"""
from __future__ import annotations

import time

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from zwdx import defaults, tls

#: The longest pause between two tries, in seconds: a server back is found within this.
BACKOFF_MAX = 5.0
#: What a proxy in front answers while the server behind it is away.
AWAY = (502, 503, 504)


class OutageRetry(Retry):
    """``Retry`` bounded by time, not by a count: exhausted ``patience`` seconds after the first
    failed try of a call (other errors than connections and reads: at once)."""

    def __init__(self, *args, patience: float = defaults.OUTAGE_TOLERANCE, since: float | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.patience, self.since = float(patience), since

    def new(self, **kw) -> "OutageRetry":
        retry = super().new(**kw)
        retry.patience = self.patience
        retry.since = self.since if self.since is not None else time.monotonic()  # new() follows a failure
        return retry

    def is_exhausted(self) -> bool:
        if super().is_exhausted():
            return True
        return self.since is not None and time.monotonic() - self.since > self.patience


def retry(patience: float) -> OutageRetry:
    """Connections refused or dropped, and 502/503/504, for ``patience`` seconds, any method (what
    the ranks send is safe to send twice: events carry keys, uploads replace, commits repeat)."""
    return OutageRetry(total=None, connect=None, read=None, status=None, other=0, redirect=None,
                       backoff_factor=0.5, backoff_max=BACKOFF_MAX, status_forcelist=AWAY, allowed_methods=None,
                       raise_on_status=False, patience=patience)


def sent_again(resp: requests.Response) -> bool:
    """Whether the request that got ``resp`` was sent more than once (an earlier try may have
    reached the server, its answer lost)."""
    return bool(getattr(getattr(resp.raw, "retries", None), "history", ()))


def http_session(rank_key: str | None = None, verify: str | bool = True,
                 patience: float = defaults.OUTAGE_TOLERANCE) -> requests.Session:
    """Calls to the server as the rank whose key this is (None: no key), tried again while the
    server is away for up to ``patience`` seconds; ``verify``: the CA file the server's
    certificate is checked against (True: the system's)."""
    session = tls.session(verify)
    adapter = HTTPAdapter(max_retries=retry(patience))
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    if rank_key is not None:
        session.headers[defaults.RANK_KEY_HEADER] = rank_key
    return session
