"""Ordinary language models trained with DDP and FSDP on two GPU clients (CPU slots, gloo): a
Hugging Face GPT-2 and a model in nanoGPT's shape (ModuleDict of blocks, tied embeddings, two
param groups), both unchanged. What comes back evaluates locally to the loss the job reported,
with its tied weights still tied; FSDP really shards; BatchNorm buffers come back as rank 0's;
a sharded checkpoint carries an FSDP job over a lost GPU client; LoRA (peft) on the GPT-2 trains
and brings back the adapter alone.

The module's jobs share one server and two GPU clients (each process start imports torch)."""
from __future__ import annotations

import math
import signal
import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import models
import needs
from digests import state_digest as fingerprint
from gpu_client.rank.strategies.parallel import describe_plan, fsdp_plan
from procs import GpuClient, Server, wait_until
from earlier_form import earlier_form
import zwdx
from zwdx import ZWDX, BadRequest

pytestmark = pytest.mark.slow  # a server, GPU clients and language-model jobs

LM = {"gpt2": (models.gpt2, models.hf_loss), "nanogpt": (models.nanogpt, models.nano_loss)}


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    base = tmp_path_factory.mktemp("models")
    server = Server(str(base / "server"))
    sdk = ZWDX(server.url)
    made = sdk.create_room("models")
    sdk.room_token = made["token"]
    clients: list[GpuClient] = []

    def online(*names: str) -> None:
        wait_until(lambda: {f"client-{n}" for n in names} <= {c["id"] for c in sdk.get_room()["clients"]
                                                               if c["status"] == "online"},
                   60, what=f"gpu clients {names} online")

    def start(name: str, wait: bool = True) -> GpuClient:
        client = GpuClient(server.url, made["donor_token"], str(base / name), client_id=f"client-{name}")
        clients.append(client)
        if wait:
            online(name)
        return client

    try:
        start("a", wait=False)  # the two start at once (a start is mostly imports and registering)
        start("b", wait=False)
        online("a", "b")
        yield SimpleNamespace(sdk=sdk, clients=clients, start=start)
    finally:
        GpuClient.stop_all(clients)
        server.stop()


def make(kind: str, seed: int = 0):
    if kind == "gpt2":
        needs.module("transformers", "pip install transformers (pip install -e '.[test]')")
    return LM[kind][0](seed)


def optimizer_for(model):
    if isinstance(model, models.GPT):
        return model.configure_optimizers()  # decay and no-decay groups, as nanoGPT builds them
    return torch.optim.AdamW(model.parameters(), lr=3e-3)


def per_rank(series: list[dict]) -> dict[int, float]:
    return {p["rank"]: p["value"] for p in series}


def check_returned(pool, job_id: str, kind: str, reported: float):
    """The weights that came back: loaded strictly into a fresh model (other seed), its tied
    weights still tied, equal on every rank, and evaluating here to what the job reported."""
    trained = pool.sdk.get_trained_model(job_id, make(kind, seed=1))
    assert models.tied(trained)
    ranks = pool.sdk.get_job(job_id)["ranks"]
    assert {r["fingerprint"] for r in ranks.values()} == {fingerprint(trained.state_dict())}, ranks
    assert models.local_eval_loss(trained, LM[kind][1]) == pytest.approx(reported, rel=1e-4)
    return trained


# -- the rule, in process --------------------------------------------------------------------------
def test_the_automatic_rule_shards_each_repeated_block_and_keeps_tied_weights_together():
    chosen, skipped = fsdp_plan(make("nanogpt"))
    assert [name for name, _ in chosen] == ["transformer.h.0", "transformer.h.1"] and not skipped
    chosen, skipped = fsdp_plan(make("gpt2"))
    assert [name for name, _ in chosen] == ["transformer.h.0", "transformer.h.1"] and not skipped
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), num_layers=3)
    assert [name for name, _ in fsdp_plan(encoder)[0]] == ["layers.0", "layers.1", "layers.2"]
    assert fsdp_plan(models.bn_model()) == ([], [])  # no repeated block: the root alone

    model = make("nanogpt")
    chosen, skipped = fsdp_plan(model, lambda m: isinstance(m, (nn.Embedding, nn.ModuleList, models.MLP)))
    assert [name for name, _ in chosen] == ["transformer.wpe", "transformer.h.0.mlp", "transformer.h.1.mlp"]
    assert skipped == [("transformer.wte", "shares a parameter with lm_head.weight"),
                       ("transformer.h", "ModuleList has no forward")]
    assert describe_plan(model, chosen, skipped).startswith(
        "FSDP units: 1 x Embedding (transformer.wpe), 2 x MLP (transformer.h.0.mlp, transformer.h.1.mlp), "
        "then the root GPT; left to the enclosing unit: transformer.wte (shares a parameter with lm_head.weight)")


