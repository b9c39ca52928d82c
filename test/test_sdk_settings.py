"""``submit_job``'s settings objects (``zwdx.sdk.settings``): at most 12 parameters, the earlier
keywords kept through one adapter that warns once per keyword and names what replaces it, both
forms sending one spec tree; the result a typed object that still reads as a dict."""
from __future__ import annotations

import inspect
import warnings

import pytest

import zwdx
from earlier_form import earlier_form
from zwdx import ZWDX
from zwdx.errors import BadRequest
from zwdx.sdk import submission
from zwdx.sdk.results import Result, result_of

PLAN = {"0": "colwise", "1": "rowwise"}  # the test model's two Linear layers
SERVER = "http://127.0.0.1:9"  # nothing listens: every call the SDK makes is the test's


def _loader(rank, world_size):
    return [(i, i) for i in range(2)]


def _train(model, loader, optimizer, rank, world_size, epochs=1):
    return {}


def posted(**options) -> dict:
    """The body ``submit_job(**options)`` posts to ``/jobs`` (nothing is sent anywhere)."""
    import torch
    torch.set_num_threads(1)
    sdk, bodies = ZWDX(SERVER, room_token="zs_test", remember=False), []

    def answer(method, path, token=None, **kwargs):
        bodies.append(kwargs.get("json"))
        return {"id": "job1", "room_id": "room1"}
    sdk._json, sdk._upload_bundle = answer, lambda token, parts: {"id": "art1", "size": 10}
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert sdk.submit_job(model, _loader, _train, wait=False, **options) == "job1"
    return bodies[-1]


def test_submit_job_takes_at_most_12_parameters_and_the_settings_are_zwdxs():
    named = [p for p in inspect.signature(ZWDX.submit_job).parameters.values()
             if p.name != "self" and p.kind != p.VAR_KEYWORD]
    assert len(named) <= 12 and [p.name for p in named][:7] == ["model", "data_loader_func", "train_func", "eval_func",
                                                                "optimizer", "parallelism", "memory_required"]
    for name in ("DDP", "FSDP", "TP", "Pipeline", "Diloco", "Mixed", "Resources", "Recovery", "Training", "Run"):
        assert name in zwdx.__all__ and getattr(zwdx, name).__name__ == name
    with pytest.raises(ValueError):  # frozen: a setting is a value (pydantic's ValidationError)
        zwdx.Resources(world_size=2).world_size = 3


def test_the_earlier_keywords_and_the_settings_send_one_spec(monkeypatch):
    monkeypatch.setattr(submission, "_warned", set())
    with pytest.warns(FutureWarning) as said:
        earlier = posted(parallelism="FSDP+TP", tp_size=2, tp_plan=PLAN, world_size=4, epochs=3, max_restarts=1, name="j",
                         room_token="zs_test", progress=False)
    words = [str(w.message) for w in said]
    assert "submit_job(epochs=...) is the earlier form; it still works: use training=zwdx.Training(epochs=...)" \
        in words
    assert any("use run=zwdx.Run(recovery=zwdx.Recovery(max_restarts=...))" in w for w in words)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per keyword: the second call says nothing
        posted(world_size=4, epochs=3)
        settings = posted(strategy=zwdx.FSDP(tp=zwdx.TensorParallel(size=2, plan=PLAN)),
                          resources=zwdx.Resources(world_size=4),
                          training=zwdx.Training(epochs=3),
                          run=zwdx.Run(name="j", progress=False, recovery=zwdx.Recovery(max_restarts=1)))
    assert earlier == settings
    assert settings["spec"]["strategy"] == {"type": "fsdp", "lora": None, "tp": {"plan": PLAN, "size": 2},
                                           "verify": 0.0, "verify_tolerance": 0.0}
    assert settings["spec"]["resources"]["gpus_per_client"] == 2 and settings["spec"]["code"]["bundle_artifact"] == "art1"


def test_a_new_option_needs_no_sdk_change():
    """``training.seed`` is declared in the spec alone: ``Training`` is the spec's part."""
    body = posted(training=zwdx.Training(seed=7), run=zwdx.Run(progress=False))
    assert body["spec"]["training"]["seed"] == 7


def test_wrong_combinations_are_refused_naming_the_argument():
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        posted(colour="red")
    with earlier_form(), pytest.raises(BadRequest) as err:
        posted(strategy=zwdx.Diloco(), diloco={"inner_steps": 5})
    assert err.value.field == "diloco" and "strategy=zwdx.Diloco(...)" in str(err.value)
    with pytest.raises(BadRequest) as err:
        posted(parallelism="FSDP", strategy=zwdx.DDP())
    assert err.value.field == "parallelism"
    with pytest.raises(BadRequest) as err:  # the tree's own checks, naming the tree's field
        posted(strategy=zwdx.TP(size=3), resources=zwdx.Resources(world_size=2))
    assert err.value.field == "spec.strategy.tp.size"


def test_the_result_is_typed_and_still_a_dict():
    result = result_of({"id": "j1", "status": "completed", "results": {"acc": 0.9}, "final_loss": 0.1,
                        "world_size": 2}, raise_on_failure=True)
    assert isinstance(result, Result) and isinstance(result, dict)
    assert result["status"] is result.status and result.status == "completed" and result.status == "complete"
    assert (result.job_id, result.results, result.complete, result.failures) == ("j1", {"acc": 0.9}, True, {})
