"""Host copies of a checkpoint's tensors, taken while training waits, written out after.

A checkpoint stalls training as little as the device allows:

- **A snapshot on the device** when it has room (``stage``): each tensor is cloned on its GPU,
  queued on the training stream (milliseconds, no synchronisation), and the copy to the host
  happens in the background on a stream of its own, while training goes on. The clones are
  freed once copied. Room means the driver's free memory holds the state with a margin: the
  memory the next steps' activations come back for is not counted.
- **Otherwise a copy to the host while training waits**, as ``copy`` does: the copies off a GPU
  run asynchronously, together, at the link's speed, with one synchronisation at the end.

Either way the host copies go into blocks kept from one checkpoint to the next, one block per
dtype (pinned when the tensors are on a GPU), and the files are written and uploaded from
those copies in the background (``checkpoint.py``). One block per dtype, not one for all:
``torch.save`` refuses tensors that view one storage as different types. The blocks are made at
the first checkpoint (in the background when there is a snapshot; pinned by registering
memory the process touched, which the rank's allocator setting asks for: the driver's own
pinned allocation holds every CUDA call of the training thread meanwhile, about 1.5 s per
GB) and again only when the tensors' sizes change; they are reused only once the previous
checkpoint's background work is done with them.

    staging = Staging()
    copies = staging.copy([("model.w", tensor), ...])   # host copies, in the block, now
    host = staging.stage([("model.w", tensor), ...])    # while training waits ...
    copies = host()                                     # ... and in the background
    host = staging.stage_tree(state)                    # a state's tree, every tensor staged
    tree = host()
"""
from __future__ import annotations

import copy as copying
from typing import Callable

import torch

_ALIGN = 64  # bytes: each copy starts on a cache line
_MARGIN = 512 << 20  # bytes of a GPU's free memory a snapshot leaves free


class Staging:
    def __init__(self):
        self._blocks: dict[torch.dtype, torch.Tensor] = {}
        self._layout: list[tuple] = []  # (shape, dtype) of each copy, in order, the blocks are laid out for

    def copy(self, items: list[tuple[str, torch.Tensor]], streams: dict | None = None) -> list[torch.Tensor]:
        """Host copies of the tensors of ``items`` ((key, tensor) pairs), in the block; the copies
        off a GPU are complete when this returns. With ``streams`` (device -> CUDA stream), the
        copies off each GPU run on its stream, and only that stream is waited for."""
        tensors = [t.detach() for _, t in items]
        layout = [(tuple(t.shape), t.dtype) for t in tensors]
        cuda = {t.device for t in tensors if t.device.type == "cuda"}
        if layout != self._layout or (layout and not self._blocks):
            self._make(layout, pin=bool(cuda))
        copies = self._views(layout)
        for target, source in zip(copies, tensors):
            if source.device.type == "cuda" and streams:
                with torch.cuda.stream(streams[source.device]):
                    target.copy_(source, non_blocking=True)
            else:
                target.copy_(source, non_blocking=source.device.type == "cuda")
        for device in cuda:
            if streams:
                streams[device].synchronize()
            else:
                torch.cuda.synchronize(device)
        return copies

    def stage(self, items: list[tuple[str, torch.Tensor]]) -> Callable[[], list[torch.Tensor]]:
        """While training waits: a snapshot of the tensors of ``items`` on their GPUs, when every
        GPU has room for it, else their host copies (``copy``). Returns a function, for the
        background, that gives the host copies (copied off the snapshot on streams of their own,
        the snapshot then freed); call it once, before the next ``stage`` or ``copy``."""
        _, finish = self._stage([t.detach() for _, t in items])
        return finish

    def stage_tree(self, value) -> Callable[[], object]:
        """``stage`` for a state's tree: returns a function, for the background, that gives
        ``value`` as it was at the time of this call, with every tensor replaced by its host copy
        and every list, tuple and dict rebuilt (what training changes next cannot reach it); a
        tensor met twice (tied weights) is copied once. Other values are deep-copied now."""
        found: dict[int, torch.Tensor] = {}
        self._collect(value, found)
        staged, finish = self._stage(list(found.values()))
        held = [self._rebuild(value, dict(zip(found, staged)))]  # non-tensor values copied now
        del staged

        found.clear()  # the state's own tensors: not held past this call

        def tree():
            skeleton = held.pop()  # the snapshot is freed once copied: nothing else holds it
            staged_now: dict[int, torch.Tensor] = {}
            self._collect(skeleton, staged_now)
            return self._rebuild(skeleton, dict(zip(staged_now, finish())))
        return tree

    def _stage(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], Callable[[], list[torch.Tensor]]]:
        """(what was taken while training waits: the snapshot or the host copies, a function that
        gives the host copies)."""
        if not self._room_for_snapshot(tensors):
            copies = self.copy([(str(i), t) for i, t in enumerate(tensors)])
            return copies, lambda: copies
        snapshot = [t.clone() for t in tensors]  # queued on the training streams, before what they do next
        marks = {}
        for t in snapshot:
            if t.device.type == "cuda" and t.device not in marks:
                marks[t.device] = torch.cuda.current_stream(t.device).record_event()

        def finish() -> list[torch.Tensor]:
            streams = {device: torch.cuda.Stream(device) for device in marks}
            for device, mark in marks.items():
                streams[device].wait_event(mark)
            try:
                return self.copy([(str(i), t) for i, t in enumerate(snapshot)], streams=streams)
            finally:
                snapshot.clear()  # the device memory goes back now, not with the closure
        return list(snapshot), finish

    @staticmethod
    def _room_for_snapshot(tensors: list[torch.Tensor]) -> bool:
        """Whether every GPU among ``tensors``' devices has the free memory (the driver's, beyond
        what the allocator keeps for the next steps) to hold a second copy of its tensors, plus
        a margin. No GPU tensors: no snapshot (host copies are as quick)."""
        need: dict[torch.device, int] = {}
        for t in tensors:
            if t.device.type == "cuda":
                need[t.device] = need.get(t.device, 0) + t.numel() * t.element_size()
        if not need:
            return False
        for device, n in need.items():
            free, _ = torch.cuda.mem_get_info(device)
            if n + _MARGIN > free:
                return False
        return True

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._blocks.values())

    # -- the blocks -----------------------------------------------------------------------------
    def _make(self, layout: list[tuple], pin: bool) -> None:
        self._blocks = {}  # the old ones go first
        totals: dict[torch.dtype, int] = {}
        for shape, dtype in layout:
            totals[dtype] = totals.get(dtype, 0) + _aligned(_numel(shape), dtype)
        pin = pin and torch.cuda.is_available()
        self._blocks = {dtype: torch.empty(max(n, 1), dtype=dtype, pin_memory=pin) for dtype, n in totals.items()}
        self._layout = layout

    def _views(self, layout: list[tuple]) -> list[torch.Tensor]:
        views, offsets = [], dict.fromkeys(self._blocks, 0)
        for shape, dtype in layout:
            n, at = _numel(shape), offsets[dtype]
            views.append(self._blocks[dtype][at:at + n].view(shape))
            offsets[dtype] = at + _aligned(n, dtype)
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


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _aligned(n: int, dtype: torch.dtype) -> int:
    """``n`` elements of ``dtype``, rounded up so that the next copy starts on a cache line."""
    per = max(_ALIGN // torch.empty(0, dtype=dtype).element_size(), 1)
    return -(-n // per) * per
