"""Host copies of a checkpoint's tensors, taken while training waits, written out after.

A checkpoint stalls training only for the copy of its tensors off the device: ``Staging``
copies them into one host block a dtype, kept from one checkpoint to the next (pinned when the tensors
are on a GPU, so the copies run asynchronously, together, at the link's speed; one
synchronisation at the end), and the files are written and uploaded from those copies in the
background (``checkpoint.py``). The block is made at the first checkpoint (pinning memory is
slow: about a second per few GB, paid once) and again only when the tensors' sizes change; it
is reused only once the previous checkpoint's background work is done with it.

    staging = Staging()
    copies = staging.copy([("model.w", tensor), ...])   # host copies, in the block
    tree = staging.tree(state)                          # a state's tree, every tensor copied
"""
from __future__ import annotations

import copy as copying

import torch

_ALIGN = 64  # bytes: each copy starts on a cache line


class Staging:
    def __init__(self):
        # One block a dtype: torch.save refuses views of one storage as different types (a
        # BatchNorm's int64 counter beside float weights).
        self._blocks: dict[torch.dtype, torch.Tensor] | None = None
        self._layout: list[tuple] = []  # (shape, dtype) of each copy, in order, the block is laid out for

    def copy(self, items: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Host copies of the tensors of ``items`` ((key, tensor) pairs), in the block; the copies
        off a GPU are complete when this returns."""
        tensors = [t.detach() for _, t in items]
        layout = [(tuple(t.shape), t.dtype) for t in tensors]
        cuda = [t.device for t in tensors if t.device.type == "cuda"]
        if layout != self._layout or self._blocks is None:
            self._make(layout, pin=bool(cuda))
        copies = self._views(layout)
        for target, source in zip(copies, tensors):
            target.copy_(source, non_blocking=source.device.type == "cuda")
        for device in set(cuda):
            torch.cuda.synchronize(device)
        return copies

    def tree(self, value) -> object:
        """``value`` with every tensor replaced by its host copy and every list, tuple and dict
        rebuilt (what training changes next cannot reach the copy); a tensor met twice (tied
        weights) is copied once. Other values are deep-copied."""
        found: dict[int, torch.Tensor] = {}
        self._collect(value, found)
        copies = dict(zip(found, self.copy([(str(i), t) for i, t in enumerate(found.values())])))
        return self._rebuild(value, copies)

    @property
    def nbytes(self) -> int:
        return 0 if self._blocks is None else sum(block.numel() for block in self._blocks.values())

    # -- the block ------------------------------------------------------------------------------
    def _make(self, layout: list[tuple], pin: bool) -> None:
        self._blocks = None  # the old ones go first
        totals: dict[torch.dtype, int] = {}
        for shape, dtype in layout:
            totals[dtype] = totals.get(dtype, 0) + _aligned(_nbytes(shape, dtype))
        self._blocks = {dtype: torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pin and torch.cuda.is_available())
                        for dtype, total in totals.items()}
        self._layout = layout

    def _views(self, layout: list[tuple]) -> list[torch.Tensor]:
        views, offsets = [], {}
        for shape, dtype in layout:
            size, offset = _nbytes(shape, dtype), offsets.get(dtype, 0)
            views.append(self._blocks[dtype][offset:offset + size].view(dtype).view(shape))
            offsets[dtype] = offset + _aligned(size)
        return views

    # -- trees ----------------------------------------------------------------------------------
    def _collect(self, value, found: dict) -> None:
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), value)
        elif isinstance(value, dict):
            for v in value.values():
                self._collect(v, found)
        elif isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            for v in value:
                self._collect(v, found)

    def _rebuild(self, value, copies: dict):
        if isinstance(value, torch.Tensor):
            return copies[id(value)]
        if isinstance(value, dict):
            out = {k: self._rebuild(v, copies) for k, v in value.items()}
            if type(value) is not dict:
                out = type(value)(out)  # an OrderedDict (a state_dict), with its _metadata
                if hasattr(value, "_metadata"):
                    out._metadata = copying.deepcopy(value._metadata)
            return out
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            return type(value)(self._rebuild(v, copies) for v in value)
        return copying.deepcopy(value)


def _nbytes(shape: tuple, dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty(0, dtype=dtype).element_size()


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN
