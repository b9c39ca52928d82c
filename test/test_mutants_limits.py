"""zwdx/server/limits.py, checked where mutation testing (bench/mutation.py) found nothing looking:
each quota's bound (at, one under, one over), the numbers a refusal carries, the windows' scopes
and keys (per address, per rank), the auth-failure window of Socket.IO. In-process, fast lane;
the store's sums are stood in for, so each bound is exact."""
from __future__ import annotations

import pytest

from zwdx import defaults
from zwdx.errors import QuotaExceeded, RateLimited
from zwdx.server import limits
from zwdx.server.limits import RateLimits


class Sums:
    """The store's answers the quotas read, set by the test."""
    def __init__(self, jobs=0, artifacts=0, events=0, event_bytes=0):
        self.jobs, self.artifacts, self.events, self.event_bytes, self.asked = jobs, artifacts, events, event_bytes, []

    def count_jobs(self, room_id, statuses):
        self.asked.append(("jobs", room_id, tuple(statuses)))
        return self.jobs if room_id == "r1" else 0  # another room holds nothing

    def room_artifact_bytes(self, room_id):
        self.asked.append(("artifacts", room_id))
        return self.artifacts if room_id == "r1" else 0

    def room_event_usage(self, room_id):
        self.asked.append(("events", room_id))
        return {"events": self.events, "bytes": self.event_bytes} if room_id == "r1" else {"events": 0, "bytes": 0}


@pytest.fixture
def quota(app, monkeypatch):
    """quota(sums, **config) -> an app context whose store answers with ``sums``."""
    ctx = app.extensions["zwdx"]

    def make(sums: Sums, **config):
        monkeypatch.setattr(ctx, "settings", ctx.settings.replace(**{name: config.get(name, 0) for name in (
            "ROOM_MAX_JOBS", "ROOM_MAX_EVENTS", "ROOM_MAX_ARTIFACT_BYTES")}))
        for name in ("count_jobs", "room_artifact_bytes", "room_event_usage"):
            monkeypatch.setattr(ctx.store, name, getattr(sums, name))
        app.extensions.pop("zwdx.artifact_sums", None)
        return app.test_request_context()
    return make


def test_the_job_quota_refuses_at_the_limit_with_its_numbers(quota):
    sums = Sums(jobs=2)
    with quota(sums, ROOM_MAX_JOBS=3):
        limits.check_job_quota({"id": "r1"})  # 2 of 3: one more fits
        assert sums.asked == [("jobs", "r1", tuple(limits.OPEN))]
        sums.jobs = 3
        with pytest.raises(QuotaExceeded) as err:
            limits.check_job_quota({"id": "r1"})
    assert err.value.message == ("room r1 has 3 job(s) waiting or running, its quota is 3: "
                                 "wait for one to end (or cancel one)")
    assert err.value.context == {"limit": 3, "used": 3}


def test_no_job_quota_reads_nothing(quota):
    sums = Sums(jobs=10**6)
    with quota(sums):
        limits.check_job_quota({"id": "r1"})
    assert sums.asked == []


def test_the_artifact_allowance_is_what_the_quota_leaves(quota):
    sums = Sums(artifacts=600, event_bytes=100)
    with quota(sums, ROOM_MAX_ARTIFACT_BYTES=1000):
        assert limits.artifact_allowance("r1", 500) == (300, True)  # 1000 - 600 - 100 left
        assert limits.artifact_allowance("r1", 300) == (300, False)  # the request's own bound
        assert limits.artifact_allowance("r1", 299) == (299, False)
        assert ("artifacts", "r1") in sums.asked and ("events", "r1") in sums.asked
        sums.artifacts = 2000
        assert limits.artifact_allowance("r1", 10) == (0, True)  # over already: nothing left, never negative
    with quota(Sums(artifacts=10**9)):
        assert limits.artifact_allowance("r1", 123) == (123, False)


@pytest.mark.parametrize("size, what", [(77, "an artifact of 77 bytes"), (None, "the artifact")])
def test_an_artifact_over_quota_is_told_with_the_rooms_numbers(quota, size, what):
    with quota(Sums(artifacts=600, event_bytes=100), ROOM_MAX_ARTIFACT_BYTES=1000):
        err = limits.artifact_quota_exceeded("r1", size)
    assert err.message == (f"room r1 keeps 700 bytes of artifacts and events, its quota is 1000: {what} does not "
                           f"fit (finished jobs' artifacts go after the retention the server keeps)")
    assert err.context == {"limit": 1000, "used": 700}


