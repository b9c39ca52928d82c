"""The ranks' final weights, compared: every rank that holds the whole model reports a sha256 of
its final weights; when they differ the job carries a warning naming who holds what (the
majority, when there is one), in its record, its log, ``zwdx jobs show`` and the SDK's result.
Equal fingerprints, or ranks that hold no whole model (None), warn of nothing."""
from __future__ import annotations

import pytest

from store_backends import *  # noqa: F401,F403  (fixtures: backend, mongo_uri, ...)
from test_diloco import placed
from test_robust import backend_app  # noqa: F401  (the app over SQLite, and MongoDB's stand-in in the slow lane)


def finish(app, fingerprints: list[str | None], parallelism: str = "DDP") -> dict:
    room, ranks, job = placed(app, world_size=len(fingerprints), parallelism=parallelism)
    for r, api in enumerate(ranks):
        assert api.post(f"/jobs/{job['id']}/ranks/{r}", json={"status": "running"}).json["ok"]
    weights = ranks[0].put(f"/jobs/{job['id']}/weights", data=b"weights").json["id"]
    for r, (api, fp) in enumerate(zip(ranks, fingerprints)):
        body = {"status": "completed", "final_loss": 0.5, **({"fingerprint": fp} if fp else {}),
                **({"weights_artifact": weights} if r == 0 else {})}
        assert api.post(f"/jobs/{job['id']}/ranks/{r}", json=body).json["ok"]
    return room.get(f"/jobs/{job['id']}").json, room


def test_a_rank_whose_final_weights_differ_is_a_warning_naming_the_majority(backend_app):
    job, room = finish(backend_app, ["a" * 64, "a" * 64, "b" * 64])
    assert job["status"] == "completed"
    [warning] = job["warnings"]
    assert "rank(s) 0, 1 hold aaaaaaaaaaaa" in warning and "rank(s) 2 hold bbbbbbbbbbbb" in warning
    assert warning.endswith("the majority is rank(s) 0, 1")
    log = [e["data"]["text"] for e in room.get(f"/jobs/{job['id']}/events").json["events"] if e["kind"] == "log"]
    assert f"WARNING: {warning}" in log


@pytest.mark.parametrize("fingerprints", [["a" * 64] * 3, ["a" * 64, None, None], [None, None]])
def test_equal_fingerprints_or_ranks_without_the_whole_model_warn_of_nothing(app, fingerprints):
    job, _ = finish(app, fingerprints)
    assert job["status"] == "completed" and job["warnings"] == []


def test_two_ranks_that_disagree_name_no_majority(app):
    job, _ = finish(app, ["a" * 64, "c" * 64])
    assert len(job["warnings"]) == 1 and "majority" not in job["warnings"][0]


def test_the_sdk_result_and_jobs_show_carry_the_warning(app, capsys):
    from types import SimpleNamespace

    from zwdx.jobs_cli import jobs_show
    from zwdx.sdk import ZWDX
    job, _ = finish(app, ["a" * 64, "b" * 64, "b" * 64])
    result = ZWDX._result(job, raise_on_failure=False)
    assert result["warnings"] == job["warnings"] and result["suspects"] == []
    jobs_show(SimpleNamespace(get_job=lambda _: job), SimpleNamespace(job_id=job["id"], json=False))
    assert "WARNING" in capsys.readouterr().out
