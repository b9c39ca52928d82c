"""Host copies of a checkpoint's tensors, taken while training waits, written out after.

A checkpoint stalls training only for the copy of its tensors off the device: ``Staging``
copies each into a host buffer kept from one checkpoint to the next (pinned when the tensor is
on a GPU, so the copies run asynchronously and together; one synchronisation at the end), and
the files are written and uploaded from those copies in the background (``checkpoint.py``).
The buffers are reused only once the previous checkpoint's background work is done with them.

    staging = Staging()
    copy = staging.tensor("model.w", tensor)     # one tensor, into the buffer kept under that key
    tree = staging.tree(state)                   # a state's tree, every tensor copied (keys: paths)
    staging.ready()                              # wait for the device's copies
"""
from __future__ import annotations

import copy as copying

import torch


class Staging:
    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}
        self._devices: set[torch.device] = set()

    def tensor(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor`` in the buffer kept under ``key`` (made, or made again when
        the shape or dtype changed). Call ``ready()`` before reading it."""
        tensor = tensor.detach()
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            pin = tensor.device.type == "cuda"
            buffer = self._buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
        if tensor.device.type == "cuda":
            buffer.copy_(tensor, non_blocking=True)
            self._devices.add(tensor.device)
        else:
            buffer.copy_(tensor)
        return buffer

    def tree(self, value, key: str = "", seen: dict | None = None):
        """``value`` with every tensor replaced by its host copy and every list, tuple and dict
        rebuilt (what training changes next cannot reach the copy); a tensor met twice (tied
        weights) is copied once. Other values are deep-copied."""
        seen = {} if seen is None else seen
        if isinstance(value, torch.Tensor):
            if id(value) not in seen:
                seen[id(value)] = self.tensor(key, value)
            return seen[id(value)]
        if isinstance(value, dict):
            out = {k: self.tree(v, f"{key}/{k}", seen) for k, v in value.items()}
            if type(value) is not dict:
                out = type(value)(out)  # an OrderedDict (a state_dict), with its _metadata
                if hasattr(value, "_metadata"):
                    out._metadata = copying.deepcopy(value._metadata)
            return out
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            return type(value)(self.tree(v, f"{key}/{i}", seen) for i, v in enumerate(value))
        return copying.deepcopy(value)

    def ready(self) -> None:
        """Wait for the copies off the GPU(s)."""
        for device in self._devices:
            torch.cuda.synchronize(device)
        self._devices.clear()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