def test_the_event_count_quota_takes_a_batch_up_to_it_exactly(quota):
    sums = Sums(events=8)
    with quota(sums, ROOM_MAX_EVENTS=10):
        limits.check_event_quota("r1", 2, 10**9)  # 10 of 10; no byte quota
        assert sums.asked == [("events", "r1")]
        with pytest.raises(QuotaExceeded) as err:
            limits.check_event_quota("r1", 3, 1)
    assert err.value.message == ("room r1 keeps 8 events, its quota is 10: 3 more do not fit "
                                 "(report metrics less often, or fewer of them)")
    assert err.value.context == {"limit": 10, "used": 8}


def test_the_event_byte_quota_counts_artifacts_and_events_together(quota):
    sums = Sums(artifacts=600, event_bytes=100, events=10**6)
    with quota(sums, ROOM_MAX_ARTIFACT_BYTES=1000):  # no event-count quota: the count does not matter
        limits.check_event_quota("r1", 4, 300)  # 700 + 300 = 1000: fits
        assert ("artifacts", "r1") in sums.asked and ("events", "r1") in sums.asked
        with pytest.raises(QuotaExceeded) as err:
            limits.check_event_quota("r1", 4, 301)
    assert err.value.message == ("room r1 keeps 700 bytes of artifacts and events, its quota is 1000: "
                                 "4 events of 301 bytes do not fit")
    assert err.value.context == {"limit": 1000, "used": 700}


def test_the_artifacts_sum_is_reused_for_its_ttl_then_read_again(quota, monkeypatch, app):
    now = [1000.0]
    monkeypatch.setattr(limits.time, "monotonic", lambda: now[0])
    sums = Sums(artifacts=500)
    with quota(sums, ROOM_MAX_ARTIFACT_BYTES=1000):
        limits.check_event_quota("r1", 1, 500)
        assert app.extensions["zwdx.artifact_sums"]["r1"] == (1000.0, 500)
        sums.artifacts = 900  # uploads since: not seen within the ttl
        now[0] += limits.ARTIFACT_SUM_TTL
        limits.check_event_quota("r1", 1, 500)
        assert sums.asked.count(("artifacts", "r1")) == 1
        now[0] += 0.01
        with pytest.raises(QuotaExceeded):
            limits.check_event_quota("r1", 1, 500)
        assert sums.asked.count(("artifacts", "r1")) == 2


def test_no_event_quota_reads_nothing(quota):
    sums = Sums()
    with quota(sums):
        limits.check_event_quota("r1", 10**6, 10**12)
    assert sums.asked == []


def test_a_room_without_artifacts_has_its_first_events_counted_from_zero(quota, monkeypatch):
    monkeypatch.setattr(limits.time, "monotonic", lambda: 3.0)  # a fresh process: under the ttl since 0
    with quota(Sums(artifacts=0), ROOM_MAX_ARTIFACT_BYTES=10):
        limits.check_event_quota("r1", 1, 10)
        with pytest.raises(QuotaExceeded):
            limits.check_event_quota("r1", 1, 11)


def test_usage_reports_every_sum_and_limit(quota):
    with quota(Sums(jobs=2, artifacts=30, events=4, event_bytes=5), ROOM_MAX_JOBS=7, ROOM_MAX_EVENTS=8,
               ROOM_MAX_ARTIFACT_BYTES=9):
        usage = limits.usage("r1")
    assert usage.model_dump() == {"jobs": 2, "jobs_limit": 7, "artifact_bytes": 30, "artifact_bytes_limit": 9,
                                  "events": 4, "event_bytes": 5, "events_limit": 8}


def _window(app, monkeypatch, **rates):
    ctx = app.extensions["zwdx"]
    monkeypatch.setattr(ctx, "settings", ctx.settings.replace(**rates))
    return RateLimits("memory://")


def test_a_rate_window_is_per_address_and_per_scope(app, monkeypatch):
    window = _window(app, monkeypatch, RATE_LIMIT_ROOMS="2/minute")
    with app.test_request_context(environ_base={"REMOTE_ADDR": "10.0.0.1"}):
        assert window.hit("RATE_LIMIT_ROOMS", "rooms") and window.hit("RATE_LIMIT_ROOMS", "rooms")
        assert not window.allowed("RATE_LIMIT_ROOMS", "rooms") and not window.hit("RATE_LIMIT_ROOMS", "rooms")
        assert window.allowed("RATE_LIMIT_ROOMS", "link")  # another scope: its own window
    with app.test_request_context(environ_base={"REMOTE_ADDR": "10.0.0.2"}):
        assert window.allowed("RATE_LIMIT_ROOMS", "rooms") and window.hit("RATE_LIMIT_ROOMS", "rooms")


