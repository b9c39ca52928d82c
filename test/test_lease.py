"""Who leads among server processes that share a store (zwdx/server/lease.py): two Leases on
one store, as two processes would hold them, on each backend. The renewing loops are not
started: each test calls ``renew()`` as the loop would, so the order of events is the test's.
The times are a fraction of a second with margins of hundreds of milliseconds."""
from __future__ import annotations

from procs import SLACK, wait_until
from store_backends import *  # noqa: F401,F403  (fixtures: backend, store)
from zwdx.server.lease import NAME, Lease

TTL = 0.6  # renewed every 0.2 s; believed held until 0.4 s after the last renewal


def test_one_leads_and_another_takes_over_once_it_stops_renewing(backend):
    a, b = Lease(backend.open(), shared=True, ttl=TTL), Lease(backend.open(), shared=True, ttl=TTL)
    taken = []
    a.on_taken.append(lambda: taken.append("a"))
    b.on_taken.append(lambda: taken.append("b"))
    assert not a.held() and not b.held()
    assert a.renew() and not b.renew()
    assert a.store.lease_holder(NAME) == a.holder
    assert a.renew()  # renewing is not taking it again
    assert taken == ["a"]
    # a stops renewing (a killed process): it stops believing it leads, then b takes the expired lease
    wait_until(lambda: not a.held(), TTL + SLACK, 0.02, what="a, no longer renewing, to stop believing it leads")
    wait_until(b.renew, TTL + SLACK, 0.05, what="b to take the lease once it expired")
    assert not a.held() and taken == ["a", "b"]
    assert not a.renew()  # a comes back: the lease is b's now
    b.release()
    assert not b.held() and a.store.lease_holder(NAME) is None
    assert a.renew() and taken == ["a", "b", "a"]  # given up: taken at the next try, no wait


def test_alone_a_process_always_leads_and_writes_no_lease(store):
    alone = Lease(store, shared=False)
    assert alone.held()
    alone.start(stopping=None)  # nothing to renew
    alone.release()
    assert alone.held() and store.lease_holder(NAME) is None
