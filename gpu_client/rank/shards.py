"""zwdx's sharded checkpoint (FSDP): each rank writes what it holds; no pickle anywhere.

    shard-<rank>.safetensors   the rank's tensors: the local shard of every DTensor (parameters,
                               optimizer states), every plain tensor (a step count, a buffer, a
                               generator's state)
    shard-<rank>.json          its index: the state's tree (dicts, lists, tuples, numbers,
                               strings), each tensor by its key in the .safetensors; a DTensor's
                               shard with the whole tensor's shape and dtype, and the offsets and
                               shape of this shard in it

Restoring a rank of the same or of another world size (resharding, as
``torch.distributed.checkpoint`` does) reads every rank's index, then from the .safetensors only
the slices that overlap the shards this rank holds now (``Reader``): a DTensor of the state it
restores into says which. Plain values come from this rank's own tree where the checkpoint has
the rank, else from rank 0's. Everything read is checked against the index, and the index
against the state it restores into: a file that does not fit is a ``ValueError``, and nothing
in it can be code (JSON and safetensors hold data only).
"""
from __future__ import annotations

import json
import math
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

#: The index's ``format``.
FORMAT = "zwdx-shards-1"

_KEYS = (str, int, bool, type(None))  # the keys a dict of the tree may have
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def file_names(rank: int) -> tuple[str, str]:
    """Rank ``rank``'s tensors and its index (``zwdx.protocol.checkpoint.shard_files``)."""
    return f"shard-{rank}.safetensors", f"shard-{rank}.json"


def _dtensor_class():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without torch.distributed
        return ()
    return DTensor


def _local_box(tensor) -> tuple[list[int], list[int]]:
    """A DTensor's local shard: its shape and its offsets in the whole tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return list(shape), list(offset)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- writing ------------------------------------------------------------------------------------
def save(state: dict, folder: str, rank: int, world_size: int) -> list[str]:
    """Write rank ``rank``'s part of ``state`` into ``folder``; the names of the files written."""
    return write(encode(state, rank, world_size), folder)


def encode(state: dict, rank: int, world_size: int, stage=None) -> dict:
    """Rank ``rank``'s part of ``state``, its tensors on the host: ``stage(key, tensor)`` gives
    each one's host copy (``staging.Staging.stage``; a fresh copy when None). ``write`` it."""
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}  # one tensor under two names (tied weights) is written once
    tree = _encode(state, tensors, seen, "state", stage=stage)
    return {"rank": rank, "tensors": tensors,
            "index": {"format": FORMAT, "rank": rank, "world_size": world_size, "tree": tree}}


def write(encoded: dict, folder: str) -> list[str]:
    """The files of an ``encode``d part into ``folder``; their names."""
    data_name, index_name = file_names(encoded["rank"])
    save_file(encoded["tensors"], os.path.join(folder, data_name))
    with open(os.path.join(folder, index_name), "w", encoding="utf-8") as fh:
        json.dump(encoded["index"], fh, allow_nan=False)
    return [data_name, index_name]


def check(value, where: str) -> None:
    """``TypeError`` naming the first part of ``value`` that a checkpoint cannot hold."""
    _encode(value, {}, {}, where, copy=False)


def _encode(value, tensors: dict, seen: dict, where: str, copy: bool = True, stage=None):
    if isinstance(value, torch.Tensor):
        return _encode_tensor(value, tensors, seen, where, copy, stage)
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    if isinstance(value, float):
        return {"float": value if math.isfinite(value) else str(value)}
    if isinstance(value, str):
        return {"str": value}
    if value is None:
        return {"none": None}
    if isinstance(value, (list, tuple)):
        kind = "tuple" if isinstance(value, tuple) else "list"
        return {kind: [_encode(v, tensors, seen, f"{where}[{i}]", copy, stage) for i, v in enumerate(value)]}
    if isinstance(value, dict):
        bad = next((k for k in value if not isinstance(k, _KEYS)), None)
        if bad is not None:
            raise TypeError(f"{where}: a key of type {type(bad).__name__} ({bad!r}); keys are strings, integers, "
                            f"booleans or None")
        return {"dict": [[k, _encode(v, tensors, seen, f"{where}[{k!r}]", copy, stage)] for k, v in value.items()]}
    raise TypeError(f"{where} is a {type(value).__name__}: a checkpoint holds tensors, numbers, strings, None and "
                    f"lists, tuples or dicts of them")


def _encode_tensor(value, tensors: dict, seen: dict, where: str, copy: bool, stage):
    """A tensor's node: its bytes kept once under a key (a DTensor's local shard, with its box)."""
    key = seen.get(id(value))
    dtensor = isinstance(value, _dtensor_class())
    local = value.to_local() if dtensor else value
    if key is None:
        key = seen[id(value)] = f"t{len(tensors)}"
        if not copy:
            tensors[key] = local
        elif stage is not None:
            tensors[key] = stage(key, local)
        else:
            tensors[key] = local.detach().to("cpu", copy=True).contiguous()
    if not dtensor:
        return {"tensor": key}
    shape, offset = _local_box(value)
    if list(local.shape) != shape:
        raise ValueError(f"{where}: the local shard's shape {list(local.shape)} is not its layout's {shape}")
    return {"dtensor": key, "shape": list(value.shape), "dtype": _dtype_name(value.dtype), "offset": offset,
            "local": shape}


