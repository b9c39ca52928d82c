"""Artifact references are plain ids of the same job: a rank's ``weights_artifact`` must name
weights uploaded for its own job, or the report is refused (400) and nothing is recorded; a
job's weights are read only from an artifact of that job. Over both stores (SQLite, and
MongoDB over its wire protocol), with the attacks of the trust issue: an operator document
(``{"$gt": ""}``) as an id, and another room's artifact id.

In-process apps; the job is placed as the scheduler would (conftest's ``placed_job``), under a
rank key the test holds, so the test speaks as the job's rank 0.
"""
from __future__ import annotations

import pytest

from conftest import placed_job
from store_backends import *  # noqa: F401,F403  (fixtures: backend, mongo_uri, ...)


@pytest.fixture
def backend_app(backend, make_app, tmp_path):
    """An in-process app over the backend's store (artifact bytes in files, or GridFS)."""
    if backend.name == "sqlite":
        return make_app(DATA_DIR=backend.where)
    return make_app(DATA_DIR=str(tmp_path / "mongo-app"), MONGO_URI=backend.where)


def test_a_rank_can_name_only_its_own_jobs_weights(backend_app):
    room, rank0, job = placed_job(backend_app, "mine")
    other_room, other_rank0, other_job = placed_job(backend_app, "other")
    theirs = other_rank0.put(f"/jobs/{other_job['id']}/weights", data=b"their weights").json
    checkpoint = rank0.put(f"/jobs/{job['id']}/checkpoints/0/state.pt", data=b"a checkpoint").json
    assert rank0.post(f"/jobs/{job['id']}/ranks/0", json={"status": "running"}).json == {"ok": True}

    for wrong in [{"$gt": ""}, {"$ne": None}, {"$in": [theirs["id"]]}, {"$regex": "."}, theirs["id"],
                  job["spec"]["code"]["bundle_artifact"], checkpoint["id"], "no-such-artifact", ["a"]]:
        resp = rank0.post(f"/jobs/{job['id']}/ranks/0", json={"status": "completed", "weights_artifact": wrong,
                                                              "final_loss": 0.5})
        assert resp.status_code == 400, (wrong, resp.text)
        assert resp.json["error"]["field"] == "weights_artifact", resp.text
        seen = room.get(f"/jobs/{job['id']}").json
        assert seen["status"] == "running" and seen["weights_artifact"] is None and seen["final_loss"] is None
        assert seen["ranks"]["0"]["status"] == "running"

    mine = rank0.put(f"/jobs/{job['id']}/weights", data=b"my weights").json
    resp = rank0.post(f"/jobs/{job['id']}/ranks/0", json={"status": "completed", "weights_artifact": mine["id"],
                                                          "final_loss": 0.5})
    assert resp.status_code == 200 and resp.json == {"ok": True}, resp.text
    done = room.get(f"/jobs/{job['id']}").json
    assert done["status"] == "completed" and done["weights_artifact"] == mine["id"]
    assert room.get(f"/jobs/{job['id']}/weights").data == b"my weights"
    # The other job never heard of any of it.
    assert other_room.get(f"/jobs/{other_job['id']}").json["status"] == "starting"


def test_weights_are_read_only_from_an_artifact_of_the_job(backend_app):
    """A record that names another job's weights (written by an older zwdx that took any id)
    gives "no trained weights", not those bytes."""
    room, rank0, job = placed_job(backend_app, "mine")
    _, other_rank0, other_job = placed_job(backend_app, "other")
    theirs = other_rank0.put(f"/jobs/{other_job['id']}/weights", data=b"their weights").json
    store = backend_app.extensions["zwdx"].store
    assert store.set_job(job["id"], {"weights_artifact": theirs["id"]}) is not None
    resp = room.get(f"/jobs/{job['id']}/weights")
    assert resp.status_code == 404 and resp.json["error"]["code"] == "not_found", resp.text
    assert b"their weights" not in resp.data
    # An id that is no artifact at all: the same.
    assert store.set_job(job["id"], {"weights_artifact": "nothing-here"}) is not None
    assert room.get(f"/jobs/{job['id']}/weights").status_code == 404


def test_an_operator_document_is_no_artifact_id_anywhere(backend_app):
    room, rank0, job = placed_job(backend_app, "mine")
    resp = room.post("/jobs", json={"bundle_artifact": {"$gt": ""}, "versions": {"python": "3.11.7"}})
    assert resp.status_code == 400 and resp.json["error"]["field"] == "bundle_artifact", resp.text
    resp = rank0.post(f"/jobs/{job['id']}/checkpoints/0/commit", json={"files": [{"$gt": ""}]})
    assert resp.status_code == 400 and resp.json["error"]["field"] == "files.0", resp.text
    assert [j["id"] for j in room.jobs()] == [job["id"]]
    assert room.get(f"/jobs/{job['id']}/checkpoints").json["checkpoints"] == []
