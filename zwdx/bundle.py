"""The job bundle: the submitter's model, functions and optimizer settings, cloudpickled.

Layout: a magic line, the pickle's length, the pickle, then every tensor's bytes (64-byte
aligned). Tensors leave the pickle as references into that data (pickle's persistent ids), so
a 500 MB model is written with one copy and read back with one (into memory the GPU client
checks against the job's sha256 before anything is unpickled, ``load``), instead of torch
pickling each storage into a zip of its own. The submitter's model is never changed:
tensors on a GPU are copied to host memory as they are written. After the pickle, inside the
length given, comes a JSON object: the source text of the code sent by value, by file name.

Code from the submitter's own modules (anything not installed in site-packages or the
standard library) and from ``__main__`` travels by value, so a GPU client needs the packages
but not the submitter's source tree. Its code keeps its file names (cloudpickle would write
``<dynamic-code>``) and its files' text travels with it: ``register_sources`` hands that to
``linecache``, so a traceback on a GPU client names the submitter's file and shows its lines.
The optimizer travels as its class and every param group's hyperparameters and is rebuilt on
each rank over the wrapped model's parameters; FSDP's
``fsdp_units`` (module classes or a function) travel pickled beside the model, whose classes
they name.

Only GPU clients unpickle a bundle, and only bytes whose sha256 is the job's (``load``); the
server stores and forwards its bytes untouched.
``required_modules`` reads which installed packages a bundle refers to from its pickle's
opcodes, running none of it, so that the scheduler can keep the job off GPU clients that
lack one.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import io
import json
import linecache
import logging
import mmap
import os
import pickletools
import struct
import sys
import sysconfig
import time
import types

import cloudpickle

from .checks import check_signature, fsdp_units_spec, pickle_errors, unpicklable_error
from .errors import BadRequest
from .hashing import Behind
from .protocol import runtime_versions

log = logging.getLogger(__name__)

FORMAT = 2
MAGIC = b"ZWDX-BUNDLE-2\n"
_ALIGN = 64
_READ_BYTES = 8 << 20
_FOLLOW_S = 0.002  # how long a rank reading a bundle still being written waits for more
#: What a rank says when its GPU client told it the bundle could not be fetched.
FETCH_FAILED = "the GPU client could not fetch the job's bundle"


def _installed_roots() -> tuple[str, ...]:
    return _roots(tuple(sys.path))


@functools.lru_cache(maxsize=8)
def _roots(path: tuple[str, ...]) -> tuple[str, ...]:
    """The directories of the standard library and installed packages for this ``sys.path``
    (asked once per module a bundle's code refers to: cached, it was most of a small ``pack``)."""
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.update(p for p in path if p.rstrip("/").endswith(("site-packages", "dist-packages")))
    return tuple(os.path.realpath(r) for r in roots)


@functools.lru_cache(maxsize=1)
def _distributed() -> frozenset[str]:
    """Top-level names that an installed distribution provides, wherever it lies on ``sys.path``
    (``pip install --target DIR`` with ``PYTHONPATH=DIR`` has no site-packages in its path), but
    for editable installs (``pip install -e .``: the submitter's own tree, which travels by value)."""
    import importlib.metadata as metadata
    names = set()
    for top, dists in metadata.packages_distributions().items():
        if not all(_editable(metadata, d) for d in dists):
            names.add(top)
    return frozenset(names)


def _editable(metadata, name: str) -> bool:
    try:
        text = metadata.distribution(name).read_text("direct_url.json")
        return bool(text and json.loads(text).get("dir_info", {}).get("editable"))
    except (metadata.PackageNotFoundError, ValueError, AttributeError):
        return False


def is_user_module(module: types.ModuleType | None) -> bool:
    """True for modules of the submitter's own source tree (not stdlib, not installed)."""
    if module is None or module.__name__ == "__main__":
        return False  # __main__ is pickled by value already
    path = getattr(module, "__file__", None)
    if not path:
        return False
    path = os.path.realpath(path)
    return not any(path.startswith(root + os.sep) for root in _installed_roots()) and \
        not module.__name__.startswith(("zwdx", "gpu_client", "torch", "cloudpickle")) and \
        module.__name__.partition(".")[0] not in _distributed()


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
        if name in globs:
            _reached(globs[name], seen, found, depth + 1)
    for cell in getattr(obj, "__closure__", None) or ():  # a closure's cells: a factory's arguments
        try:
            _reached(cell.cell_contents, seen, found, depth + 1)
        except ValueError:  # an empty cell
            pass


def _reached(value, seen: set, found: dict, depth: int) -> None:
    """``_referenced`` for a value a function reaches: a function, class or module itself; an
    object through its class and its attributes; a container through its items (the first 100).
    (A user object pickled by reference would make its module a package GPU clients must have.)"""
    if isinstance(value, (types.FunctionType, type, types.ModuleType)):
        _referenced(value, seen, found, depth)
        return
    if id(value) in seen or depth > 6 or isinstance(value, (str, bytes, int, float, bool)) or value is None:
        return
    seen.add(id(value))
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
    else:
        _referenced(type(value), seen, found, depth)
        items = list(getattr(value, "__dict__", {}).values())
    for item in items[:100]:
        _reached(item, seen, found, depth + 1)


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


#: The file name cloudpickle gives the code it sends by value.
_NO_FILE = "<dynamic-code>"


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, plus three things. Modules whose type subclasses ModuleType (torch.backends.cudnn
    and its siblings replace themselves in sys.modules so) go by name, as plain modules go;
    without it a train_func that sets ``torch.backends.cudnn.benchmark`` cannot be submitted.
    Code sent by value keeps its file name, and the names are collected in ``self.files``.
    Plain tensors and parameters go out of the pickle, into ``self.tensors``."""

    def __init__(self, file):
        super().__init__(file, protocol=5)
        self.tensors: list = []           # CPU, contiguous, in the order of their ids
        self.files: set[str] = set()      # file names of the code sent by value
        self._ids: dict[int, tuple] = {}  # id(tensor) -> its persistent id (a tied weight stays one)
        self._keep: list = []             # the originals, so that no id is reused while pickling

    def reducer_override(self, obj):
        if isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType:
            return importlib.import_module, (obj.__name__,)
        if isinstance(obj, types.CodeType) and obj.co_filename != _NO_FILE:
            # cloudpickle pickles the copy, naming it <dynamic-code>; loading puts the name back
            # (with functools and CodeType only: GPU clients of older zwdx versions load it too)
            self.files.add(obj.co_filename)
            return (functools.partial(types.CodeType.replace, co_filename=obj.co_filename),
                    (obj.replace(co_filename=_NO_FILE),))
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


def pack(model, data_loader_func, train_func, eval_func=None, optimizer=None, fsdp_units=None) -> bytes:
    """Cloudpickle what a rank needs into bytes (see the module's doc for the layout). Checks
    first what would otherwise fail only on the GPU clients: a function that declares an
    argument zwdx does not offer, and anything that cannot be pickled (named)."""
    return b"".join(pack_parts(model, data_loader_func, train_func, eval_func, optimizer, fsdp_units))


def pack_parts(model, data_loader_func, train_func, eval_func=None, optimizer=None, fsdp_units=None) -> list:
    """``pack``'s bytes as the buffers they are made of, in order, not joined: the head (magic,
    lengths, the pickle, the tensor table; ``parts[:HEAD_PARTS]``) then each tensor's bytes
    (views of the model's CPU tensors), so an upload sends a 500 MB model without copying it
    once more."""
    functions = {"data_loader_func": data_loader_func, "train_func": train_func, "eval_func": eval_func}
    for name, fn in functions.items():
        if fn is None and name == "eval_func":
            continue
        if not callable(fn):
            expected = "a function or None" if name == "eval_func" else "a function"
            raise BadRequest(f"{name} must be {expected}, got {type(fn).__name__}", field=name)
        check_signature(fn, name)
    if not hasattr(model, "state_dict") or not hasattr(model, "parameters"):
        raise BadRequest(f"model must be a torch.nn.Module, got {type(model).__name__}", field="model")
    units = fsdp_units_spec(fsdp_units, model)
    found: dict[str, types.ModuleType] = {}
    seen: set = set()
    for obj in (data_loader_func, train_func, eval_func, *{type(m) for m in model.modules()},
                *(units if isinstance(units, tuple) else (units,))):
        if obj is not None:
            _referenced(obj, seen, found)
    spec = optimizer_spec(optimizer, model)
    payload = {"format": FORMAT, "model": model, "data_loader_func": data_loader_func,
               "train_func": train_func, "eval_func": eval_func, "optimizer": spec,
               "fsdp_units": units, "versions": runtime_versions()}
    for module in found.values():
        cloudpickle.register_pickle_by_value(module)
    try:
        head = io.BytesIO()
        pickler = _Pickler(head)
        try:
            pickler.dump(payload)
        except pickle_errors as exc:
            raise unpicklable_error(exc, model, functions) from None
    finally:
        for module in found.values():
            cloudpickle.unregister_pickle_by_value(module)
    head.write(json.dumps(_sources(pickler.files)).encode())
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
    return [MAGIC, struct.pack("<QQ", len(pickled), len(table)), pickled,
            struct.pack(f"<{len(table)}Q", *table), bytes(-head_len % _ALIGN), *parts]


#: How many of ``pack_parts``'s buffers are the head (``required_modules`` reads only those).
HEAD_PARTS = 3


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
    stream = io.BytesIO(pickled)
    payload = _Unpickler(stream, tensors, offsets).load()
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError("not a zwdx job bundle of a format this gpu client understands")
    rest = stream.read()  # the pickle ends where the sources begin
    payload["sources"] = json.loads(rest) if rest else {}
    return payload


def _sources(files) -> dict[str, str]:
    """The text of each file (what ``linecache`` has: a file on disk, or a notebook's cell)."""
    sources = {}
    for name in sorted(files):
        lines = linecache.getlines(name)
        if lines:
            sources[name] = "".join(lines)
    return sources


def register_sources(sources: dict[str, str]) -> None:
    """Give ``linecache`` the submitter's source text (GPU clients, before running the code), so
    tracebacks and ``inspect.getsource`` show it whether or not such a file exists here. An
    entry without a modification time is never checked against the disk."""
    for name, text in sources.items():
        linecache.cache[name] = (len(text), None, text.splitlines(True), name)


def load(path: str, sha256: str, size: int | None = None, arrived=None) -> dict:
    """``unpack`` the bundle file at ``path``, if its bytes are the bundle whose sha256 is
    ``sha256`` (the job's, as the server stored it): read once into this process's own memory
    and hashed there, so the bytes unpickled are the bytes checked, whatever happens to the file
    meanwhile; ``ValueError`` otherwise, with nothing of it run. Tensors are views of that
    memory (an anonymous map: pages are taken as they are read), never copied again.

    With ``size``, the file is still being written (the GPU client fetches it): it is read as it
    grows, up to ``size`` bytes; ``arrived()`` is asked whenever the reading caught up: None (no
    word yet), True (the writer is done: a file still short is read anew from ``path``, where a
    whole copy may have replaced it) or False (the fetch failed: ``RuntimeError``)."""
    fh = _growing(path, arrived) if size else open(path, "rb", buffering=0)
    try:
        total = size or os.fstat(fh.fileno()).st_size
        if total == 0:
            raise ValueError(f"bundle file {path} is empty")
        buffer = mmap.mmap(-1, total)
        view, digest, got, done = memoryview(buffer), hashlib.sha256(), 0, False
        with Behind(digest.update) as behind:  # block k hashed while block k+1 is read
            while got < total:
                n = fh.readinto(view[got:got + _READ_BYTES])
                if n:
                    behind.put(view[got:got + n])
                    got += n
                    continue
                if not size or done:
                    break
                word = arrived()
                if word is False:
                    raise RuntimeError(FETCH_FAILED)
                if word:  # written whole: what is left, from the file as it is now
                    done = True
                    fh.close()
                    fh = open(path, "rb", buffering=0)
                    fh.seek(got)
                else:
                    time.sleep(_FOLLOW_S)
        grew = fh.read(1)
    finally:
        fh.close()
    if got != total or grew or digest.hexdigest() != sha256:
        view.release()
        buffer.close()
        raise ValueError(f"bundle file {path} is not the job's bundle (its sha256 is not {sha256}): "
                         f"changed or cut short on disk since it was fetched; not loaded")
    return unpack(view)


def _growing(path: str, arrived):
    """``path`` opened for reading once it is there (the GPU client links it in as it starts
    writing); ``RuntimeError`` if the fetch failed first."""
    while True:
        try:
            return open(path, "rb", buffering=0)
        except FileNotFoundError:
            if arrived() is False:
                raise RuntimeError(FETCH_FAILED) from None
            time.sleep(_FOLLOW_S)