def test_events_are_limited_per_rank_of_a_job_not_per_address(app, monkeypatch):
    ctx = app.extensions["zwdx"]
    monkeypatch.setattr(ctx, "limiter", _window(app, monkeypatch, RATE_LIMIT_EVENTS="1/minute"))
    with app.test_request_context():
        limits.check_event_rate("j1", 0)
        limits.check_event_rate("j1", 1)  # another rank
        limits.check_event_rate("j2", 0)  # another job
        with pytest.raises(RateLimited) as err:
            limits.check_event_rate("j1", 0)
    assert err.value.message == ("rank 0 of job j1 posts events faster than the server takes them (1/minute); "
                                 "send larger batches less often")
    assert err.value.context == {"job_id": "j1", "rank": 0}
    with app.test_request_context(environ_base={"REMOTE_ADDR": "10.7.7.7"}):  # the rank's, from any address
        with pytest.raises(RateLimited):
            limits.check_event_rate("j1", 1)


def test_both_link_probes_share_one_window_per_address(make_app):
    app = make_app(RATE_LIMIT_LINK="2/minute")
    client = app.test_client()
    room = client.post("/api/v1/rooms", json={"name": "links"}).json
    headers = {defaults.TOKEN_HEADER: room["donor_token"]}
    assert client.get("/api/v1/link?bytes=0", headers=headers).status_code == 200
    assert client.post("/api/v1/link", data=b"xy", headers=headers).json == {"bytes": 2}
    refused = client.get("/api/v1/link?bytes=0", headers=headers)
    assert refused.status_code == 429
    assert refused.json["error"]["message"] == "too many link measurements from this address; wait and retry"
    assert client.post("/api/v1/rooms", json={"name": "more"}).status_code == 201  # rooms: their own window


def test_room_creation_and_link_probes_have_their_own_windows(make_app):
    app = make_app(RATE_LIMIT_ROOMS="1/minute", RATE_LIMIT_LINK="1/minute")
    client = app.test_client()
    assert client.post("/api/v1/rooms", json={"name": "a"}).status_code == 201
    refused = client.post("/api/v1/rooms", json={"name": "b"})
    assert refused.status_code == 429
    assert refused.json["error"]["message"] == "too many rooms created from this address; wait and retry"
    other = app.test_client()
    assert other.post("/api/v1/rooms", json={"name": "c"}, environ_base={"REMOTE_ADDR": "10.9.9.9"}).status_code == 201
    assert app.view_functions[limits.ROOM_CREATION].__name__ != "checked"  # functools.wraps kept the view's name
    for endpoint in limits.LINK_PROBES:
        assert app.view_functions[endpoint].__wrapped__ is not None


def test_socket_auth_failures_refuse_the_address_once_over_the_limit(app, monkeypatch):
    ctx = app.extensions["zwdx"]
    monkeypatch.setattr(ctx, "limiter", _window(app, monkeypatch, RATE_LIMIT_AUTH_FAILURES="2/minute"))
    with app.test_request_context(environ_base={"REMOTE_ADDR": "10.0.0.1"}):
        limits.socket_auth()
        limits.socket_auth(ok=True)  # a success counts nothing
        limits.socket_auth(ok=True)
        limits.socket_auth()
        limits.socket_auth(ok=False)
        limits.socket_auth()
        limits.socket_auth(ok=False)
        with pytest.raises(RateLimited) as err:
            limits.socket_auth()
        assert err.value.message == "too many connections with a wrong room token from this address; wait and retry"
        assert not ctx.limiter.allowed("RATE_LIMIT_AUTH_FAILURES", "socket-auth-failures")
        assert ctx.limiter.allowed("RATE_LIMIT_AUTH_FAILURES", "auth-failures")  # REST's own window
    with app.test_request_context(environ_base={"REMOTE_ADDR": "10.0.0.2"}):
        limits.socket_auth()


def test_the_address_without_one_is_a_question_mark(app):
    with app.test_request_context(environ_base={"REMOTE_ADDR": ""}):
        assert limits._address() == "?"
    with app.test_request_context(environ_base={"REMOTE_ADDR": "10.1.2.3"}):
        assert limits._address() == "10.1.2.3"


def test_rest_auth_failures_count_only_on_routes_that_authenticate(make_app):
    app = make_app(RATE_LIMIT_AUTH_FAILURES="2/minute")
    client = app.test_client()
    for _ in range(3):  # /health authenticates nothing: never counted, never refused
        assert client.get("/health").status_code == 200
    for _ in range(2):
        assert client.get("/api/v1/jobs", headers={defaults.TOKEN_HEADER: "zs_wrong"}).status_code == 401
    refused = client.get("/api/v1/jobs", headers={defaults.TOKEN_HEADER: "zs_wrong"})
    assert refused.status_code == 429 and "wrong room token or rank key" in refused.json["error"]["message"]
    assert client.get("/health").status_code == 200


def test_the_default_storage_is_memory(make_app):
    app = make_app()
    assert app.config["RATELIMIT_STORAGE_URI"] == "memory://"
