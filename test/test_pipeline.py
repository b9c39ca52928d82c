"""PIPELINE: the settings checked at the edge (in-process), and, with a server and two GPU clients
(CPU slots, gloo), a 4-block model cut into 2 stages by the automatic plan and by explicit ones:
the loss equals one process's over the same micro-batches (the split is exact), the returned
weights (every stage's, assembled) evaluate here to the loss the job reported, and each stage
writes its own checkpoint."""
from __future__ import annotations

import signal
import time

import pytest
import torch

import models
from procs import wait_until
from earlier_form import earlier_form
import zwdx
from zwdx import ZWDX
from zwdx.errors import BadRequest


# -- the settings, at the edge --------------------------------------------------------------------
def test_a_pipeline_job_takes_the_defaults_and_its_plan_sets_its_world_size(api):
    job = api.submit(parallelism="pipeline").json
    assert job["spec"]["parallelism"] == "PIPELINE"
    assert job["spec"]["strategy"] == {"type": "pipeline", "schedule": "gpipe", "microbatches": None, "stage_plan": None}
    job = api.submit(parallelism="PIPELINE", pipeline={"schedule": "1F1B", "microbatches": 4,
                                                        "stage_plan": [[0, 3], [3, 4]]}).json
    assert job["spec"]["strategy"] == {"type": "pipeline", "schedule": "1f1b", "microbatches": 4,
                                       "stage_plan": [[0, 3], [3, 4]]}
    assert job["spec"]["resources"]["world_size"] == 2
    assert api.submit(parallelism="DDP").json["spec"]["strategy"]["type"] == "ddp"
    # interleaved: several stages a rank, as the plan names them or 2
    job = api.submit(parallelism="PIPELINE", pipeline={"schedule": "interleaved1f1b",
                                                        "stage_plan": [[0, 1], [1, 2], [2, 3], [3, 4]]}).json
    assert job["spec"]["resources"]["world_size"] == 2 and job["spec"]["strategy"]["stages_per_rank"] == 2
    job = api.submit(parallelism="PIPELINE", world_size=3, pipeline={"schedule": "interleaved1f1b"}).json
    assert job["spec"]["strategy"] == {"type": "pipeline", "schedule": "interleaved1f1b", "microbatches": None, "stage_plan": None,
                                       "stages_per_rank": 2}


@pytest.mark.parametrize("fields, field", [
    ({"parallelism": "DDP", "pipeline": {}}, "pipeline"),
    ({"parallelism": "PIPELINE", "pipeline": {"schedule": "zigzag"}}, "pipeline.schedule"),
    ({"parallelism": "PIPELINE", "pipeline": {"microbatches": 0}}, "pipeline.microbatches"),
    ({"parallelism": "PIPELINE", "pipeline": {"stage_plan": [[0, 2], [3, 4]]}}, "pipeline.stage_plan"),
    ({"parallelism": "PIPELINE", "pipeline": {"stage_plan": [[1, 2]]}}, "pipeline.stage_plan"),
    ({"parallelism": "PIPELINE", "pipeline": {"stage_plan": ["h.2", "not a name"]}}, "pipeline.stage_plan"),
    ({"parallelism": "PIPELINE", "pipeline": {"stage_plan": "h.2"}}, "pipeline.stage_plan"),
    ({"parallelism": "PIPELINE", "world_size": 3, "pipeline": {"stage_plan": [[0, 2], [2, 4]]}}, "pipeline"),
    ({"parallelism": "PIPELINE", "world_size": 3, "pipeline": {"schedule": "1f1b", "microbatches": 2}}, "pipeline"),
    ({"parallelism": "PIPELINE", "world_size": 2, "min_world_size": 1}, "min_world_size"),
    ({"parallelism": "PIPELINE", "pipeline": {"stages": 2}}, "pipeline.stages"),
    ({"parallelism": "PIPELINE", "pipeline": {"stages_per_rank": 2}}, "pipeline"),
    ({"parallelism": "PIPELINE", "pipeline": {"schedule": "interleaved1f1b", "stages_per_rank": 1}}, "pipeline"),
    ({"parallelism": "PIPELINE", "pipeline": {"schedule": "interleaved1f1b", "stages_per_rank": 0}},
     "pipeline.stages_per_rank"),
    ({"parallelism": "PIPELINE", "world_size": 3, "pipeline": {"schedule": "interleaved1f1b",
                                                               "stage_plan": [[0, 1], [1, 2], [2, 3], [3, 4]]}},
     "pipeline"),
    ({"parallelism": "PIPELINE", "pipeline": {"schedule": "interleaved1f1b", "stages_per_rank": 3,
                                              "stage_plan": [[0, 1], [1, 2], [2, 3], [3, 4]]}}, "pipeline"),
    ({"parallelism": "PIPELINE", "world_size": 2, "pipeline": {"schedule": "interleaved1f1b", "microbatches": 5}},
     "pipeline")])
def test_bad_settings_are_a_400_naming_the_field_and_store_nothing(api, fields, field):
    api.refused(field, **fields)


