"""LoRA fine-tuning jobs with ``peft``, on the SDK's side.

``submit_job(..., lora=LoraConfig(...))`` wraps a copy of the model with ``peft.get_peft_model``
before it is packed (the submitter's model is left as it was); a peft model given as ``model``
goes as it is. Either way the adapter's config travels in the job's spec as JSON
(``SubmitJob.lora``, what ``adapter_config.json`` holds), so that ``get_trained_model`` can put
the same adapter on a plain model later, in any process, without the bundle.

On the GPU clients only the adapter trains (peft freezes the base weights) and only the adapter
comes back: rank 0 uploads ``peft.get_peft_model_state_dict`` of the trained model
(``gpu_client/rank/strategies/lora.py``), names as ``save_pretrained`` writes them.
"""
from __future__ import annotations

import copy
import enum
import json

from .defaults import MAX_LORA_CONFIG_BYTES as MAX_CONFIG_BYTES
from .errors import BadRequest


def _peft(field: str = "lora"):
    try:
        import peft
    except ImportError:
        raise BadRequest("LoRA jobs need the peft package here: pip install peft", field=field) from None
    return peft


def is_peft_model(model) -> bool:
    """Whether ``model`` is a peft model (without importing peft when the model is not one)."""
    return any(cls.__module__.split(".")[0] == "peft" for cls in type(model).__mro__)


def prepare(model, lora):
    """``(model, config)``: the model to pack (a peft model) and its adapter's config as JSON;
    ``(model, None)`` for a job without LoRA."""
    if lora is None and not is_peft_model(model):
        return model, None
    peft = _peft()
    if lora is not None:
        if not isinstance(lora, peft.PeftConfig):
            raise BadRequest(f"lora must be a peft config (peft.LoraConfig), got {type(lora).__name__}", field="lora")
        if is_peft_model(model):
            raise BadRequest("lora: the model is a peft model already; give it alone, or lora with the base model",
                             field="lora")
        try:
            model = peft.get_peft_model(copy.deepcopy(model), copy.deepcopy(lora))
        except (ValueError, TypeError, AttributeError) as exc:
            raise BadRequest(f"lora does not fit the model: {exc}", field="lora") from None
    if list(model.peft_config) != ["default"]:
        raise BadRequest(f"model: a peft model with one adapter named 'default' is supported, it has "
                         f"{sorted(model.peft_config)}", field="model")
    return model, config_json(model.peft_config["default"])


def config_json(config) -> dict:
    """A peft config as plain JSON (sets as sorted lists, enums as their values)."""
    def plain(value):
        if isinstance(value, (set, frozenset)):
            return sorted(value)
        if isinstance(value, enum.Enum):
            return value.value
        raise TypeError(f"{type(value).__name__} is not JSON")
    try:
        text = json.dumps(config.to_dict(), default=plain)
    except TypeError as exc:
        raise BadRequest(f"lora: its config cannot travel as JSON: {exc}", field="lora") from None
    if len(text) > MAX_CONFIG_BYTES:
        raise BadRequest(f"lora: its config takes {len(text)} bytes as JSON, more than {MAX_CONFIG_BYTES}", field="lora")
    return json.loads(text)


def load_adapter(model, config: dict, state: dict):
    """``model`` (a plain model or a peft model) with the job's adapter ``state`` loaded: a peft
    model. Every adapter tensor must find its place, and every place a tensor."""
    peft = _peft("model")
    if not is_peft_model(model):
        model = peft.get_peft_model(model, peft.PeftConfig.from_peft_type(**config))
    expected = set(peft.get_peft_model_state_dict(model))
    if set(state) != expected:
        extra, missing = sorted(set(state) - expected), sorted(expected - set(state))
        raise BadRequest(f"model: the job's adapter does not fit it (unexpected {extra[:3]}, missing {missing[:3]})",
                         field="model")
    peft.set_peft_model_state_dict(model, state)
    return model


__all__ = ["prepare", "load_adapter", "config_json", "is_peft_model", "MAX_CONFIG_BYTES"]
