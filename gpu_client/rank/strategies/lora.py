"""LoRA jobs on a GPU client: the model in the bundle is a peft model (``zwdx/lora.py`` made it
at submit), whose base weights peft froze, so DDP and FSDP train and reduce only the adapter.
What comes back is the adapter alone: ``peft.get_peft_model_state_dict`` of the trained weights,
named as ``save_pretrained`` writes them; the fingerprint is over those tensors."""
from __future__ import annotations


def is_peft_model(model) -> bool:
    """Whether ``model`` is a peft model (FSDP makes a subclass of its class: still one)."""
    return any(cls.__module__.split(".")[0] == "peft" for cls in type(model).__mro__)


def returned_state(model, state: dict | None) -> dict | None:
    """What of the whole trained ``state`` goes back: a peft model's adapter, else all of it."""
    if state is None or not is_peft_model(model):
        return state
    from peft import get_peft_model_state_dict
    return {k: v for k, v in get_peft_model_state_dict(model, state_dict=state).items()}
