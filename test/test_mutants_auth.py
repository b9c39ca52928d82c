"""zwdx/server/auth.py, checked where mutation testing (bench/mutation.py) found nothing looking:
the credential cache (a revoked token must not live on in it), each refusal's words and context,
the Bearer header, a rank key's grace after its job failed. In-process, fast lane."""
from __future__ import annotations

import time

import pytest

from zwdx import defaults
from zwdx.errors import AuthError, Forbidden, NotFound
from zwdx.protocol import CredentialRole
from zwdx.server import auth
from zwdx.server.auth import Caller, CredentialCache


def caller(cid: str) -> Caller:
    return Caller({"id": cid, "role": "submitter"}, {"id": "room"})


def test_the_cache_holds_a_caller_for_its_ttl_and_not_a_moment_longer(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(auth.time, "monotonic", lambda: now[0])
    cache = CredentialCache(ttl=5)
    cache.put("h1", caller("a"))
    assert cache.get("h1").credential["id"] == "a" and cache.get("other") is None
    now[0] = 1004.9
    assert cache.get("h1") is not None
    now[0] = 1005.0  # read exactly ttl ago: stale
    assert cache.get("h1") is None


def test_forget_drops_only_the_credential_named():
    cache = CredentialCache(ttl=60)
    cache.put("h1", caller("a"))
    cache.put("h2", caller("a"))
    cache.put("h3", caller("b"))
    cache.forget("a")
    assert cache.get("h1") is None and cache.get("h2") is None
    assert cache.get("h3").credential["id"] == "b"


def test_a_flood_of_tokens_empties_the_cache_once_it_passes_100000():
    cache = CredentialCache(ttl=60)
    cache._held = {f"h{i}": (caller("x"), time.monotonic()) for i in range(100_000)}
    cache.put("new", caller("n"))  # 100,000 held: not over the bound yet
    assert cache.get("h0") is not None and len(cache._held) == 100_001
    cache.put("newer", caller("m"))  # over it: forget the rest
    assert cache.get("h0") is None and cache.get("newer") is not None and len(cache._held) == 1


@pytest.fixture
def ctx(app):
    with app.test_request_context():
        yield app.extensions["zwdx"]


def test_a_token_is_read_from_the_store_once_then_from_the_cache(api, app, monkeypatch):
    ctx = app.extensions["zwdx"]
    reads = []
    find = ctx.store.find_credential
    monkeypatch.setattr(ctx.store, "find_credential", lambda h: reads.append(h) or find(h))
    with app.test_request_context():
        ctx.credentials = CredentialCache(ttl=60)
        first = auth.caller_for_token(api.token)
        assert reads == [auth.hash_secret(api.token)]
        assert auth.caller_for_token(api.token) == first and len(reads) == 1
        assert auth.caller_for_token(f"  {api.token} ") == first and len(reads) == 1  # stripped


@pytest.mark.parametrize("token", [None, "", 123, ["zs_x"]])
def test_no_token_or_not_a_string_is_an_auth_error_naming_the_header(ctx, token):
    with pytest.raises(AuthError, match=defaults.TOKEN_HEADER):
        auth.caller_for_token(token)


def test_an_unknown_token_or_one_whose_room_is_gone_opens_nothing(api, ctx, monkeypatch):
    with pytest.raises(AuthError) as err:
        auth.caller_for_token("zs_nobody")
    assert err.value.message == "room token not recognised: no room has this token"
    monkeypatch.setattr(ctx.store, "get_room", lambda room_id: None)
    with pytest.raises(AuthError, match="not recognised"):
        auth.caller_for_token(api.token)


def test_a_revoked_token_is_refused_even_where_the_cache_still_holds_it(api, app):
    ctx = app.extensions["zwdx"]
    other = api.post("/room/tokens", json={"role": "submitter", "name": "spare"})
    assert other.status_code == 201, other.json
    with app.test_request_context():
        ctx.credentials = CredentialCache(ttl=3600)
        held = auth.caller_for_token(api.token)  # now cached
        revoked = ctx.store.revoke_credential(held.credential["id"], time.time())
        ctx.credentials.put(auth.hash_secret(api.token), Caller(revoked, held.room))
        with pytest.raises(AuthError) as err:
            auth.caller_for_token(api.token)
    assert err.value.message == ("room token revoked: it opens nothing any more "
                                 "(ask the room's owner for another)")


def test_the_wrong_role_is_forbidden_and_says_which_token_to_use(api, ctx):
    with pytest.raises(Forbidden) as err:
        auth.submitter(api.donor)
    assert "this is a donor token" in err.value.message and "zs_..." in err.value.message
    with pytest.raises(Forbidden) as err:
        auth.donor(api.token)
    assert "this is a submitter token" in err.value.message and "zd_..." in err.value.message
    assert auth.submitter(api.token).submits and auth.donor(api.donor).donates


@pytest.mark.parametrize("headers, expected", [
    ({defaults.TOKEN_HEADER: "zs_a"}, "zs_a"),
    ({defaults.TOKEN_HEADER: "zs_a", "Authorization": "Bearer zs_b"}, "zs_a"),
    ({"Authorization": "Bearer zs_b"}, "zs_b"),
    ({"authorization": "bearer zs_b"}, "zs_b"),
    ({"Authorization": "BEARER zs_b"}, "zs_b"),
    ({"Authorization": "Basic zs_b"}, None),
    ({}, None),
])
def test_the_request_token_comes_from_its_header_or_a_bearer(app, headers, expected):
    with app.test_request_context(headers=headers):
        assert auth.request_token() == expected


def test_request_room_is_the_submitter_tokens_room(api, app):
    with app.test_request_context(headers={"Authorization": f"Bearer {api.token}"}):
        assert auth.request_room()["id"] == api.room["id"]


def test_another_rooms_job_is_not_found_with_its_id(app, room_api):
    mine, theirs = room_api("mine"), room_api("theirs")
    job = theirs.submit().json
    with app.test_request_context():
        with pytest.raises(NotFound) as err:
            auth.job_in_room(job["id"], {"id": mine.room["id"]})
    assert err.value.message == f"no job {job['id']} in this room" and err.value.context == {"job_id": job["id"]}


def test_only_rank_names_the_rank_it_wants_and_the_one_it_got():
    sender = auth.Sender(rank=1, client_id="c", attempt=0)
    auth.only_rank(sender, 1, "x", "j")
    with pytest.raises(Forbidden) as err:
        auth.only_rank(sender, 0, "the weights", "j1")
    assert err.value.message == "the weights takes rank 0's key; this is rank 1's"
    assert err.value.context == {"job_id": "j1", "rank": 1}


def test_a_rank_key_speaks_for_its_rank_client_and_attempt(app):
    from conftest import placed_ranks
    _, ranks, job = placed_ranks(app, "who", 2)
    with app.test_request_context():
        record, sender = auth.rank_sender(job["id"], ranks[1].rank_key)
    assert (sender.rank, sender.client_id, sender.attempt, sender.live) == (1, "gpu-who", 0, True)
    assert record.id == job["id"]


@pytest.mark.parametrize("key, hint", [("no-prefix", ""), ("rk_wrong", " (that is a rank key)"), ("zs_abc", " (that is a submitter token)")])
def test_a_key_of_no_rank_is_forbidden_with_a_hint_of_what_it_is(app, key, hint):
    from conftest import placed_job
    _, _, job = placed_job(app, "hint")
    with app.test_request_context():
        with pytest.raises(Forbidden) as err:
            auth.rank_sender(job["id"], key)
    assert err.value.message == f"this rank key opens no rank of job {job['id']}'s current attempt{hint}"
    assert err.value.context == {"job_id": job["id"]}


@pytest.mark.parametrize("key", [None, "", 5])
def test_no_rank_key_is_an_auth_error(app, key):
    with app.test_request_context():
        with pytest.raises(AuthError, match=defaults.RANK_KEY_HEADER):
            auth.rank_sender("j", key)


def test_a_failed_jobs_key_works_late_within_the_grace_and_only_there(app, monkeypatch):
    from conftest import placed_job
    from zwdx.server.jobs import Job
    _, rank, job = placed_job(app, "late")
    ctx = app.extensions["zwdx"]
    record = Job.load(ctx.store, job["id"])
    assert record.fail("it broke") is not False
    ended = ctx.store.get_job(job["id"]).ended_at
    assert ended is not None
    with app.test_request_context():
        monkeypatch.setattr(auth.time, "time", lambda: ended + defaults.FAILURE_REPORT_GRACE - 0.01)
        _, sender = auth.rank_sender(job["id"], rank.rank_key, late=True)
        assert (sender.rank, sender.client_id, sender.attempt, sender.live) == (0, "gpu-late", 0, False)
        with pytest.raises(Forbidden) as err:
            auth.rank_sender(job["id"], rank.rank_key)  # not late: refused
        assert err.value.message == f"job {job['id']} is failed: the keys of its ranks expired with it"
        assert err.value.context == {"job_id": job["id"], "status": "failed"}
        monkeypatch.setattr(auth.time, "time", lambda: ended + defaults.FAILURE_REPORT_GRACE)
        with pytest.raises(Forbidden):
            auth.rank_sender(job["id"], rank.rank_key, late=True)


def test_a_finished_jobs_key_is_refused_even_late(app):
    from conftest import placed_job
    from zwdx.server.jobs import Job
    _, rank, job = placed_job(app, "done")
    ctx = app.extensions["zwdx"]
    Job.load(ctx.store, job["id"]).cancel("done")
    with app.test_request_context():
        with pytest.raises(Forbidden, match="expired with it"):
            auth.rank_sender(job["id"], rank.rank_key, late=True)


def test_an_issued_credential_is_stored_with_its_hash_and_fields(app):
    ctx = app.extensions["zwdx"]
    room = ctx.store.create_room({"id": "r1", "name": "r1", "created_at": time.time()})
    before = time.time()
    record, secret = auth.issue_credential(ctx.store, room["id"], CredentialRole.DONOR)
    assert secret.startswith("zd_") and len(secret) == 3 + 43  # 32 random bytes, urlsafe base64
    stored = ctx.store.find_credential(auth.hash_secret(secret))
    assert stored["id"] == record["id"] and len(record["id"]) == 12
    assert {k: stored[k] for k in ("room_id", "role", "name", "rotated_at", "revoked_at", "legacy")} == \
        {"room_id": "r1", "role": "donor", "name": "", "rotated_at": None, "revoked_at": None, "legacy": False}
    assert before <= stored["created_at"] <= time.time()


def test_a_rank_key_for_a_job_that_does_not_exist_reads_as_a_key_that_opens_nothing(app):
    with app.test_request_context():
        with pytest.raises(Forbidden) as err:
            auth.rank_sender("no-such-job", "rk_anything")
    assert err.value.message == "this rank key opens no rank of job no-such-job's current attempt (that is a rank key)"
