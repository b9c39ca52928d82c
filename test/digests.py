"""The tests' own digest of weights, written apart from the product's (``gpu_client.rank.strategies.parallel.
fingerprint``), so that a test comparing the two would notice if the product's changed: sha256
over the tensors in name order, each its name's bytes, then its values' bytes as stored."""
from __future__ import annotations

import hashlib

import torch


def _raw(tensor: torch.Tensor) -> bytes:
    tensor = tensor.detach().cpu().contiguous()
    if not tensor.numel():
        return b""
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits as int16
        tensor = tensor.view(torch.int16)
    return tensor.numpy().tobytes()


def state_digest(state: dict) -> str:
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode())
        digest.update(_raw(state[name]))
    return digest.hexdigest()


def weights_digest(blob: bytes) -> str:
    """``state_digest`` of a safetensors file's tensors."""
    from safetensors.torch import load
    return state_digest(load(blob))
