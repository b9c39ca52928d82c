"""LoRA jobs, in-process: the adapter's config checked at the edge and by the SDK before anything
is uploaded. The jobs themselves (GPT-2, DDP and FSDP on two GPU clients): test_models.py."""
from __future__ import annotations


import pytest

import models
import needs
from earlier_form import earlier_form
from zwdx import ZWDX
from zwdx.errors import BadRequest

LORA = {"peft_type": "LORA", "r": 4, "target_modules": ["c_attn"]}


def test_the_adapter_config_is_kept_with_the_job(api):
    assert api.submit(parallelism="DDP", lora=LORA).json["spec"]["strategy"]["lora"] == LORA
    assert api.submit(parallelism="FSDP").json["spec"]["strategy"]["lora"] is None


@pytest.mark.parametrize("fields", [
    {"parallelism": "PIPELINE", "lora": LORA}, {"parallelism": "DILOCO", "lora": LORA},
    {"parallelism": "DDP", "lora": {"r": 4}}, {"parallelism": "DDP", "lora": "LORA"},
    {"parallelism": "DDP", "lora": {**LORA, "padding": "x" * 70_000}}])
def test_a_bad_lora_is_a_400_naming_it_and_stores_nothing(api, fields):
    api.refused("lora", **fields)


def test_the_sdk_refuses_a_lora_that_does_not_fit_before_uploading_anything():
    needs.module("peft", "pip install peft (pip install -e '.[test]')")
    from peft import LoraConfig, get_peft_model
    sdk = ZWDX("http://127.0.0.1:9", room_token="zs_unused", remember=False)  # nothing listens: nothing is sent
    config = LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True)
    cases = [(models.gpt2(), {"r": 4}, "DDP", "must be a peft config"),
             (models.gpt2(), LoraConfig(r=4, target_modules=["no_such_layer"]), "DDP", "does not fit the model"),
             (get_peft_model(models.gpt2(), config), config, "DDP", "a peft model already"),
             (models.gpt2(), config, "PIPELINE", "DDP or FSDP")]
    with earlier_form():  # its errors name the earlier keywords
        for model, lora, parallelism, says in cases:
            with pytest.raises(BadRequest, match=says) as err:
                sdk.submit_job(model, models.lm_loaders, models.lm_train(models.hf_loss), parallelism=parallelism,
                               lora=lora)
            assert err.value.field == "lora"