def test_bad_fsdp_units_are_refused_at_submit_naming_the_field(pool):
    before = len(pool.sdk.list_jobs())
    cases = [("DDP", [models.Block], "FSDP and FSDP+TP only"), ("FSDP", "Block", "got str"),
             ("FSDP", [models.Block, "MLP"], "'MLP' is not a module class"),
             ("FSDP", [nn.Conv2d], "no module of class Conv2d")]
    with earlier_form():  # its errors name the earlier keywords
        for parallelism, units, says in cases:
            model = make("nanogpt")
            with pytest.raises(BadRequest) as err:
                pool.sdk.submit_job(model=model, data_loader_func=models.lm_loaders, train_func=models.lm_train(
                    models.nano_loss), parallelism=parallelism, fsdp_units=units, progress=False)
            assert err.value.field == "fsdp_units" and says in str(err.value), (units, str(err.value))
        assert len(pool.sdk.list_jobs()) == before  # nothing stored


# -- jobs ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("parallelism", ["DDP", "FSDP"])
@pytest.mark.parametrize("kind", ["gpt2", "nanogpt"])
def test_language_model_trains_and_comes_back_as_it_evaluated(pool, kind, parallelism):
    model = make(kind)
    loss_fn = LM[kind][1]
    started = time.time()
    result = pool.sdk.submit_job(model=model, data_loader_func=models.lm_loaders, train_func=models.lm_train(loss_fn),
                                 eval_func=models.lm_eval(loss_fn), optimizer=optimizer_for(model),
                                 parallelism=parallelism, resources=zwdx.Resources(world_size=2),
                                 training=zwdx.Training(epochs=2), run=zwdx.Run(progress=False, timeout=300))
    print(f"\n{kind} {parallelism}: {time.time() - started:.1f} s, eval loss {result['results']['eval_loss']:.4f}")
    assert result["status"] == "completed" and result["world_size"] == 2
    assert result["warnings"] == [] and result["suspects"] == [], result  # tied weights: the upload is what ranks hold
    reported = result["results"]["eval_loss"]
    assert reported < 0.8 * math.log(models.VOCAB)  # it learned something
    check_returned(pool, result["job_id"], kind, reported)

    series = pool.sdk.get_job_metrics(result["job_id"])
    total = sum(p.numel() for p in model.parameters())  # a tied weight counted once
    assert per_rank(series["total_params"]) == {0: total, 1: total}
    groups = len(optimizer_for(model).param_groups)  # nanoGPT's decay and no-decay groups, rebuilt on each rank
    assert per_rank(series["param_groups"]) == {0: groups, 1: groups} and groups == (2 if kind == "nanogpt" else 1)
    local = per_rank(series["local_params"])
    if parallelism == "FSDP":  # each rank holds its shard of every parameter, not a replica
        assert sum(local.values()) == total and max(local.values()) < 0.55 * total, (local, total)
        logs = [line["text"] for line in pool.sdk.get_job_logs(result["job_id"])]
        cls = "GPT2Block" if kind == "gpt2" else "Block"
        assert any(f"FSDP units: 2 x {cls} (transformer.h.0, transformer.h.1), then the root" in t for t in logs), logs
    else:
        assert local == {0: total, 1: total}


def test_fsdp_units_given_as_a_function(pool):
    model = make("nanogpt")
    result = pool.sdk.submit_job(model=model, data_loader_func=models.lm_loaders,
                                 train_func=models.lm_train(models.nano_loss),
                                 eval_func=models.lm_eval(models.nano_loss),
                                 optimizer=optimizer_for(model), parallelism="FSDP",
                                 strategy=zwdx.FSDP(units=lambda m: isinstance(m, (models.MLP, nn.Embedding))),
                                 resources=zwdx.Resources(world_size=2), training=zwdx.Training(epochs=1),
                                 run=zwdx.Run(progress=False, timeout=300))
    assert result["status"] == "completed"
    check_returned(pool, result["job_id"], "nanogpt", result["results"]["eval_loss"])
    logs = [line["text"] for line in pool.sdk.get_job_logs(result["job_id"])]
    assert any("FSDP units: 1 x Embedding (transformer.wpe), 2 x MLP (transformer.h.0.mlp, transformer.h.1.mlp), "
               "then the root GPT; left to the enclosing unit: transformer.wte (shares a parameter with "
               "lm_head.weight)" in t for t in logs), logs


