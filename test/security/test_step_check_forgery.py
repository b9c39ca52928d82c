"""Forged DDP step checks (issue 33, ``RankReport.check``), in process over both stores: a donor
whose rank reports a step check it made up cannot get an honest rank named, nor a GPU client
outside the job avoided. The honest path and each rule: test_trust_step_check.py.

- a rank's key reports its own rank's failure only (403 for another's), and only this attempt's;
- a check that names a rank outside the attempt's placement is refused (400), nothing recorded;
- colluding ranks that agree on a forged account while the others train are no strict majority of
  the attempt's ranks: once the grace is over the job fails, nobody named, no client avoided;
- a DILOCO shadow's check is not kept (its job's steps are not checked).
"""
from __future__ import annotations

from store_backends import *  # noqa: F401,F403  (fixtures: backend, mongo_uri, ...)
from test_trust_step_check import LIAR, check, checked, earlier, fail, settle
from test_trust_verify import backend_app, shadowed  # noqa: F401  (backend_app: a fixture)


def test_a_rank_key_reports_no_other_ranks_check(backend_app):
    room_api, job, ranks = checked(backend_app, {2: 0, 3: 1})
    said = fail(ranks[3], job, 1, check(5, {0: "it lies"}))
    assert said.status_code == 403, said.json
    assert room_api.get(f"/jobs/{job['id']}").json["failures"] == {}


def test_a_check_naming_a_gpu_client_outside_the_job_is_refused(backend_app):
    room_api, job, ranks = checked(backend_app, {2: 0, 3: 1})
    said = fail(ranks[3], job, 3, check(5, {4: "no such rank"}))
    assert said.status_code == 400 and said.json["error"]["field"] == "check", said.json
    record = room_api.get(f"/jobs/{job['id']}").json
    assert record["failures"] == {} and record["avoid"] == []


def test_colluders_agreeing_on_a_forged_check_name_nobody(backend_app):
    from zwdx import defaults
    room_api, job, ranks = checked(backend_app, {3: 0, 4: 2}, workers=3, verify=0.5)
    forged = {0: "disagreed with its shadow", 3: "disagreed with the worker it shadows"}
    for r in (1, 4):  # two of five: all that reported, but no majority of the attempt's ranks
        assert fail(ranks[r], job, r, check(7, forged)).json["ok"]
    earlier(backend_app, job, defaults.CLIENT_TIMEOUT + 1)  # the others never stopped; the wait is over
    settle(backend_app)
    record = room_api.get(f"/jobs/{job['id']}").json
    assert record["status"] == "failed" and record["suspects"] == {} and record["avoid"] == [], record


def test_an_earlier_attempts_key_reports_no_check(backend_app):
    room_api, job, ranks = checked(backend_app, {2: 0, 3: 1})
    for r in range(4):
        assert fail(ranks[r], job, r, check(5, LIAR)).json["ok"]
    settle(backend_app)  # placed again: the attempt's keys expired with it
    assert room_api.get(f"/jobs/{job['id']}").json["status"] == "resuming"
    said = fail(ranks[0], job, 0, check(9, {2: "me too"}))
    assert said.status_code == 403, said.json
    assert room_api.get(f"/jobs/{job['id']}").json["failures"] == {}


def test_a_diloco_shadows_check_is_not_kept(backend_app):
    room_api, job, (r0, r1, shadow) = shadowed(backend_app)
    said = fail(shadow, job, 2, check(1, {1: "it lies"}))
    assert said.status_code == 200 and said.json["ignored"], said.json
    record = room_api.get(f"/jobs/{job['id']}").json
    assert record["failures"] == {} and record["suspects"] == {} and record["shadows"]["2"]["gone"]