def _scalar(kind: str, value, where: str):
    """A leaf of the index (an int, bool, str, None or float node's value), checked to be one."""
    if kind == "float":
        if isinstance(value, str) and value in _NON_FINITE:
            return _NON_FINITE[value]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError(f"checkpoint: {where} is not a float")
    expected = {"int": int, "bool": bool, "str": str, "none": type(None)}[kind]
    if not isinstance(value, expected) or (kind == "int" and isinstance(value, bool)):
        raise ValueError(f"checkpoint: {where} is not a {kind}")
    return value


# -- reading ------------------------------------------------------------------------------------
def read_index(path: str, rank: int, world_size: int) -> dict:
    """Rank ``rank``'s index of a checkpoint of ``world_size`` ranks, checked to be one."""
    try:
        with open(path, encoding="utf-8") as fh:
            index = json.load(fh, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"checkpoint index {os.path.basename(path)} is not JSON: {str(exc)[:200]}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("rank") != rank or \
            index.get("world_size") != world_size or not isinstance(index.get("tree"), dict):
        raise ValueError(f"checkpoint index {os.path.basename(path)} is not rank {rank}'s of {world_size} in the "
                         f"{FORMAT} format")
    return index


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


class Reader:
    """A sharded checkpoint of ``len(indexes)`` ranks, read into this rank's state.
    ``fetch(rank) -> path``: that rank's .safetensors on disk (called for those needed only)."""

    def __init__(self, indexes: list[dict], fetch, rank: int):
        self.indexes, self.fetch, self.rank = indexes, fetch, rank
        self._files: dict[int, object] = {}

    def close(self) -> None:
        for handle in self._files.values():
            handle.__exit__(None, None, None)
        self._files.clear()

    def has(self, name: str, rank: int) -> bool:
        return rank < len(self.indexes) and any(k == name for k, _ in _children(self.indexes[rank]["tree"], "dict"))

    def value(self, name: str, target=None, rank: int | None = None):
        """Top-level entry ``name`` ("model", "optim", "rng", "tracked") as saved by ``rank``
        (default: this rank's own, else rank 0's), with every sharded tensor rebuilt to the
        layout of the DTensor at its place in ``target``, or whole where there is none."""
        if rank is None:
            rank = self.rank if self.rank < len(self.indexes) else 0
        node = _child(self.indexes[rank]["tree"], name, "state")
        if node is None:
            return None
        return self._decode(node, target, rank, (name,), name)

    # -- one node ---------------------------------------------------------------------------
    def _decode(self, node, target, rank: int, path: tuple, where: str):
        if not isinstance(node, dict) or len(node) != 1 and "dtensor" not in node:
            raise ValueError(f"checkpoint: {where} is no node of the index")
        if "dtensor" in node or "tensor" in node:
            return self._tensor(node, target, rank, path, where)
        (kind, value), = node.items()
        if kind in ("int", "bool", "str", "none", "float"):
            return _scalar(kind, value, where)
        if kind in ("list", "tuple"):
            if not isinstance(value, list):
                raise ValueError(f"checkpoint: {where} is not a {kind}")
            targets = target if isinstance(target, (list, tuple)) and len(target) == len(value) else [None] * len(value)
            items = [self._decode(v, t, rank, (*path, i), f"{where}[{i}]") for i, (v, t) in enumerate(zip(value, targets))]
            return tuple(items) if kind == "tuple" else items
        if kind == "dict":
            out = {}
            for key, child in _children(node, "dict", where):
                sub = target.get(key) if isinstance(target, dict) else None
                out[key] = self._decode(child, sub, rank, (*path, key), f"{where}[{key!r}]")
            return out
        raise ValueError(f"checkpoint: {where} is a {kind!r} node, which the format does not have")

    def _tensor(self, node: dict, target, rank: int, path: tuple, where: str):
        sharded = isinstance(target, _dtensor_class())
        if "tensor" in node and not sharded:
            tensor = self._open(rank).get_tensor(_key(node, "tensor", where))
            return tensor.to(target.device) if isinstance(target, torch.Tensor) else tensor
        whole = _whole(node, rank, where)
        if sharded:
            if list(target.shape) != whole:
                raise ValueError(f"checkpoint: {where} has shape {whole}; the model's is {list(target.shape)}")
            shape, offset = _local_box(target)
        else:  # no DTensor to fit: the whole tensor
            shape, offset = whole, [0] * len(whole)
        out = torch.empty(shape, dtype=target.dtype if sharded else _dtype(node, where))
        covered, boxes, placed = 0, set(), []
        for other in range(len(self.indexes)):
            piece = self._node_at(other, path, where)
            key, box = _key(piece, "dtensor" if "dtensor" in piece else "tensor", where), _box(piece, other, where)
            if _whole(piece, other, where) != whole:
                raise ValueError(f"checkpoint: rank {other}'s {where} is a tensor of shape {_whole(piece, other, where)}, "
                                 f"rank {rank}'s of {whole}")
            if box in boxes:
                continue  # the same block from another rank (replicated)
            boxes.add(box)
            overlap = _overlap(box, (tuple(offset), tuple(shape)))
            if overlap is None:
                continue
            start, size = overlap
            if any(_overlap((start, size), other_box) for other_box in placed):
                raise ValueError(f"checkpoint: the shards of {where} overlap (rank {other}'s)")
            placed.append((start, size))
            source = self._open(other).get_slice(key)
            if list(source.get_shape()) != list(box[1]):
                raise ValueError(f"checkpoint: rank {other}'s {where} has shape {source.get_shape()}, its index "
                                 f"says {list(box[1])}")
            src = tuple(slice(s - o, s - o + n) for s, o, n in zip(start, box[0], size))
            dst = tuple(slice(s - o, s - o + n) for s, o, n in zip(start, offset, size))
            out[dst] = source[src].to(out.dtype)
            covered += math.prod(size)
        if covered != out.numel():
            raise ValueError(f"checkpoint: the shards of {where} cover {covered} of the {out.numel()} values this "
                             f"rank needs")
        if sharded:
            with torch.no_grad():
                target.to_local().copy_(out)
            return target
        return out

    def _node_at(self, rank: int, path: tuple, where: str) -> dict:
        node = self.indexes[rank]["tree"]
        for step in path:
            if "dict" in node:
                node = _child(node, step, where)
            elif isinstance(step, int) and len(node) == 1 and next(iter(node)) in ("list", "tuple") and \
                    step < len(next(iter(node.values()))):
                node = next(iter(node.values()))[step]
            else:
                node = None
            if not isinstance(node, dict):
                raise ValueError(f"checkpoint: rank {rank}'s index has no {where}")
        if "dtensor" not in node and "tensor" not in node:
            raise ValueError(f"checkpoint: rank {rank}'s {where} is no tensor")
        return node

    def _open(self, rank: int):
        if rank not in self._files:
            manager = safe_open(self.fetch(rank), framework="pt", device="cpu")
            self._files[rank] = manager.__enter__()
        return self._files[rank]


def _children(node: dict, kind: str, where: str = "state") -> list:
    items = node.get(kind) if isinstance(node, dict) else None
    if not isinstance(items, list) or not all(isinstance(i, list) and len(i) == 2 and isinstance(i[0], _KEYS)
                                              for i in items):
        raise ValueError(f"checkpoint: {where} is not a dict of the index")
    return items


def _child(node: dict, key, where: str):
    return next((child for k, child in _children(node, "dict", where) if k == key and type(k) is type(key)), None)


def _key(node: dict, kind: str, where: str) -> str:
    key = node.get(kind)
    if not isinstance(key, str):
        raise ValueError(f"checkpoint: {where} names no tensor")
    return key


def _ints(value, length: int | None, where: str) -> list[int]:
    if not isinstance(value, list) or (length is not None and len(value) != length) or \
            not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**62 for v in value):
        raise ValueError(f"checkpoint: {where} has a bad shape or offset")
    return value