@pytest.mark.parametrize("parallelism", ["DDP", "FSDP"])
def test_batchnorm_buffers_come_back_as_rank_0s(pool, parallelism):
    model = models.bn_model()
    result = pool.sdk.submit_job(model=model, data_loader_func=models.bn_loaders, train_func=models.bn_train,
                                 eval_func=models.bn_eval, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                 parallelism=parallelism, resources=zwdx.Resources(world_size=2),
                                 training=zwdx.Training(epochs=2), run=zwdx.Run(progress=False, timeout=300))
    assert result["status"] == "completed"
    trained = pool.sdk.get_trained_model(result["job_id"], models.bn_model(seed=1))
    ranks = pool.sdk.get_job(result["job_id"])["ranks"]
    assert {r["fingerprint"] for r in ranks.values()} == {fingerprint(trained.state_dict())}, ranks
    before_sync = per_rank(pool.sdk.get_job_metrics(result["job_id"])["running_mean"])
    assert abs(before_sync[0] - before_sync[1]) > 1e-3  # the ranks' statistics did differ
    assert trained[1].running_mean.sum().item() == pytest.approx(before_sync[0], abs=1e-5)
    # eval_func ran after the ranks took rank 0's buffers: it saw the model that came back
    assert models.bn_local_eval_loss(trained) == pytest.approx(result["results"]["eval_loss"], rel=1e-4)


def test_fsdp_job_goes_on_from_a_sharded_checkpoint_after_a_lost_gpu_client(pool):
    model = make("nanogpt")
    sdk = pool.sdk
    job_id = sdk.submit_job(model=model, data_loader_func=models.lm_loaders,
                            train_func=models.lm_train(models.nano_loss, pause=0.3),
                            eval_func=models.lm_eval(models.nano_loss), optimizer=optimizer_for(model),
                            parallelism="FSDP", resources=zwdx.Resources(world_size=2),
                            training=zwdx.Training(epochs=4), run=zwdx.Run(recovery=zwdx.Recovery(min_world_size=1)),
                            wait=False)
    job = wait_until(lambda: (j := sdk.get_job(job_id)).get("latest_checkpoint") and j, 120, what="a checkpoint")
    assert job["latest_checkpoint"]["format"] == "shards" and job["status"] == "running", job
    victim = next(c for c in pool.clients if c.client_id == job["placement"][1]["client_id"])
    victim.kill(signal.SIGKILL)
    try:
        result = sdk.wait(job_id, progress=False, timeout=300)
        assert result["status"] == "completed", result["reason"]
        job = sdk.get_job(job_id)
        assert job["restarts"] == 1 and job["world_size"] == 1, job["restart_history"]
        checkpoint = job["restart_history"][0]["from_checkpoint"]
        assert checkpoint["format"] == "shards" and checkpoint["world_size"] == 2
        series = sdk.get_job_metrics(job_id)
        # the model restored on one rank from the two ranks' shards is the one checkpointed
        saved = series[f"probe_loss_epoch_{checkpoint['epoch']}"][0]["value"]
        restored = series["probe_loss_resumed"]
        assert len(restored) == 1 and restored[0]["value"] == pytest.approx(saved, rel=1e-6)
        assert min(p["value"] for p in series["epoch"] if p["ts"] > restored[0]["ts"]) == checkpoint["epoch"] + 1
        check_returned(pool, job_id, "nanogpt", result["results"]["eval_loss"])
    finally:
        victim.stop()
        pool.start(victim.client_id.removeprefix("client-") + "2")


# -- LoRA ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("parallelism", ["DDP", "FSDP"])
def test_lora_trains_only_the_adapter_and_brings_back_the_adapter_alone(pool, parallelism):
    needs.module("peft", "pip install peft (pip install -e '.[test]')")
    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
    model = make("gpt2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = pool.sdk.submit_job(model=model, data_loader_func=models.lm_loaders,
                                 train_func=models.lm_train(models.hf_loss), eval_func=models.lm_eval(models.hf_loss),
                                 optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                 strategy=getattr(zwdx, parallelism)(lora=config), resources=zwdx.Resources(world_size=2),
                                 training=zwdx.Training(epochs=2), run=zwdx.Run(progress=False, timeout=300))
    assert result["status"] == "completed" and result["warnings"] == [] and result["suspects"] == [], result
    job_id, reported = result["job_id"], result["results"]["eval_loss"]
    assert not isinstance(model, PeftModel) and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert pool.sdk.get_job(job_id)["spec"]["strategy"]["lora"]["target_modules"] == ["c_attn"]

    # only the adapter came back, and it trained (lora_B starts at zero)
    adapter = pool.sdk.get_adapter(job_id)
    assert set(adapter) == set(get_peft_model_state_dict(get_peft_model(make("gpt2"), config)))
    assert all(".lora_A." in k or ".lora_B." in k for k in adapter)
    assert all(v.abs().sum() > 0 for k, v in adapter.items() if ".lora_B." in k)
    ranks = pool.sdk.get_job(job_id)["ranks"]
    assert {r["fingerprint"] for r in ranks.values()} == {fingerprint(adapter)}, ranks

    # the adapter on the untouched base model evaluates here to what the job reported: the ranks'
    # base weights did not move
    trained = pool.sdk.get_trained_model(job_id, make("gpt2"))
    assert isinstance(trained, PeftModel)
    assert models.local_eval_loss(trained, models.hf_loss) == pytest.approx(reported, rel=1e-4)
    assert reported < models.local_eval_loss(make("gpt2"), models.hf_loss) - 0.05  # the adapter learned
