"""The job bundle: the submitter's model, functions and optimizer settings, cloudpickled.

Layout: a magic line, the pickle's length, the pickle, then every tensor's bytes (64-byte
aligned). Tensors leave the pickle as references into that data (pickle's persistent ids), so
a 500 MB model is written with one copy and read back straight from a memory map, instead of
torch pickling each storage into a zip of its own. The submitter's model is never changed:
tensors on a GPU are copied to host memory as they are written.

Code from the submitter's own modules (anything not installed in site-packages or the
standard library) travels by value, so a GPU client needs the packages but not the
submitter's source tree. The optimizer travels as its class and every param group's
hyperparameters and is rebuilt on each rank over the wrapped model's parameters.

Only GPU clients unpickle a bundle; the server stores and forwards its bytes untouched.
``required_modules`` reads which installed packages a bundle refers to from its pickle's
opcodes, running none of it, so that the scheduler can keep the job off GPU clients that
lack one.
"""
from __future__ import annotations

import importlib
import inspect
import io
import logging
import mmap
import os
import pickletools
import struct
import sys
import sysconfig
import types

import cloudpickle

from .errors import BadRequest
from .protocol import runtime_versions

log = logging.getLogger(__name__)

FORMAT = 2
MAGIC = b"ZWDX-BUNDLE-2\n"
_ALIGN = 64