def _whole(node: dict, rank: int, where: str) -> list[int]:
    """The whole tensor's shape (a plain tensor's is its own, read from the index's box)."""
    if "dtensor" in node:
        return _ints(node.get("shape"), None, where)
    raise ValueError(f"checkpoint: rank {rank}'s {where} is a plain tensor, the model's a sharded one")


def _box(node: dict, rank: int, where: str) -> tuple[tuple, tuple]:
    """(offsets, shape) of a shard in its whole tensor, checked to lie inside it."""
    whole = _whole(node, rank, where)
    offset, local = _ints(node.get("offset"), len(whole), where), _ints(node.get("local"), len(whole), where)
    if any(o + n > w for o, n, w in zip(offset, local, whole)):
        raise ValueError(f"checkpoint: rank {rank}'s shard of {where} lies outside the tensor")
    return tuple(offset), tuple(local)


def _dtype(node: dict, where: str) -> torch.dtype:
    dtype = getattr(torch, str(node.get("dtype")), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"checkpoint: {where} has no dtype torch knows")
    return dtype


def _overlap(a: tuple, b: tuple) -> tuple[list[int], list[int]] | None:
    """Where boxes ``a`` and ``b`` (offsets, shape) meet: (start, size), or None."""
    start = [max(x, y) for x, y in zip(a[0], b[0])]
    size = [max(0, min(x + n, y + m) - s) for s, x, n, y, m in zip(start, a[0], a[1], b[0], b[1])]
    return (start, size) if math.prod(size) > 0 else None


__all__ = ["FORMAT", "file_names", "save", "check", "read_index", "Reader"]