def test_the_sdk_checks_the_plan_against_the_model_before_uploading_anything():
    sdk = ZWDX("http://127.0.0.1:9", room_token="zs_unused", remember=False)  # nothing listens: nothing is sent
    with earlier_form():  # its errors name the earlier keywords
        for plan, says in [([[0, 2], [2, 3]], "the model has 4 repeated blocks"), (["h.9"], "no module 'h.9'")]:
            with pytest.raises(BadRequest, match=says) as err:
                sdk.submit_job(models.stage_lm(), models.pipe_loaders, models.pipe_train, parallelism="PIPELINE",
                               pipeline={"stage_plan": plan})
            assert err.value.field == "pipeline.stage_plan"
        with pytest.raises(BadRequest) as err:
            sdk.submit_job(models.stage_lm(), models.pipe_loaders, models.pipe_train, parallelism="PIPELINE",
                           pipeline={"schedule": "interleaved"})
        assert err.value.field == "pipeline.schedule"


def test_the_automatic_cut_follows_each_stages_free_memory_with_a_block_at_least():
    from gpu_client.rank.strategies.pipeline import weighted_ranges
    assert weighted_ranges(4, [1, 1]) == [[0, 2], [2, 4]]  # CPU slots: even
    assert weighted_ranges(5, [1, 1]) == [[0, 3], [3, 5]]
    gib = 2**30
    assert weighted_ranges(12, [24 * gib, 80 * gib]) == [[0, 3], [3, 12]]
    assert weighted_ranges(8, [80 * gib, 1 * gib]) == [[0, 7], [7, 8]]  # never an empty stage
    assert weighted_ranges(3, [1, 5, 1]) == [[0, 1], [1, 2], [2, 3]]
    with pytest.raises(ValueError, match="2 repeated block"):
        weighted_ranges(2, [1, 1, 1])


def test_the_automatic_cut_gives_a_faster_gpu_more_blocks_as_far_as_its_memory_holds_them():
    from gpu_client.rank.strategies.pipeline import BLOCK_FOOTPRINT, speed_shares, weighted_ranges
    gib, block = 2**30, 2**20  # a block of 1 MiB of parameters takes 6 MiB on its GPU
    assert weighted_ranges(12, speed_shares(12, [80 * gib, 80 * gib], [2e14, 1e14], block)) == [[0, 8], [8, 12]]
    # equal speeds: equal runs, a smaller card as well, while its blocks fit it
    assert weighted_ranges(12, speed_shares(12, [24 * gib, 80 * gib], [1e14, 1e14], block)) == [[0, 6], [6, 12]]
    # the faster card holds only 4 blocks: it gets 4, the other the rest
    small = 4 * block * BLOCK_FOOTPRINT
    assert speed_shares(12, [small, 80 * gib], [3e14, 1e14], block) == [4, 8]
    assert weighted_ranges(12, speed_shares(12, [small, 80 * gib], [3e14, 1e14], block)) == [[0, 4], [4, 12]]
    # the blocks fit nowhere that way: by free memory, as before speed was measured
    assert speed_shares(12, [small, small], [3e14, 1e14], block) == [small, small]


# -- jobs ------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("pipeline, says", [
    (None, "PIPELINE: 2 stages over 4 blocks: h.0..h.1, h.2..h.3; 2 micro-batches of 8, schedule gpipe"),
    ({"stage_plan": [(0, 1), (1, 4)], "schedule": "1f1b", "microbatches": 4},
     "PIPELINE: 2 stages over 4 blocks: h.0..h.0, h.1..h.3; 4 micro-batches of 4, schedule 1f1b"),
    ({"stage_plan": ["h.3"]}, "PIPELINE: 2 stages, beginning at the root, h.3; 2 micro-batches of 8"),
    ({"stage_plan": [(0, 1), (1, 2), (2, 3), (3, 4)], "schedule": "interleaved1f1b", "microbatches": 4},
     "PIPELINE: 4 stages over 4 blocks: h.0..h.0, h.1..h.1, h.2..h.2, h.3..h.3; 4 micro-batches of 4, schedule "
     "interleaved1f1b (2 stages a rank, rank r runs r, r + 2, ...)")])
