"""The job spec as one tree (``zwdx.protocol.spec``): a mode's options live on its strategy, the
flat shape of earlier versions (a body an older SDK sends, a record a store holds) reads as the
same tree, and the rules between the parts are checked once, at submit."""
from __future__ import annotations

import pytest

from store_backends import *  # noqa: F401,F403  (fixtures: backend, store)
from store_backends import job_record
from zwdx.errors import BadRequest
from zwdx.protocol.base import parse
from zwdx.protocol.job import JobView
from zwdx.protocol.rest import SubmitJob
from zwdx.protocol.spec import DDP, FSDP, TP, Diloco, JobSpec, Mixed, Pipeline, Resources, Script, SubmitSpec
from zwdx.server.store import SCHEMA_VERSION

CODE = {"bundle_artifact": "b1", "versions": {"python": "3.11"}}
#: Specs as the zwdx before the tree stored them (one field per option), and what each is now.
FLAT = [
    ({"parallelism": "DILOCO", "world_size": 4, "gpus_per_client": 2,
      "diloco": {"inner_steps": 50, "compression": "fp16", "ranks_per_worker": 2}}, Diloco),
    ({"parallelism": "FSDP+TP", "world_size": 4, "gpus_per_client": 2, "tp_plan": {"a.b": "colwise"}, "tp_size": 2},
     FSDP),
    ({"parallelism": "TP", "world_size": 2, "gpus_per_client": 2, "tp_plan": None, "tp_size": None}, TP),
    ({"parallelism": "DDP", "devices": "mixed", "global_batch": 64, "world_size": 2, "diloco": None}, Mixed),
    ({"parallelism": "PIPELINE", "world_size": 2, "pipeline": {"schedule": "1f1b", "microbatches": 4}}, Pipeline),
    ({"parallelism": "DDP", "kind": "script", "world_size": 2, "script": {"path": "train.py", "args": ["--x"]}},
     Script),
    ({"parallelism": "FSDP", "lora": {"peft_type": "LORA", "r": 4}, "epochs": 3, "max_restarts": 1}, FSDP),
]


def flat_doc(job_id: str, spec: dict) -> dict:
    doc = job_record(job_id).model_dump(mode="json")
    return {**doc, "seq": int(job_id[1:]), "spec": {**CODE, "bundle_sha256": "ab" * 32, "bundle_size": 10,
                                                    "memory_required": 0, "required_modules": [], **spec}}


def test_jobs_stored_flat_by_an_earlier_zwdx_load_as_the_tree(backend):
    docs = [flat_doc(f"j{i}", spec) for i, (spec, _) in enumerate(FLAT)]
    backend.write_raw([], docs, schema_version=SCHEMA_VERSION)
    store = backend.open()
    for doc, (spec, strategy) in zip(docs, FLAT):
        job = store.get_job(doc["id"])
        assert type(job.spec.strategy) is strategy, spec
        assert job.spec.parallelism.value == spec["parallelism"] and job.spec.code.bundle_artifact == "b1"
        assert job.spec.resources.world_size == spec.get("world_size")
        assert JobSpec.model_validate(job.spec.model_dump(mode="json")) == job.spec  # and stores back as it reads
        assert JobView.of(job).model_dump(mode="json")["spec"]["strategy"]["type"] == strategy.model_fields["type"].default
    diloco, fsdp_tp, tp, mixed, pipeline, script, lora = (store.get_job(d["id"]).spec for d in docs)
    assert (diloco.diloco.inner_steps, diloco.diloco.compression.value, diloco.resources.gpus_per_client) == (50, "fp16", 2)
    assert (fsdp_tp.tp.plan, fsdp_tp.tp.size) == ({"a.b": "colwise"}, 2) and tp.tp.size is None
    assert mixed.mixed.global_batch == 64 and pipeline.pipeline.microbatches == 4
    assert (script.kind.value, script.script.path, script.script.args) == ("script", "train.py", ["--x"])
    assert (lora.lora["r"], lora.training.epochs, lora.recovery.max_restarts) == (4, 3, 1)
    assert [j.id for j in store.list_jobs(parallelism="DILOCO")] == ["j0"]  # the store's query by mode


def submitted(**fields) -> SubmitSpec:
    return parse(SubmitJob, {**CODE, **fields}).spec


@pytest.mark.parametrize("flat", [spec for spec, _ in FLAT])
def test_a_flat_body_and_its_tree_make_the_same_spec(flat):
    flat = {k: v for k, v in flat.items() if k not in ("gpus_per_client",)}
    spec = submitted(**flat)
    assert parse(SubmitJob, {"spec": spec.model_dump(mode="json")}).spec == spec


def test_each_mode_holds_only_its_own_options():
    tree = {"code": CODE, "strategy": {"type": "ddp", "inner_steps": 5}}
    with pytest.raises(BadRequest) as err:
        parse(SubmitJob, {"spec": tree})
    assert err.value.field == "spec.strategy.ddp.inner_steps"
    with pytest.raises(BadRequest) as err:  # the flat body of an earlier SDK: named as it was sent
        parse(SubmitJob, {**CODE, "parallelism": "DDP", "diloco": {"inner_steps": 5}})
    assert err.value.field == "diloco" and "applies to parallelism DILOCO only, not DDP" in str(err.value)
    with pytest.raises(BadRequest) as err:
        parse(SubmitJob, {"spec": {"code": CODE, "strategy": {"type": "fsdp", "tp": {"size": 3}},
                                   "resources": {"world_size": 4}}})
    assert err.value.field == "spec.strategy.fsdp.tp.size" and "must divide world_size (4)" in str(err.value)


def test_the_rules_between_parts_resolve_once_at_submit():
    assert submitted(parallelism="TP", tp_size=2).resources == Resources(world_size=2, gpus_per_client=2)
    assert submitted(parallelism="DILOCO", world_size=4, diloco={"ranks_per_worker": 2}).resources.gpus_per_client == 2
    staged = submitted(parallelism="PIPELINE", pipeline={"schedule": "interleaved1f1b",
                                                         "stage_plan": [[0, 1], [1, 2], [2, 3], [3, 4]]})
    assert (staged.resources.world_size, staged.pipeline.stages_per_rank) == (2, 2)
    assert submitted().strategy == DDP() and submitted().training.seed is None
    with pytest.raises(BadRequest):  # the flat shape is frozen: a new option is the tree's only
        submitted(seed=7)


def test_a_jobs_seed_travels_to_its_ranks_and_seeds_them_alike():
    """``training.seed``: set in the tree only (no flat field, no SDK keyword of its own), it reaches
    every rank's spec through the assignment, and the rank seeds torch, random and numpy with it."""
    import random

    import numpy
    import torch

    from gpu_client.rank.runner import seed
    from zwdx.protocol.gpu import JobAssign
    spec = parse(SubmitJob, {"spec": {"code": CODE, "training": {"seed": 7}}}).spec
    stored = JobSpec.model_validate({**spec.model_dump(), "datasets": []})
    assign = JobAssign(job_id="j", spec=stored, ranks=[], world_size=1, master_addr="a", master_port=1,
                       backend="gloo", collective_timeout=1.0)
    assert JobAssign.model_validate_json(assign.model_dump_json()).spec.training.seed == 7

    def draws():
        return random.random(), float(numpy.random.rand()), float(torch.rand(1))
    torch.set_num_threads(1)
    seed(7)
    first = draws()
    seed(7)
    assert draws() == first
    seed(None)  # no seed: nothing reset
    assert draws() != first