def _installed_roots() -> list[str]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.update(p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages")))
    return [os.path.realpath(r) for r in roots]


def is_user_module(module: types.ModuleType | None) -> bool:
    """True for modules of the submitter's own source tree (not stdlib, not installed)."""
    if module is None or module.__name__ == "__main__":
        return False  # __main__ is pickled by value already
    path = getattr(module, "__file__", None)
    if not path:
        return False
    path = os.path.realpath(path)
    return not any(path.startswith(root + os.sep) for root in _installed_roots()) and \
        not module.__name__.startswith(("zwdx", "gpu_client", "torch", "cloudpickle"))


def _referenced(obj, seen: set, found: dict, depth: int = 0) -> None:
    """Collect user modules that ``obj`` (a function, class or module) reaches through globals."""
    if id(obj) in seen or depth > 6:
        return
    seen.add(id(obj))
    if isinstance(obj, types.ModuleType):
        if is_user_module(obj):
            found[obj.__name__] = obj
        return
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    if is_user_module(module):
        found[module.__name__] = module
    if isinstance(obj, type):
        for base in obj.__mro__[1:]:
            _referenced(base, seen, found, depth + 1)
        for value in vars(obj).values():
            if isinstance(value, (types.FunctionType, staticmethod, classmethod)):
                _referenced(getattr(value, "__func__", value), seen, found, depth + 1)
        return
    code = getattr(obj, "__code__", None)
    if code is None:
        return
    names, stack = set(), [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    globs = getattr(obj, "__globals__", {})
    for name in names:
        value = globs.get(name)
        if isinstance(value, (types.FunctionType, type, types.ModuleType)):
            _referenced(value, seen, found, depth + 1)


def optimizer_spec(optimizer, model) -> dict | None:
    """An optimizer as its class and every param group's settings, with the model's parameter
    names where the group's parameters belong to ``model`` (else None: all parameters)."""
    if optimizer is None:
        return None
    if not hasattr(optimizer, "param_groups"):
        raise BadRequest("optimizer must be a torch.optim.Optimizer instance", field="optimizer")
    names = {id(p): n for n, p in model.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        pnames = [names.get(id(p)) for p in group["params"]]
        groups.append({"hyper": hyper, "params": pnames if pnames and all(pnames) else None})
    return {"cls": type(optimizer), "groups": groups}


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, plus two things. Modules whose type subclasses ModuleType (torch.backends.cudnn
    and its siblings replace themselves in sys.modules so) go by name, as plain modules go;
    without it a train_func that sets ``torch.backends.cudnn.benchmark`` cannot be submitted.
    Plain tensors and parameters go out of the pickle, into ``self.tensors``."""

    def __init__(self, file):
        super().__init__(file, protocol=5)
        self.tensors: list = []           # CPU, contiguous, in the order of their ids
        self._ids: dict[int, tuple] = {}  # id(tensor) -> its persistent id (a tied weight stays one)
        self._keep: list = []             # the originals, so that no id is reused while pickling

    def reducer_override(self, obj):
        if isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType:
            return importlib.import_module, (obj.__name__,)
        return super().reducer_override(obj)

    def persistent_id(self, obj):
        import torch
        if type(obj) not in (torch.Tensor, torch.nn.Parameter) or obj.layout != torch.strided \
                or obj.is_quantized or obj.device.type == "meta":
            return None
        pid = self._ids.get(id(obj))
        if pid is None:
            data = obj.detach().resolve_conj().resolve_neg().cpu().contiguous()
            pid = ("tensor", len(self.tensors), str(data.dtype).removeprefix("torch."), tuple(data.shape),
                   bool(obj.requires_grad), isinstance(obj, torch.nn.Parameter))
            self.tensors.append(data)
            self._ids[id(obj)] = pid
            self._keep.append(obj)
        return pid


class _Unpickler(cloudpickle.pickle.Unpickler):
    """Rebuilds the tensors a bundle's pickle refers to, as views of its data (no copy)."""

    def __init__(self, file, data: memoryview, offsets: list[int]):
        super().__init__(file)
        self._data, self._offsets, self._made = data, offsets, {}

    def persistent_load(self, pid):
        import torch
        kind, index, dtype, shape, requires_grad, parameter = pid
        if kind != "tensor":
            raise ValueError(f"bundle refers to an unknown kind of object: {kind!r}")
        if index in self._made:
            return self._made[index]
        start, end = self._offsets[index], self._offsets[index + 1]
        dt = getattr(torch, dtype)
        size = int(torch.Size(shape).numel()) * dt.itemsize
        if size > end - start:
            raise ValueError("bundle is truncated: a tensor's bytes are missing")
        flat = (torch.frombuffer(self._data, dtype=torch.uint8, count=size, offset=start) if size
                else torch.empty(0, dtype=torch.uint8))
        tensor = flat.view(dt).reshape(shape)
        tensor = torch.nn.Parameter(tensor, requires_grad=requires_grad) if parameter \
            else tensor.requires_grad_(requires_grad)
        self._made[index] = tensor
        return tensor


def pack(model, data_loader_func, train_func, eval_func=None, optimizer=None) -> bytes:
    """Cloudpickle what a rank needs into bytes (see the module's doc for the layout)."""
    for name, fn in (("data_loader_func", data_loader_func), ("train_func", train_func)):
        if not callable(fn):
            raise BadRequest(f"{name} must be a function, got {type(fn).__name__}", field=name)
    if eval_func is not None and not callable(eval_func):
        raise BadRequest(f"eval_func must be a function or None, got {type(eval_func).__name__}", field="eval_func")
    if not hasattr(model, "state_dict") or not hasattr(model, "parameters"):
        raise BadRequest(f"model must be a torch.nn.Module, got {type(model).__name__}", field="model")
    found: dict[str, types.ModuleType] = {}
    seen: set = set()
    for obj in (data_loader_func, train_func, eval_func, *{type(m) for m in model.modules()}):
        if obj is not None:
            _referenced(obj, seen, found)
    spec = optimizer_spec(optimizer, model)
    payload = {"format": FORMAT, "model": model, "data_loader_func": data_loader_func,
               "train_func": train_func, "eval_func": eval_func, "optimizer": spec,
               "versions": runtime_versions()}
    for module in found.values():
        cloudpickle.register_pickle_by_value(module)
    try:
        head = io.BytesIO()
        pickler = _Pickler(head)
        pickler.dump(payload)
    finally:
        for module in found.values():
            cloudpickle.unregister_pickle_by_value(module)
    import torch
    pickled = head.getbuffer()
    table, offset, parts = [], 0, []
    for tensor in pickler.tensors:  # where each tensor's bytes start, counted from the data's start
        n = tensor.numel() * tensor.element_size()
        table.append(offset)
        if n:
            parts.append(tensor.reshape(-1).view(torch.uint8).numpy())
        parts.append(bytes(-n % _ALIGN))
        offset += n + -n % _ALIGN
    table.append(offset)
    head_len = len(MAGIC) + 16 + len(pickled) + 8 * len(table)
    return b"".join([MAGIC, struct.pack("<QQ", len(pickled), len(table)), pickled,
                     struct.pack(f"<{len(table)}Q", *table), bytes(-head_len % _ALIGN), *parts])


#: Top-level modules every GPU client has (it runs them), left out of ``required_modules``.
_ALWAYS_THERE = frozenset({"zwdx", "gpu_client", "torch", "cloudpickle", "__main__", "builtins"})
#: Globals that import the module named by the string they are called with (cloudpickle pickles
#: a module so, and ``_Pickler.reducer_override`` its ModuleType subclasses).
_IMPORTERS = frozenset({("cloudpickle.cloudpickle", "subimport"), ("cloudpickle.cloudpickle_fast", "subimport"),
                        ("importlib", "import_module")})
_STRINGS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING",
                      "BINSTRING", "STRING"})


def _pickled(data) -> memoryview:
    view = memoryview(data)
    if bytes(view[:len(MAGIC)]) != MAGIC:
        raise ValueError("not a zwdx job bundle of a format this gpu client understands "
                         "(submitted from another zwdx version?)")
    (pickle_len,) = struct.unpack_from("<Q", view, len(MAGIC))
    start = len(MAGIC) + 16
    return view[start:start + pickle_len]


def required_modules(data) -> list[str]:
    """The top-level modules a bundle (``pack``'s bytes) imports by reference, leaving out the
    standard library and what every GPU client runs (zwdx, torch, cloudpickle): the packages a
    GPU client must have installed to load it. Read from the pickle's opcodes without running
    them: GLOBAL and STACK_GLOBAL name a module, and the importers (cloudpickle's ``subimport``)
    take one as the string they are called with. Modules that functions import in their body
    are not counted (such an import may never run)."""
    found: set[str] = set()
    memo: dict[int, object] = {}
    recent: list = [None, None]  # what the last two pushing opcodes pushed: a str, a global or None
    importing = False            # an importer was just pushed: the next string names a module
    for op, arg, _ in pickletools.genops(io.BytesIO(_pickled(data))):
        name = op.name
        if name == "MEMOIZE":
            memo[len(memo)] = recent[-1]
            continue
        if name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(arg)] = recent[-1]
            continue
        value = None
        if name in _STRINGS:
            value = arg.decode("latin-1") if isinstance(arg, bytes) else arg
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            value = memo.get(int(arg))
        elif name == "GLOBAL":
            value = tuple(arg.split(" ", 1))
        elif name == "STACK_GLOBAL" and all(isinstance(v, str) for v in recent):
            value = (recent[0], recent[1])
        if isinstance(value, tuple):
            found.add(value[0])
            importing = value in _IMPORTERS
        elif isinstance(value, str) and importing:
            found.add(value)
            importing = False
        else:
            importing = False
        recent = [recent[-1], value]
    tops = {module.split(".")[0] for module in found}
    return sorted(m for m in tops if m.isidentifier() and m not in _ALWAYS_THERE
                  and m not in sys.stdlib_module_names)


