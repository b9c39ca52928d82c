"""The SDK's side of DILOCO's global weights held by the server (``zwdx.server.global_weights``):
at submit, the model's state_dict as it is goes to the server as a safetensors file, read there
by its header and never unpickled, and the job's ``diloco`` settings name it (``start_weights``).
The server steps its own global weights from it with every round's aggregate and returns those,
so the weights a submitter downloads are not one donor's word."""
from __future__ import annotations

import json


def parameter_keys(model) -> list[list[str]] | None:
    """Each parameter's state_dict keys, in ``model.parameters()`` order (a tied parameter's
    several names together); None when a parameter is not in the state_dict or not a float."""
    import torch
    names: dict[int, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        names.setdefault(id(value), []).append(key)
    groups = []
    for p in model.parameters():
        if id(p) not in names or p.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            return None
        groups.append(names[id(p)])
    return groups


def encode(model) -> bytes | None:
    """The start weights file: the state_dict's tensors, metadata ``parameters`` (``parameter_keys``)."""
    from safetensors.torch import save
    groups = parameter_keys(model)
    if groups is None:
        return None
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}
    return save(state, metadata={"parameters": json.dumps(groups)})


def upload(sdk, token: str, model, parallelism, diloco: dict | None) -> dict | None:
    """``diloco`` with ``start_weights`` naming the model's start weights uploaded to the room,
    for a DILOCO job; anything else unchanged (a model the server cannot read travels without)."""
    if str(parallelism).upper() != "DILOCO" or (diloco or {}).get("start_weights"):
        return diloco
    data = encode(model)
    if data is None:
        return diloco
    artifact = sdk._json("POST", "/diloco/start", token, data=data, timeout=max(sdk.timeout, 600),
                         headers={"Content-Type": "application/octet-stream"})
    return {**(diloco or {}), "start_weights": artifact["id"]}
