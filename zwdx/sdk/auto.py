"""What an AUTO job's replica needs, counted on the submitter's side (``zwdx.server.auto`` decides
with it): the parameters' bytes, and those plus the gradients' and the optimizer state's."""
from __future__ import annotations

#: Optimizer state per trainable parameter, in parameters' worth, by class name (Adam's two
#: moments); SGD keeps one buffer with momentum, none without; an optimizer not named is counted as Adam.
_STATE = {"Adagrad": 1, "RMSprop": 1, "Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2}


def counted(strategy: dict, model, optimizer) -> dict:
    """``strategy`` (an AUTO strategy as JSON) with ``parameter_bytes`` and ``state_bytes`` counted
    from ``model`` and ``optimizer`` where the submitter left them 0."""
    params = list(model.parameters())
    total = sum(p.numel() * p.element_size() for p in params)
    trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    name = type(optimizer).__name__ if optimizer is not None else "Adam"
    per = int(any(g.get("momentum") for g in optimizer.param_groups)) if name == "SGD" else _STATE.get(name, 2)
    return {**strategy, "parameter_bytes": strategy.get("parameter_bytes") or total,
            "state_bytes": strategy.get("state_bytes") or total + trainable + per * trainable}
