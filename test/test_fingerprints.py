"""The ranks' final weights, compared: every rank that holds the whole model reports a sha256 of
its final weights; when they differ the job carries a warning naming who holds what (the
majority, when there is one), in its record, its log, ``zwdx jobs show`` and the SDK's result.
Equal fingerprints, or ranks that hold no whole model (None), warn of nothing.

The weights that come back (rank 0's upload) are held against those fingerprints by the server
(``zwdx.server.suspects.compare_upload``): an upload that is not what rank 0 reported makes rank 0
a suspect, one that is not what a strict majority reported is a warning, and a rank outside that
majority is a suspect. The uploads here are real safetensors files; their fingerprints are the
tests' own digest (``digests``), not the product's."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save

from digests import state_digest
from store_backends import *  # noqa: F401,F403  (fixtures: backend, mongo_uri, ...)
from test_diloco import placed
from test_robust import backend_app  # noqa: F401  (the app over SQLite, and MongoDB's stand-in in the slow lane)

#: Final weights by letter: what a rank holds, and what it reports (its digest).
STATES = {letter: {"layer.weight": torch.full((3, 2), float(i)), "layer.bias": torch.arange(3.0) * i,
                   "steps": torch.tensor(i, dtype=torch.int64), "half": torch.ones(4, dtype=torch.bfloat16) * i}
          for i, letter in enumerate("abc", start=1)}


def finish(app, held: list[str | None], upload: str | bytes | None = None, parallelism: str = "DDP") -> tuple:
    """A job whose ranks report they hold ``held`` (letters of STATES; None: no whole model) and
    whose rank 0 uploads ``upload`` (a letter, raw bytes; default: what rank 0 holds)."""
    room, ranks, job = placed(app, world_size=len(held), parallelism=parallelism)
    for r, api in enumerate(ranks):
        assert api.post(f"/jobs/{job['id']}/ranks/{r}", json={"status": "running"}).json["ok"]
    upload = held[0] if upload is None else upload
    blob = upload if isinstance(upload, bytes) else save(STATES[upload])
    weights = ranks[0].put(f"/jobs/{job['id']}/weights", data=blob).json["id"]
    for r, (api, letter) in enumerate(zip(ranks, held)):
        body = {"status": "completed", "final_loss": 0.5, **({"fingerprint": digest(letter)} if letter else {}),
                **({"weights_artifact": weights} if r == 0 else {})}
        assert api.post(f"/jobs/{job['id']}/ranks/{r}", json=body).json["ok"]
    return room.get(f"/jobs/{job['id']}").json, room


def digest(letter: str) -> str:
    return state_digest(STATES[letter])


def test_a_rank_whose_final_weights_differ_is_a_warning_naming_the_majority_and_a_suspect(backend_app):
    job, room = finish(backend_app, ["a", "a", "b"])
    assert job["status"] == "completed"
    [warning] = job["warnings"]  # the upload is the majority's: that is not in doubt
    assert f"rank(s) 0, 1 hold {digest('a')[:12]}" in warning and f"rank(s) 2 hold {digest('b')[:12]}" in warning
    assert warning.endswith("the majority is rank(s) 0, 1")
    log = [e["data"]["text"] for e in room.get(f"/jobs/{job['id']}/events").json["events"] if e["kind"] == "log"]
    assert f"WARNING: {warning}" in log
    assert set(job["suspects"]) == {"2"} and "not those of rank(s) 0, 1 (the majority)" in job["suspects"]["2"]["reason"]
    assert job["avoid"] == [job["suspects"]["2"]["client_id"]]


@pytest.mark.parametrize("held", [["a"] * 3, ["a", None, None], ["b", None]])
def test_equal_fingerprints_or_ranks_without_the_whole_model_warn_of_nothing(app, held):
    job, _ = finish(app, held)
    assert job["status"] == "completed" and job["warnings"] == [] and job["suspects"] == {}


def test_two_ranks_that_disagree_name_no_majority_and_no_suspect(app):
    job, _ = finish(app, ["a", "c"])
    assert len(job["warnings"]) == 1 and "majority" not in job["warnings"][0] and job["suspects"] == {}


def test_rank_0_uploading_other_weights_than_it_and_the_others_reported_is_a_suspect_and_a_warning(backend_app):
    job, room = finish(backend_app, ["a", "a", "a"], upload="b")
    assert job["status"] == "completed" and set(job["suspects"]) == {"0"}
    assert job["suspects"]["0"]["reason"] == (f"the weights it uploaded (fingerprint {digest('b')[:12]}) are not the "
                                              f"weights it reported ({digest('a')[:12]})")
    [warning] = job["warnings"]
    assert warning == (f"the weights that came back (rank 0's upload, fingerprint {digest('b')[:12]}) are not the "
                       f"weights rank(s) 0, 1, 2 (the majority) reported ({digest('a')[:12]}): do not trust them")
    log = [e["data"]["text"] for e in room.get(f"/jobs/{job['id']}/events").json["events"] if e["kind"] == "log"]
    assert f"WARNING: {warning}" in log and any("weights check: rank 0" in t and "is a suspect" in t for t in log)


def test_rank_0_alone_uploading_other_weights_than_it_reported_is_a_suspect(app):
    job, _ = finish(app, ["a", None], upload="c")  # FSDP-like: rank 0 alone holds the whole model
    assert set(job["suspects"]) == {"0"}
    assert job["warnings"] == [f"the weights that came back (rank 0's upload, fingerprint {digest('c')[:12]}) are not "
                               f"the weights rank(s) 0 reported ({digest('a')[:12]}): do not trust them"]


def test_an_upload_that_is_not_safetensors_is_rank_0s_and_named(app):
    job, _ = finish(app, ["a", "a", "a"], upload=b"weights")
    assert set(job["suspects"]) == {"0"} and "unreadable (not safetensors)" in job["suspects"]["0"]["reason"]
    assert len(job["warnings"]) == 1


def test_a_liar_in_the_majority_with_rank_0_leaves_the_honest_upload_unwarned_but_names_the_odd_one(app):
    job, _ = finish(app, ["a", "b", "a", "a"])
    assert set(job["suspects"]) == {"1"} and len(job["warnings"]) == 1  # the ranks' disagreement, no more


def test_the_sdk_result_and_jobs_show_carry_the_warning_and_the_suspects(app, capsys):
    from types import SimpleNamespace

    from zwdx.jobs_cli import jobs_show
    from zwdx.sdk import ZWDX
    job, _ = finish(app, ["a", "a", "a"], upload="b")
    result = ZWDX._result(job, raise_on_failure=False)
    assert result["warnings"] == job["warnings"] and [s["rank"] for s in result["suspects"]] == [0]
    jobs_show(SimpleNamespace(get_job=lambda _: job), SimpleNamespace(job_id=job["id"], json=False))
    out = capsys.readouterr().out
    assert "WARNING" in out and "suspect" in out.lower()
