"""Issue 29, L4, in-process over both stores (``security_world``): a NUL character in a JSON
object key is refused at the edge (a REST 400, a Socket.IO ``ok: false``, each naming the field)
and stores nothing, where MongoDB answered 500 (test_edge_flood.py: the rest of the edge, with
a real server)."""
from __future__ import annotations

from security_world import HELLO, world  # noqa: F401 (fixture)
from store_backends import *  # noqa: F401,F403  (fixtures: backend, mongo_uri, ...)
from wire_auth import connect_auth


def test_a_nul_in_a_json_key_of_a_rest_body_is_a_400_naming_the_field(world):
    w = world
    submitter = w.as_submitter()
    bundle = w.request("POST", "/artifacts", submitter, data=b"a bundle").json["id"]
    jobs_before = w.request("GET", "/jobs", submitter).json["jobs"]
    body = '{"bundle_artifact": "%s", "versions": {"python": "3.11", "torch\\u0000x": "2"}}' % bundle
    resp = w.request("POST", "/jobs", submitter, data=body, content_type="application/json")
    assert resp.status_code == 400, resp.text
    error = resp.json["error"]
    assert error["field"] == "versions.torch\\u0000x" and "NUL" in error["message"], error
    body = '{"bundle_artifact": "%s", "lora": {"r": 8, "target\\u0000": ["q"]}}' % bundle
    resp = w.request("POST", "/jobs", submitter, data=body, content_type="application/json")
    assert resp.status_code == 400 and resp.json["error"]["field"] == "lora.target\\u0000", resp.text
    assert w.request("GET", "/jobs", submitter).json["jobs"] == jobs_before  # nothing stored

    live = w.jobs["live"]  # a rank's results: keys its training script chose
    before = w.request("GET", f"/jobs/{live}", submitter).json
    resp = w.request("POST", f"/jobs/{live}/ranks/0", w.as_rank("rank0"), content_type="application/json",
                     data='{"status": "running", "results": {"ok": 1, "loss\\u0000": 1}}')
    assert resp.status_code == 400 and resp.json["error"]["field"] == "results.loss\\u0000", resp.text
    resp = w.request("POST", f"/jobs/{live}/events", w.as_rank("rank0"), content_type="application/json",
                     data='{"events": [{"kind": "metric", "step": 1, "data": {"loss": 1, "acc\\u0000": 2}}]}')
    assert resp.status_code == 400 and resp.json["error"]["field"] == "events.0.data.acc\\u0000", resp.text
    after = w.request("GET", f"/jobs/{live}", submitter).json
    assert w.request("GET", f"/jobs/{live}/events", submitter).json["events"] == []
    assert (after["status"], after.get("results")) == (before["status"], before.get("results"))


def test_a_nul_in_a_json_key_of_a_socketio_payload_is_refused_naming_the_field(world):
    from zwdx.server import socketio
    w = world
    token = w.rooms["A"]["donor_token"]
    sock = socketio.test_client(w.app, namespace="/gpu", auth=connect_auth(token))
    hello = {**HELLO, "client_id": "nul-keys", "versions": {"python": "3.11", "cuda\u0000": "12"}}
    answer = sock.emit("register", hello, namespace="/gpu", callback=True)
    assert answer["ok"] is False and "versions.cuda\\u0000" in answer["error"] and "NUL" in answer["error"], answer
    assert w.store.get_client("nul-keys") is None
    sock.disconnect(namespace="/gpu")