def unpack(data) -> dict:
    """Load a bundle (GPU clients only: this runs the submitter's code). ``data``: its bytes,
    or any buffer; tensors are views of it (writable buffers only, else copied)."""
    view = memoryview(data)
    if bytes(view[:len(MAGIC)]) != MAGIC:
        raise ValueError("not a zwdx job bundle of a format this gpu client understands "
                         "(submitted from another zwdx version?)")
    pos = len(MAGIC)
    pickle_len, table_len = struct.unpack_from("<QQ", view, pos)
    pos += 16
    pickled = view[pos:pos + pickle_len]
    pos += pickle_len
    offsets = list(struct.unpack_from(f"<{table_len}Q", view, pos))
    pos += 8 * table_len
    pos += -pos % _ALIGN
    tensors = view[pos:]
    if view.readonly:
        tensors = memoryview(bytearray(tensors))
    if len(tensors) < offsets[-1]:
        raise ValueError("bundle is truncated: its tensor data is shorter than its index says")
    payload = _Unpickler(io.BytesIO(pickled), tensors, offsets).load()
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError("not a zwdx job bundle of a format this gpu client understands")
    return payload


def load(path: str) -> dict:
    """``unpack`` a bundle file through a private memory map: a tensor's pages are read when the
    rank first touches them (moving the model to its GPU), never copied in between."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            raise ValueError(f"bundle file {path} is empty")
        mapped = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY)
    return unpack(mapped)


def default_epochs(train_func) -> int:
    """The epochs a job submitted without ``epochs`` trains for: the default of ``train_func``'s
    ``epochs`` argument, or 1."""
    try:
        param = inspect.signature(train_func).parameters.get("epochs")
    except (TypeError, ValueError):
        return 1
    if param is not None and isinstance(param.default, int) and not isinstance(param.default, bool) \
            and param.default >= 1:
        return param.default
    return 1


def call_with(fn, available: dict, what: str):
    """Call ``fn`` with the named arguments it declares, taken from ``available``."""
    sig = inspect.signature(fn)
    params = sig.parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return fn(**available)
    kwargs = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in available:
            kwargs[p.name] = available[p.name]
        elif p.default is p.empty:
            raise TypeError(f"{what} declares argument '{p.name}', which zwdx does not provide; "
                            f"it provides {', '.join(sorted(available))}")
    return fn(**kwargs)
