"""The REST edge: every route's input is checked once, before its handler, and a wrong one is a
400 whose ``field`` names it (``problems`` lists them), never a 500, and changes nothing. The
inputs a fuzzer finds first: integers past 64 bits, numbers where counts go, bodies that are
not JSON objects, JSON nested a thousand deep, paths that are not counts, routes that do not
exist. In-process (conftest's ``api``)."""
from __future__ import annotations

import pytest

from zwdx.protocol.report import RankReport
from zwdx.server.http import MAX_JSON_BYTES, MAX_JSON_DEPTH

from conftest import placed_job
from store_backends import mongo_server, mongo_uri  # noqa: F401 (fixtures)


@pytest.fixture
def job(api) -> dict:
    resp = api.submit()
    assert resp.status_code == 201, resp.text
    return resp.json


def bad(resp, field: str) -> dict:
    assert resp.status_code == 400, resp.text
    error = resp.json["error"]
    assert error["code"] == "bad_request" and error["field"] == field and field in error["message"], error
    return error


@pytest.mark.parametrize("query, field", [
    ("after=9223372036854775808", "after"),
    ("after=-1", "after"),
    ("after=1.5", "after"),
    ("limit=1e23", "limit"),
    ("limit=0", "limit"),
    ("kind=metrics", "kind"),
])
def test_event_queries_out_of_range_are_400_naming_the_parameter(api, job, query, field):
    error = bad(api.get(f"/jobs/{job['id']}/events?{query}"), field)
    assert error["message"].startswith("query: field")
    assert api.get(f"/jobs/{job['id']}/events?after=0&limit=10&kind=metric").json == {"job_id": job["id"],
                                                                                     "events": [], "next": None}


def test_a_job_query_and_a_status_list_are_checked(api, job):
    bad(api.get(f"/jobs/{job['id']}?events_after=99999999999999999999"), "events_after")
    error = bad(api.get("/jobs?status=queued,paused"), "status")
    assert "paused" in error["message"]
    assert [j["id"] for j in api.get("/jobs?status=queued,running").json["jobs"]] == [job["id"]]


@pytest.mark.parametrize("body", ["[]", "[1, 2]", '"text"', "3", "true", "null"])
def test_a_body_that_is_not_an_object_is_400(api, job, body):
    error = bad(api.post("/jobs", data=body, content_type="application/json"), "body")
    assert "JSON object" in error["message"]
    assert [j["id"] for j in api.jobs()] == [job["id"]]


def test_json_nested_too_deep_is_refused_before_it_is_parsed(api, job):
    deep = "[" * 5000 + "]" * 5000  # Python's own parser would hit its recursion limit
    resp = api.post("/jobs", data=deep, content_type="application/json")
    error = bad(resp, "body")
    assert f"deeper than {MAX_JSON_DEPTH}" in error["message"]
    # A report whose results nest within the limit is read; one nesting deeper is not.
    nested: dict = {"x": 1}
    for _ in range(MAX_JSON_DEPTH - 3):
        nested = {"x": nested}
    assert RankReport.model_validate({"status": "running", "results": {"r": nested}})
    brackets = '{"a":' * (MAX_JSON_DEPTH + 1) + "1" + "}" * (MAX_JSON_DEPTH + 1)
    bad(api.post("/rooms", data=brackets, content_type="application/json"), "body")
    # Brackets inside strings are text, not nesting.
    resp = api.post("/rooms", json={"name": "[" * 90})
    assert resp.status_code == 201, resp.text


def test_json_integers_past_64_bits_keep_every_digit(app):
    room, rank0, job = placed_job(app, "bigint")
    big = 2 ** 70 + 1  # a float would lose the + 1
    body = '{"status": "completed", "results": {"n": %d, "small": [1, 2.5]}}' % big
    resp = rank0.post(f"/jobs/{job['id']}/ranks/0", data=body, content_type="application/json")
    assert resp.status_code < 300, resp.text
    assert room.get(f"/jobs/{job['id']}").json["results"] == {"n": big, "small": [1, 2.5]}


def test_json_integers_past_64_bits_on_mongodb_are_a_400_changing_nothing(make_app, mongo_uri):
    app = make_app(MONGO_URI=mongo_uri)
    room, rank0, job = placed_job(app, "bigint")
    before = room.get(f"/jobs/{job['id']}").json
    body = '{"status": "completed", "results": {"n": %d}}' % (2 ** 70 + 1)
    resp = rank0.post(f"/jobs/{job['id']}/ranks/0", data=body, content_type="application/json")
    assert resp.status_code == 400 and "past 64 bits" in resp.json["error"]["message"], resp.text
    after = room.get(f"/jobs/{job['id']}").json
    assert (after["status"], after["results"]) == (before["status"], before["results"])


def test_a_body_past_the_json_limit_is_413(api, job):
    resp = api.post("/jobs", data=b" " * (MAX_JSON_BYTES + 1), content_type="application/json")
    assert resp.status_code == 413 and resp.json["error"]["code"] == "payload_too_large", resp.text


def test_not_json_at_all_is_400(api):
    error = bad(api.post("/jobs", data=b"\xff\xfe{", content_type="application/json"), "body")
    assert "not JSON" in error["message"]


def test_every_problem_is_listed(api):
    error = bad(api.post("/jobs", json={"versions": {"python": "3.11.7"}, "bundle_artifact": "x", "epochs": "3",
                                        "world_size": 0, "colour": "red"}), "epochs")
    assert error["message"] == "field 'epochs' must be int, got str"
    assert [p["field"] for p in error["problems"]] == ["epochs", "world_size", "colour"]


@pytest.mark.parametrize("rank", ["abc", "-1", "1e3", "99999999999999999999", "%C2%B2"])
def test_a_rank_in_the_path_must_be_a_count(api, job, rank):
    resp = api.as_(None, rank_key="rk_forged").post(f"/jobs/{job['id']}/ranks/{rank}", json={"status": "running"})
    assert resp.status_code == 403  # who asks is checked first: nothing is read for a stranger
    error = bad(api.get(f"/jobs/{job['id']}/checkpoints/{rank}/state.pt"), "n")
    assert "whole number" in error["message"]


@pytest.mark.parametrize("method, path", [("POST", "/nothing"), ("PUT", "/jobs"), ("DELETE", "/room"),
                                          ("GET", "/jobs/x/cancel"), ("POST", "/jobs/x/y/z")])
def test_a_route_the_api_does_not_have_is_404(api, method, path):
    resp = api.request(method, path)
    assert resp.status_code == 404 and resp.json["error"]["code"] == "not_found", resp.text
    assert "no API route" in resp.json["error"]["message"]


def test_a_checkpoint_file_name_is_checked_before_anything_is_stored(api, app, job):
    ctx = app.extensions["zwdx"]
    before = ctx.store.list_artifacts(job["id"])
    resp = api.as_(None, rank_key="rk_forged").put(f"/jobs/{job['id']}/checkpoints/0/..", data=b"x")
    assert resp.status_code in (403, 404)
    assert ctx.store.list_artifacts(job["id"]) == before