def test_two_stages_on_two_gpu_clients_train_as_one_process_would(cluster, pipeline, says):
    epochs, microbatches = 2, (pipeline or {}).get("microbatches", 2)
    model = models.stage_lm()
    started = time.time()
    result = cluster.sdk.submit_job(model, models.pipe_loaders, models.pipe_train, models.pipe_eval,
                                 torch.optim.AdamW(model.parameters(), lr=3e-3), "PIPELINE",
                                    strategy=zwdx.Pipeline(**(pipeline or {})), resources=zwdx.Resources(world_size=2),
                                    training=zwdx.Training(epochs=epochs), run=zwdx.Run(progress=False, timeout=300))
    print(f"\npipeline {pipeline}: {time.time() - started:.1f} s, eval loss {result['results']['eval_loss']:.4f}")
    assert result["status"] == "completed", result
    job_id = result["job_id"]
    job = cluster.sdk.get_job(job_id)
    assert {p["client_id"] for p in job["placement"]} == {"client-a", "client-b"}  # a stage on each
    logs = [line["text"] for line in cluster.sdk.get_job_logs(job_id)]
    assert any(says in t for t in logs), logs

    # the split is exact: each step's loss, the last stage's, is one process's over the same micro-batches
    alone, losses = models.pipe_alone(epochs, microbatches)
    series = cluster.sdk.get_job_metrics(job_id)["loss"]
    assert [p["value"] for p in series if p["rank"] == 0] == pytest.approx(losses, rel=1e-4)
    assert [p["value"] for p in series if p["rank"] == 1] == pytest.approx(losses, rel=1e-4)
    assert result["results"]["final_loss"] == pytest.approx(losses[-1], rel=1e-4)

    # the weights come back whole, every stage's, and evaluate here to what the job reported
    trained = cluster.sdk.get_trained_model(job_id, models.stage_lm(seed=1))
    reported = result["results"]["eval_loss"]
    assert models.pipe_local_eval_loss(trained) == pytest.approx(reported, rel=1e-4)
    assert models.pipe_local_eval_loss(alone) == pytest.approx(reported, rel=1e-3)
    assert reported < models.pipe_local_eval_loss(models.stage_lm())  # it learned

    # each stage said what it holds (the job's page draws it): the first the embeddings, the last the head
    layouts = [job["ranks"][str(i)]["layout"] for i in range(2)]
    interleaved = (pipeline or {}).get("schedule") == "interleaved1f1b"
    assert [(lay["role"], lay["stage"]) for lay in layouts] == ([
        ("stage", {"index": i, "of": 4, "virtual": [i, i + 2]}) for i in range(2)] if interleaved else [
        ("stage", {"index": i, "of": 2}) for i in range(2)])
    assert layouts[0]["modules"][:2] == ["wte", "wpe"] and layouts[1]["modules"][-2:] == ["ln_f", "head"]
    assert layouts[0]["text"].startswith("stages 0, 2 of 4: wte, wpe, h.0, h.2" if interleaved else
                                         "stage 0 of 2: wte, wpe, h.0")
    assert sum(lay["params"] for lay in layouts) == sum(p.numel() for p in model.parameters())

    # a checkpoint per epoch, each stage's state in its own file
    checkpoint = job["latest_checkpoint"]
    assert checkpoint["format"] == "stages"
    assert {"stage-0.pt", "stage-1.pt", "rng-0.pt", "rng-1.pt"} <= set(checkpoint["files"])


@pytest.mark.slow
def test_a_pipeline_whose_gpu_client_is_lost_resumes_from_its_stages_checkpoint(sdk, room, start_client):
    clients = start_client.together("a", "b", "c")  # two stages and a spare
    epochs, microbatches = 3, 2
    model = models.stage_lm()
    job_id = sdk.submit_job(model, models.pipe_loaders, models.pipe_train_then_wait, models.pipe_eval,
                            torch.optim.AdamW(model.parameters(), lr=3e-3), "PIPELINE",
                            resources=zwdx.Resources(world_size=2), training=zwdx.Training(epochs=epochs),
                            run=zwdx.Run(room_token=room["token"], progress=False), wait=False)
    job = wait_until(lambda: (j := sdk.get_job(job_id)).get("latest_checkpoint") and j, 120, what="epoch 0's checkpoint")
    saved = job["latest_checkpoint"]
    assert (saved["format"], saved["epoch"], saved["step"]) == ("stages", 0, 8), saved
    victim = next(c for c in clients if c.client_id == next(p["client_id"] for p in job["placement"] if p["rank"] == 0))
    victim.kill(signal.SIGKILL)

    result = sdk.wait(job_id, progress=False, timeout=300)
    assert result["status"] == "completed", result.get("reason")
    job = sdk.get_job(job_id)
    assert job["restarts"] == 1 and victim.client_id not in {p["client_id"] for p in job["placement"]}
    assert job["restart_history"][0]["from_checkpoint"]["n"] == saved["n"]
    logs = [line["text"] for line in sdk.get_job_logs(job_id)]
    assert any(f"resumed from checkpoint {saved['n']} (epoch 0, step 8)" in t for t in logs), logs

    # the losses go on from the checkpoint's step as if nothing happened: one process's, step for step
    _, losses = models.pipe_alone(epochs, microbatches)
    series = [p for p in sdk.get_job_metrics(job_id)["loss"] if p["rank"] == 1]  # the last stage's
    assert [p["step"] for p in series] == list(range(len(losses)))
    assert [p["value"] for p in series] == pytest.approx(losses, rel=1e-4)

    # the weights come back whole and evaluate here to what the job reported
    trained = sdk.get_trained_model(job_id, models.stage_lm(seed=1))
    assert models.pipe_local_eval_loss(trained) == pytest.approx(result["results"]["eval_loss"], rel=1e-4)
